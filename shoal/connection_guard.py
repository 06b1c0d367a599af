"""The guard in front of every listener (the server, an edge, a gossip peer): strangers cannot
fill the connection slots that enrolled nodes and peers need.

A connection goes through two stages:

* **pending**: accepted, its TLS handshake and its first request's head not yet complete. A
  pending connection has ``handshake_timeout_s`` (a few seconds) for both, then it is aborted.
  Pending connections are bounded per source address (``pending_per_address``) and in all
  (``max_pending``), and neither bound refuses a newcomer: past it, a pending connection (of
  that address, or in all) is aborted to make room, one that has sent nothing first. A crowd of
  silent sockets therefore holds at most ``max_pending`` file descriptors for at most the
  timeout, and evicts only itself once a real client's first bytes are in.
* **served**: its first request's head arrived. Only now is the application's protocol (aiohttp's
  request handler) made and handed the bytes read so far. Served connections are bounded by
  ``max_connections``, of which ``reserved`` slots are only for connections that presented a
  client certificate the TLS context verified (enrolled nodes, peers with a certificate); served
  connections without one are also capped per address (``per_address``). Past a bound, one
  ``503 too_many_connections`` JSON answer, then the connection is closed.

The guard accepts on its own listening sockets: a new socket costs a file descriptor and a
reader registration until its first bytes arrive, and only then is it handed to asyncio (with
TLS: ``loop.connect_accepted_socket``, whose handshake runs under the same deadline). So the
source address is known from the accept, and when a bound is reached the guard drops a socket
that has sent nothing yet before one that is talking (the oldest of each): a crowd of silent
sockets, however fast it is renewed, only ever evicts itself while a real client's hello is in.
Everything here is counted in :class:`ConnectionGuard`'s fields (tests and ``/status`` read them).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .log_redaction import redact

log = logging.getLogger(__name__)

_WARN_EVERY_S = 60.0
_HEAD_END = b"\r\n\r\n"


@dataclass(frozen=True)
class GuardLimits:
    """What one listener holds at once (see the module doc for each stage)."""

    max_connections: int = 1024  # served connections in all
    reserved: int = 64  # of max_connections, slots only connections with a verified client certificate get
    per_address: int = 128  # served connections without a client certificate from one address
    max_pending: int = 256  # connections before their TLS handshake and first request head
    pending_per_address: int = 32  # of max_pending, from one address
    handshake_timeout_s: float = 5.0  # accept -> TLS done and first request head read
    max_head_bytes: int = 65536  # a first request head longer than this is refused (431)

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_pending < 1 or self.pending_per_address < 1 or self.per_address < 1:
            raise ValueError(f"connection limits must be positive: {self}")
        if not 0 <= self.reserved < self.max_connections:
            raise ValueError(f"reserved = {self.reserved} must be in 0..max_connections-1 ({self.max_connections - 1})")
        if not self.handshake_timeout_s > 0:
            raise ValueError(f"handshake_timeout_s = {self.handshake_timeout_s} must be > 0")


def _answer(status: str, code: str, detail: str) -> bytes:
    body = json.dumps({"error": code, "detail": detail}).encode()
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Retry-After: 1\r\nConnection: close\r\n\r\n"
    ).encode() + body


class ConnectionGuard:
    """The protocol factory of a guarded listener: ``loop.create_server(guard, host, port)`` with
    no ``ssl`` there (the guard does the handshake with ``ssl_context``)."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        limits: GuardLimits,
        ssl_context: ssl.SSLContext | None = None,
        what: str = "server.max_connections",
    ):
        self.factory, self.limits, self.ssl_context, self.what = factory, limits, ssl_context, what
        self.pending: OrderedDict[_Guarded, str] = OrderedDict()  # oldest first
        self.pending_by_address: dict[str, OrderedDict[_Guarded, None]] = {}
        self.served = 0
        self.served_certified = 0
        self.served_by_address: dict[str, int] = {}  # without a client certificate
        # what happened so far (counters only grow)
        self.accepted = 0
        self.evicted = 0  # pending connections aborted to make room for newer ones
        self.timed_out = 0  # pending connections past handshake_timeout_s
        self.refused = 0  # answered 503 (a served bound was reached) or 431 (head too long)
        self._warned = -float("inf")
        self.sockets: list[socket.socket] = []  # the listening sockets

    async def start(self, host: str, port: int, backlog: int = 512) -> None:
        """Listen on every address ``host`` resolves to (as asyncio's create_server does)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        seen = set()
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
                sock.listen(backlog)
                sock.setblocking(False)
            except OSError:
                sock.close()
                self.close()
                raise
            self.sockets.append(sock)
            loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listening: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(64):  # then let the loop serve the others
            try:
                conn, addr = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, or the like: the backlog holds the rest
                self._warn(f"accept failed: {e}")
                return
            conn.setblocking(False)
            g = _Guarded(self, conn, str(addr[0]) if isinstance(addr, tuple) and addr else "?")
            g._deadline = loop.call_later(self.limits.handshake_timeout_s, g._expire)
            self._add_pending(g)
            if not g.closed:
                loop.add_reader(conn.fileno(), g._readable)

    # --- pending ------------------------------------------------------------------------------

    def _add_pending(self, conn: _Guarded) -> None:
        self.accepted += 1
        mine = self.pending_by_address.setdefault(conn.address, OrderedDict())
        if len(mine) >= self.limits.pending_per_address:
            self._evict(_victim(mine))
        if len(self.pending) >= self.limits.max_pending:
            self._evict(_victim(self.pending))
        self.pending[conn] = conn.address
        self.pending_by_address.setdefault(conn.address, OrderedDict())[conn] = None

    def _drop_pending(self, conn: _Guarded) -> None:
        if self.pending.pop(conn, None) is None:
            return
        mine = self.pending_by_address.get(conn.address)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self.pending_by_address[conn.address]

    def _evict(self, conn: _Guarded) -> None:
        self.evicted += 1
        self._drop_pending(conn)
        conn.abort()
        self._warn("pending connections were aborted to make room for new ones (a crowd of silent sockets?)")

    # --- served -------------------------------------------------------------------------------

    def _admit(self, conn: _Guarded) -> str | None:
        """Move ``conn`` from pending to served; why not, if it cannot be."""
        self._drop_pending(conn)
        lim = self.limits
        if self.served >= lim.max_connections:
            return f"the listener holds its limit of {lim.max_connections} connections ({self.what})"
        if not conn.certified:
            if self.served - self.served_certified >= lim.max_connections - lim.reserved:
                return (
                    f"the connections open to clients without a certificate are at their limit "
                    f"({lim.max_connections - lim.reserved}; {lim.reserved} are kept for enrolled clients)"
                )
            if self.served_by_address.get(conn.address, 0) >= lim.per_address:
                return f"{lim.per_address} connections are open from this address"
            self.served_by_address[conn.address] = self.served_by_address.get(conn.address, 0) + 1
        else:
            self.served_certified += 1
        self.served += 1
        return None

    def _release(self, conn: _Guarded) -> None:
        self.served -= 1
        if conn.certified:
            self.served_certified -= 1
            return
        left = self.served_by_address.get(conn.address, 1) - 1
        if left > 0:
            self.served_by_address[conn.address] = left
        else:
            self.served_by_address.pop(conn.address, None)

    def _warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self._warned >= _WARN_EVERY_S:
            log.warning(
                "%s; so far %d evicted, %d timed out, %d refused (%d served, %d pending; logged at most once a minute)",
                what,
                self.evicted,
                self.timed_out,
                self.refused,
                self.served,
                len(self.pending),
            )
            self._warned = now

    def close(self) -> None:
        """Stop listening and abort every pending connection (served ones are the server's to end)."""
        for sock in self.sockets:
            try:
                asyncio.get_running_loop().remove_reader(sock.fileno())
            except (RuntimeError, ValueError):
                pass
            sock.close()
        self.sockets = []
        for conn in list(self.pending):
            self._drop_pending(conn)
            conn.abort()


def _victim(pending: OrderedDict) -> _Guarded:
    """The connection a newcomer replaces: the oldest that has sent nothing, else the oldest."""
    return next((c for c in pending if not c.spoke), next(iter(pending)))


class _Guarded(asyncio.Protocol):
    """One connection: pending (TLS, first head) under a deadline, then the application's protocol."""

    def __init__(self, guard: ConnectionGuard, sock: socket.socket, address: str):
        self.guard = guard
        self.sock: socket.socket | None = sock  # until handed to asyncio
        self.address = address
        self.spoke = False  # its first bytes arrived
        self.certified = False
        self.transport: asyncio.Transport | None = None  # plain, or the TLS layer's
        self.inner: asyncio.Protocol | None = None
        self.head = bytearray()
        self.closed = False
        self._deadline: asyncio.TimerHandle | None = None
        self._tls: asyncio.Task | None = None

    def __hash__(self) -> int:
        return id(self)

    def __eq__(self, other: object) -> bool:
        return self is other

    # --- asyncio.Protocol ---------------------------------------------------------------------

    def _readable(self) -> None:
        """Its first bytes are in: hand the socket to asyncio (TLS under the same deadline)."""
        loop = asyncio.get_running_loop()
        sock, self.sock = self.sock, None
        if sock is None or self.closed:
            return
        loop.remove_reader(sock.fileno())
        self.spoke = True
        self._tls = loop.create_task(self._connect(sock))

    async def _connect(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        ctx = self.guard.ssl_context
        try:
            if ctx is None:
                await loop.connect_accepted_socket(lambda: self, sock)
            else:
                left = self._deadline.when() - loop.time() if self._deadline is not None else 0.0
                await loop.connect_accepted_socket(lambda: self, sock, ssl=ctx, ssl_handshake_timeout=max(left, 0.1))
        except (OSError, ssl.SSLError, ConnectionError, TimeoutError, asyncio.CancelledError):
            self.closed = True
            self._disarm()
            self.guard._drop_pending(self)
            sock.close()

    # --- asyncio.Protocol (once the socket is asyncio's: TLS done) ---------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.closed:
            transport.abort()
            return
        ssl_object = transport.get_extra_info("ssl_object")
        self.certified = ssl_object is not None and ssl_object.getpeercert(binary_form=True) is not None

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)
            return
        if self.closed:
            return
        self.head += data
        self._take_head()

    def _take_head(self) -> None:
        if self.closed or self.inner is not None:
            return
        if _HEAD_END in self.head:
            self._serve()
        elif len(self.head) > self.guard.limits.max_head_bytes:
            self.guard._drop_pending(self)
            self.guard.refused += 1
            self._refuse(
                "431 Request Header Fields Too Large",
                "headers_too_large",
                f"a request head is at most {self.guard.limits.max_head_bytes} bytes",
            )

    def eof_received(self) -> bool | None:
        if self.inner is not None:
            return self.inner.eof_received()
        return None  # pending: close

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.inner is not None:
            inner, self.inner = self.inner, None
            self.guard._release(self)
            self.closed = True
            inner.connection_lost(exc)
            return
        self.closed = True
        self.guard._drop_pending(self)

    # --- the stages ---------------------------------------------------------------------------

    def _serve(self) -> None:
        self._disarm()
        why = self.guard._admit(self)
        if why is not None:
            self.guard.refused += 1
            self.guard._warn(f"a connection was refused: {why}")
            self._refuse("503 Service Unavailable", "too_many_connections", why + "; try again later")
            return
        assert self.transport is not None
        self.inner = self.guard.factory()
        self.inner.connection_made(self.transport)
        head, self.head = bytes(self.head), bytearray()
        self.inner.data_received(head)

    def _refuse(self, status: str, code: str, detail: str) -> None:
        self._disarm()
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_answer(status, code, detail))
            self.transport.close()  # after the answer is flushed

    def _expire(self) -> None:
        self._deadline = None
        if self.inner is None and not self.closed:
            self.guard.timed_out += 1
            self.guard._drop_pending(self)
            self.abort()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def abort(self) -> None:
        """Drop the connection now (no answer: it has not asked anything yet)."""
        self._disarm()
        self.closed = True
        if self.sock is not None:  # never spoke: still ours
            try:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            except (RuntimeError, ValueError):
                pass
            self.sock.close()
            self.sock = None
        elif self.transport is not None:
            self.transport.abort()
        elif self._tls is not None and not self._tls.done():
            self._tls.cancel()  # asyncio closes the socket of a handshake it did not finish


class RedactedErrors(RequestHandler):
    """aiohttp's request handler, whose answer to a request it cannot parse does not echo the
    request's secrets back (its parser's message quotes the raw header line, ``Authorization``
    included, and a proxy between may log the answer)."""

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        return super().handle_error(request, status, exc, redact(message) if message else message)


def _redacting(server: web.Server) -> Callable[[], asyncio.Protocol]:
    return lambda: RedactedErrors(server, loop=server._loop, **server._kwargs)


async def listen(
    factory: Callable[[], asyncio.Protocol],
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    limits: GuardLimits,
    what: str = "server.max_connections",
) -> ConnectionGuard:
    """Listen on ``host:port`` behind a :class:`ConnectionGuard` (see the module doc; its
    ``close()`` stops listening); aiohttp's own server makes :class:`RedactedErrors` handlers."""
    if type(factory) is web.Server:
        factory = _redacting(factory)
    guard = ConnectionGuard(factory, limits, ssl_context, what)
    await guard.start(host, port)
    return guard


class GuardedSite(web.BaseSite):
    """An aiohttp site (like ``web.TCPSite``) whose listener is guarded."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None,
        limits: GuardLimits,
        what: str = "connections",
    ):
        super().__init__(runner)
        self._host, self._port, self._ssl, self._limits, self._what = host, port, ssl_context, limits, what
        self.guard: ConnectionGuard | None = None

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        assert self._runner.server is not None
        self.guard = await listen(self._runner.server, self._host, self._port, self._ssl, self._limits, self._what)

    async def stop(self) -> None:
        if self.guard is not None:
            self.guard.close()
        await super().stop()
