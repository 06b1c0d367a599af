"""The server's and an edge's listener: shoal/connection_guard.py with the ``[server]`` limits.

Every accepted socket costs memory before a request is read (kernel buffers, the TLS object,
aiohttp's parser), so the guard bounds connections in two stages: a new connection has
``server.handshake_timeout_s`` to finish its TLS handshake and send its first request head
(at most ``server.max_pending_connections`` at once, ``server.pending_per_address`` from one
address; past either, the oldest that has sent nothing is dropped, so silent sockets cannot lock
anyone out), then it
is served among at most ``server.max_connections``, of which ``server.reserved_connections``
are only for clients that presented a certificate of ``server.tls_client_ca`` (enrolled nodes).
Past those: one ``503 too_many_connections`` answer and the connection is closed; a node
treats 503 as "retry with backoff" (client/http.py).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

from shoal.config import ServerConfig
from shoal.connection_guard import ConnectionGuard, GuardLimits
from shoal.connection_guard import listen as guarded_listen


def limits(s: ServerConfig) -> GuardLimits:
    """The guard's limits from ``[server]``: the reserve is at most half of max_connections, and
    only exists where client certificates are asked for (``server.tls_client_ca``)."""
    reserved = min(s.reserved_connections, s.max_connections // 2) if s.tls_client_ca else 0
    return GuardLimits(
        max_connections=s.max_connections,
        reserved=reserved,
        per_address=s.connections_per_address,
        max_pending=s.max_pending_connections,
        pending_per_address=s.pending_per_address,
        handshake_timeout_s=s.handshake_timeout_s,
    )


async def listen(
    factory: Callable[[], asyncio.Protocol], s: ServerConfig, ssl_context: ssl.SSLContext | None
) -> ConnectionGuard:
    """Listen on ``server.host:server.port`` behind the connection guard (see the module doc);
    ``close()`` it to stop listening."""
    return await guarded_listen(factory, s.host, s.port, ssl_context, limits(s), "server.max_connections")
