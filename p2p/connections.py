"""The peer's connections (aiohttp transport pieces): a cap per remote address and in all, a
deadline on every request's headers, and a resolver that never hands out a forbidden address.

aiohttp's server has no deadline for a request's headers and no cap per address, so a
client that opens connections and sends half a header each could hold them all (and the
process's file descriptors) forever. :class:`GuardedRunner` serves an application with
:class:`GuardedHandler` connections: each is refused at once beyond MAX_CONNECTIONS_PER_ADDRESS
from its address or :func:`total_connections` in all, and closed when a request's headers are
not complete by its deadline (``header_timeout`` from the connection's start,
``idle_timeout`` after each answer). The application disarms the deadline while it handles a
request and re-arms it after (p2p/peer.py's middleware). :class:`PolicyResolver` is the
client side: what a peer name resolves to passes p2p/addresses.py's policy.

Under all of this, :func:`guarded_site` listens through shoal/connection_guard.py, the same guard
as the server's: a connection is dropped unless its TLS handshake and first request head are done
within HANDSHAKE_TIMEOUT_S (a crowd of silent sockets is dropped, silent ones first, past MAX_PENDING
or PENDING_PER_ADDRESS), and an eighth of the connection slots is kept for peers that present a
client certificate the peer's TLS context verified (those bypass the per-address cap here).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver
from aiohttp.web_protocol import RequestHandler

from shoal.connection_guard import GuardedSite, GuardLimits, RedactedErrors

from .addresses import AddressPolicy

HEADER_TIMEOUT_S = 10.0  # a new connection's first request headers must be complete by then
IDLE_TIMEOUT_S = 30.0  # an idle keep-alive connection is closed after this long
MAX_CONNECTIONS_PER_ADDRESS = 64  # open connections from one remote address
MAX_CONNECTIONS = 1024  # open connections in all (less where the open-file limit is lower)
HANDSHAKE_TIMEOUT_S = 5.0  # a new connection's TLS handshake and first request head must be done by then
MAX_PENDING = 256  # connections still in that stage (past it the oldest silent one is dropped)
PENDING_PER_ADDRESS = 32  # of those from one address (past it that address's oldest silent one is dropped)
ADDRESSES_TO_FILL = 16  # one address holds at most this share (1/16) of the slots open to callers without a certificate


def total_connections() -> int:
    """Connections served at once: half the process's open-file limit (the rest for its own
    connections, files and models), at most MAX_CONNECTIONS."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return MAX_CONNECTIONS
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(16, min(MAX_CONNECTIONS, soft // 2))


class Connections:
    """Open connections per remote address and in all, and each connection's deadline for its next request.

    Of ``total`` slots, ``reserved`` (an eighth) are only for callers with a verified client
    certificate (peers with a `shoal pki peer-cert`); one address without a certificate holds at
    most ``per_address``, and never more than 1/ADDRESSES_TO_FILL of the other slots, so it takes
    more than ADDRESSES_TO_FILL source addresses (not 12 x 64 sockets where the open-file limit
    is 1024) to fill them and lock out ``/status`` and token-only peers."""

    def __init__(self, per_address: int, header_timeout: float, idle_timeout: float, total: int | None = None):
        self.header_timeout, self.idle_timeout = header_timeout, idle_timeout
        self.total = total_connections() if total is None else total
        self.reserved = self.total // 8
        self.per_address = max(1, min(per_address, (self.total - self.reserved) // ADDRESSES_TO_FILL))
        self.open: dict[str, int] = {}
        self.count = 0
        self.refused = 0


class GuardedHandler(RedactedErrors):
    """aiohttp's connection handler with a per-address cap and a deadline on each request's headers."""

    guard: Connections
    _addr: str | None = None
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.getpeercert(binary_form=True) is not None:
            self.arm()  # a peer with a client certificate: the listener's guard counted it among its reserve
            return
        if self.guard.open.get(addr, 0) >= self.guard.per_address or self.guard.count >= self.guard.total:
            self.guard.refused += 1
            self.force_close()
            return
        self._addr = addr
        self.guard.open[addr] = self.guard.open.get(addr, 0) + 1
        self.guard.count += 1
        self.arm()

    def arm(self, timeout: float | None = None) -> None:
        """(Re)start the deadline for the next request's headers (``header_timeout`` from the
        connection's start, ``idle_timeout`` after an answer on a keep-alive connection)."""
        self.disarm()
        wait = self.guard.header_timeout if timeout is None else timeout
        self._deadline = asyncio.get_running_loop().call_later(wait, self.force_close)

    def disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self.disarm()
        if self._addr is not None:
            self.guard.count -= 1
            left = self.guard.open.get(self._addr, 1) - 1
            if left > 0:
                self.guard.open[self._addr] = left
            else:
                self.guard.open.pop(self._addr, None)
            self._addr = None
        super().connection_lost(exc)


class PolicyResolver(AbstractResolver):
    """The default resolver, less the addresses the policy forbids (a name that resolves to a
    metadata or link-local address is not connected to)."""

    def __init__(self, policy: AddressPolicy):
        self.policy = policy
        self.inner = DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = [r for r in await self.inner.resolve(host, port, family) if self.policy.resolved_ok(r["host"])]
        if not found:
            raise OSError(f"{host} resolves only to addresses this peer does not contact")
        return found

    async def close(self) -> None:
        await self.inner.close()


class GuardedServer(web.Server):
    def __init__(self, *args: Any, guard: Connections, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.guard = guard

    def __call__(self) -> RequestHandler:
        handler = GuardedHandler(self, loop=self._loop, **self._kwargs)
        handler.guard = self.guard
        return handler


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections are guarded (header deadline, per-address cap)."""

    def __init__(self, app: web.Application, guard: Connections, **kwargs: Any):
        super().__init__(app, **kwargs)
        self.guard = guard

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return GuardedServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            guard=self.guard,
            **server._kwargs,  # the runner's handler settings (keep-alive timeout, access log)
        )


def guarded_site(
    runner: web.BaseRunner, host: str, port: int, ssl_context: ssl.SSLContext | None, guard: Connections
) -> GuardedSite:
    """The peer's listening site behind shoal/connection_guard.py: a new connection has
    HANDSHAKE_TIMEOUT_S for its TLS handshake and first request head (silent sockets are
    dropped, those that sent nothing first, past MAX_PENDING or PENDING_PER_ADDRESS), and an eighth of the
    connection slots is kept for peers that present a client certificate the TLS context
    verified. The per-address cap and header deadlines of :class:`GuardedHandler` apply after."""
    limits = GuardLimits(
        max_connections=guard.total,
        reserved=guard.reserved,
        per_address=guard.per_address,
        max_pending=MAX_PENDING,
        pending_per_address=PENDING_PER_ADDRESS,
        handshake_timeout_s=HANDSHAKE_TIMEOUT_S,
    )
    return GuardedSite(runner, host, port, ssl_context, limits, "the peer's connection limit")
