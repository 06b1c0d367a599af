"""HTTP transport of the aggregator (aiohttp): the core server's app, its clock and :func:`serve`.

It only moves messages: every decision is a call into :class:`ServerService`. The routes live
by what they serve (node_routes.py, partial_routes.py, federation_routes.py; what every app
shares in http_common.py and app_base.py). The protocol is written up in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time

from aiohttp import web

from shoal.aggregation.secagg.identity import read_roster
from shoal.errors import ConfigError
from shoal.log_redaction import install as redact_logs
from shoal.signals import on_stop_signals
from shoal.web.dashboard import server_dashboard

from .app_base import base_app
from .connections import listen
from .federation.routes import make_federation_app
from .federation.runs import Federation
from .http_common import ADMIN, CHUNKS, CLOCK, FEDERATION, REVOCATIONS, SERVICE, SHUTDOWN_S, notify
from .node_routes import add_node_routes, get_metrics, get_status
from .registry import Registry
from .service import ServerService

log = logging.getLogger(__name__)


REVOKED_EVERY_S = 0.25  # a federation reads the revoked nodes this often (`shoal server nodes revoke`)


def make_app(service: ServerService, registry: Registry) -> web.Application:
    """The aiohttp application (run it with ``web.AppRunner(app, keepalive_timeout=server.idle_timeout_s)``,
    as :func:`serve` does, so idle connections are closed)."""
    app = base_app(service.cfg, registry, service.max_body_bytes)
    app[SERVICE] = service
    app[CLOCK] = service
    app[REVOCATIONS].subscribe(lambda names: service.forget(set(names)))
    if service.privacy is not None:  # N of central/distributed DP: the registered nodes, checked before any round
        edges = set(service.cfg.hierarchy.edge_names)  # registered to authenticate, but no node: never selected
        service.bind_registry(sum(1 for n in registry.list() if n.enabled and n.name not in edges))
    sa = service.cfg.secure_aggregation
    if sa.enabled and sa.malicious_server:  # checked before any round, not when the first one opens
        if not sa.keys_file:
            raise ConfigError(
                "secure_aggregation.malicious_server = true needs keys_file: the nodes' public "
                "identity keys, given to every node with the config (`shoal keygen`)"
            )
        read_roster(sa.keys_file)
    add_node_routes(app, "")
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/metrics", get_metrics)
    server_dashboard(app[ADMIN], service, registry).add_routes(app)
    return app


def _holds_work(app: web.Application, run: str, node: str) -> bool:
    """``node`` holds a task of ``run`` ("" on a one-run server) whose result would be taken."""
    if FEDERATION in app:
        svc = app[FEDERATION].active.get(run)
        return svc is not None and svc.holds_work(node)
    return SERVICE in app and app[SERVICE].holds_work(node)


async def run_clock(app: web.Application, stop: asyncio.Event) -> None:
    """Drive the service's time: open rounds when nodes are there, close them at deadlines.
    It never dies of an exception: a failing tick is logged (at most once a minute) and retried.
    It also reads which nodes were revoked every REVOKED_EVERY_S: every run drops them at once."""
    svc = app[CLOCK]
    last_logged, revoked_at = -math.inf, -math.inf
    while not stop.is_set():
        pause = 0.05
        try:
            if REVOCATIONS in app and time.monotonic() - revoked_at >= REVOKED_EVERY_S:
                app[REVOCATIONS].refresh()
                revoked_at = time.monotonic()
            # a stalled chunked upload, or one whose task ended, lets go of its buffer
            app[CHUNKS].expire(time.monotonic(), lambda run, node: _holds_work(app, run, node))
            if svc.tick(time.monotonic()):
                notify(app)
            if svc.finished(time.monotonic()):
                stop.set()
        except Exception:
            if time.monotonic() - last_logged > 60:
                log.exception("the service's clock failed; retrying (this is logged at most once a minute)")
                last_logged = time.monotonic()
            pause = 1.0
        try:
            await asyncio.wait_for(stop.wait(), pause)
        except TimeoutError:
            pass


async def serve(
    service: ServerService | Federation,
    registry: Registry,
    ssl_context: ssl.SSLContext | None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until every round is done (and the nodes were told), or SIGINT/SIGTERM; a
    federation serves until SIGINT/SIGTERM. A signal stops it within SHUTDOWN_S: requests in
    flight are cut (an upload not yet applied is not applied; its node sends it again)."""
    redact_logs()  # no token, cookie or Authorization header in any log line from here on
    stop = stop or asyncio.Event()
    on_stop_signals(stop.set)
    app = make_federation_app(service, registry) if isinstance(service, Federation) else make_app(service, registry)
    s = service.cfg.server
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, keepalive_timeout=s.idle_timeout_s, shutdown_timeout=SHUTDOWN_S
    )
    await runner.setup()
    assert runner.server is not None  # made by setup()
    guard = await listen(runner.server, s, ssl_context)
    scheme = "https" if ssl_context else "http"
    if isinstance(service, Federation):
        log.info("listening on %s://%s:%d: a federation of %d runs at once", scheme, s.host, s.port, service.max_runs)
    else:
        log.info("listening on %s://%s:%d (version %d of %d)", scheme, s.host, s.port, service.version, s.rounds)
    try:
        await run_clock(app, stop)
    finally:
        notify(app)
        guard.close()  # no new connections, those not through their handshake dropped; the runner ends the rest
        await runner.cleanup()
    if isinstance(service, Federation):
        log.info("stopped; runs in progress resume from their checkpoints on the next start")
    else:
        log.info("stopped at version %d", service.version)
