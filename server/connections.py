"""A cap on the server's open connections (``server.max_connections``).

Every accepted socket costs memory before a request is read: the kernel's buffers, aiohttp's
protocol and parser and, over TLS, the handshake and the SSL object's buffers. Requests are
already bounded (body buffers, upload invitations, timeouts); this bounds the connections
themselves. The listening socket's protocol factory is wrapped: while ``limit`` connections
are open (counted from accept, so TLS handshakes in flight count), a new one is answered with
one ``503 too_many_connections`` response and closed, and the service goes on answering the
connections it holds. A node treats 503 as "retry with backoff" (client/http.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0


class ConnectionCap:
    """The protocol factory of a capped listener: ``loop.create_server(ConnectionCap(factory, n), ...)``."""

    def __init__(self, factory: Callable[[], asyncio.Protocol], limit: int):
        self.factory = factory
        self.limit = limit
        self.open = 0
        self.refused = 0
        self._warned = -float("inf")

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            self.refused += 1
            now = time.monotonic()
            if now - self._warned >= _WARN_EVERY_S:
                log.warning(
                    "%d connections open (server.max_connections): new ones are answered 503 and closed "
                    "(%d so far; logged at most once a minute)",
                    self.open,
                    self.refused,
                )
                self._warned = now
            return _Busy(self.limit)
        self.open += 1
        return _Counted(self.factory(), self)

    def closed(self) -> None:
        self.open -= 1


class _Counted(asyncio.Protocol):
    """The real protocol, and one connection fewer when it is lost (or never made: see __del__)."""

    def __init__(self, inner: asyncio.Protocol, cap: ConnectionCap):
        self.inner = inner
        self.cap: ConnectionCap | None = cap

    def _release(self) -> None:
        if self.cap is not None:
            self.cap.closed()
            self.cap = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self.inner.connection_lost(exc)

    def __del__(self) -> None:
        # a TLS handshake that failed never calls connection_made nor connection_lost of the
        # protocol it was for: its slot comes back when the protocol is dropped
        self._release()


class _Busy(asyncio.Protocol):
    """One 503 answer, then the connection is closed (read nothing, hold nothing)."""

    def __init__(self, limit: int):
        self.limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps(
            {
                "error": "too_many_connections",
                "detail": f"the server holds its limit of {self.limit} connections (server.max_connections); "
                "try again later",
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        ).encode()
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(head + body)
        transport.close()  # after the answer is flushed


async def listen(
    factory: Callable[[], asyncio.Protocol], host: str, port: int, ssl_context, limit: int
) -> tuple[asyncio.Server, ConnectionCap]:
    """Listen on ``host:port`` with at most ``limit`` connections open (see the module doc)."""
    cap = ConnectionCap(factory, limit)
    server = await asyncio.get_running_loop().create_server(cap, host, port, ssl=ssl_context, backlog=128)
    return server, cap
