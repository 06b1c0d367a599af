"""An edge aggregator's HTTP side: its node routes (the node protocol of docs/protocol.md, served
from :class:`~shoal.server.edge.service.EdgeNodes`) and :func:`serve_edge` (`shoal server --parent`),
which runs them beside the uplink to the root (uplink.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from shoal.config import Config
from shoal.errors import ConfigError, ShoalError
from shoal.pki import read_secret
from shoal.signals import on_stop_signals
from shoal.task import Task

from ..app_base import base_app
from ..bodies import read_body
from ..connections import listen
from ..http_common import (
    CHANGED,
    NODE,
    SHUTDOWN_S,
    SPEC_HASH_HEADER,
    Refusal,
    answer_and_hang_up,
    error,
    notify,
    seconds_param,
    send_model,
    status_of,
    wait_event,
)
from ..service import MAX_FAILURE_BODY
from .journal import JOURNAL, RoundJournal
from .secure import RELAY, RelayLink, edge_get_secagg, edge_post_secagg
from .service import EdgeNodes, edge_spec
from .uplink import POLL_WAIT_S, Uplink

log = logging.getLogger(__name__)


EDGE = web.AppKey("edge", EdgeNodes)
INGEST = web.AppKey("ingest", asyncio.Semaphore)  # bodies read at once: at most server.ingest_slots


REFUSAL_LOG_S = 10.0  # an edge logs a revoked node's refused requests at most this often per node


@web.middleware
async def revoked_nodes(request: web.Request, handler):
    """A node the root revoked gets 403 at this edge on every route, whatever the edge's copy of the
    registry says (its body, if any, is not read); each refusal is logged with its reason (at most
    one line per node per REFUSAL_LOG_S, with the count since)."""

    edge, node = request.app[EDGE], request.get(NODE)
    if node is None or node not in edge.revoked:
        return await handler(request)
    edge.refused["revoked"] = edge.refused.get("revoked", 0) + 1
    now = time.monotonic()
    last, count = edge.refusal_log.get(node, (-math.inf, 0))
    if now - last >= REFUSAL_LOG_S:
        log.warning(
            "refused %s %s of node %s: revoked at the root (%d more since)", request.method, request.path, node, count
        )
        edge.refusal_log[node] = (now, 0)
    else:
        edge.refusal_log[node] = (last, count + 1)
    resp = error(403, "revoked", f"node {node!r} is revoked at the root; this edge serves it nothing")
    if request.body_exists and not request.content.at_eof():
        await answer_and_hang_up(request, resp)
    return resp


def _edge_app(edge: EdgeNodes, registry) -> web.Application:

    app = base_app(edge.cfg, registry, edge.max_body_bytes)
    app.middlewares.append(revoked_nodes)  # after auth: it knows the node
    app[EDGE] = edge
    app[INGEST] = asyncio.Semaphore(edge.cfg.server.ingest_slots)
    app.router.add_get("/v1/task", get_task)
    app.router.add_get("/v1/model", get_model)
    app.router.add_post("/v1/update", post_update)
    app.router.add_post("/v1/failed", post_failed)
    app[RELAY] = RelayLink(edge.relay, edge.seen)  # secure rounds (server/edge/secure.py)
    app.router.add_post("/v1/secagg/{stage}", edge_post_secagg)
    app.router.add_get("/v1/secagg/{stage}", edge_get_secagg)
    return app


async def get_task(request: web.Request) -> web.Response:

    edge, node = request.app[EDGE], request[NODE]
    end = time.monotonic() + seconds_param(request, "wait", edge.cfg.server.poll_s)
    try:
        edge.check_spec(request.headers.get(SPEC_HASH_HEADER))
    except ShoalError as e:
        return error(status_of(e), e.code, str(e))
    while True:
        event = request.app[CHANGED]["event"]
        try:
            work = edge.poll(node, time.monotonic())
        except ShoalError as e:  # revoked at the root while it waited
            return error(403, e.code, str(e))
        if work is not None:
            return web.json_response(work)
        left = end - time.monotonic()
        if left <= 0:
            return web.json_response({"status": "wait", "version": edge.version})
        await wait_event(event, min(left, 1.0))


async def get_model(request: web.Request) -> web.StreamResponse:

    edge = request.app[EDGE]
    edge.seen(request[NODE], time.monotonic())
    if edge.model is None:
        raise Refusal(503, "no_model", "this edge has not fetched the model from its root yet; try again shortly")
    return await send_model(request, edge.model)


async def _body(request: web.Request, limit: int) -> bytes:
    return await read_body(
        request, limit, request.app[EDGE].cfg.server.upload_timeout_s, timeout_key="upload_timeout_s"
    )


async def post_update(request: web.Request) -> web.Response:

    edge, node = request.app[EDGE], request[NODE]
    try:
        async with request.app[INGEST]:  # memory: at most server.ingest_slots bodies of max_body_bytes
            body = await _body(request, edge.max_body_bytes)
            result = edge.submit(node, memoryview(bytearray(body)), time.monotonic())
            journal = request.app.get(JOURNAL)
            if journal is not None and edge.round is not None:  # kept before the node hears "accepted"
                try:
                    await asyncio.to_thread(journal.keep, edge.round.round, edge.round.version, node, body)
                except OSError as e:
                    log.error("round %d: the update of %s is summed but not kept on disk: %s", result["round"], node, e)
    except ShoalError as e:
        log.info("update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    notify(request.app)  # the closer looks at once whether the round is complete
    return web.json_response(result)


async def post_failed(request: web.Request) -> web.Response:

    edge = request.app[EDGE]
    body = await _body(request, MAX_FAILURE_BODY)
    try:
        return web.json_response(edge.failed(request[NODE], body, time.monotonic()))
    except ShoalError as e:
        return error(status_of(e), getattr(e, "code", "error"), str(e))


async def serve_edge(
    cfg: Config,
    registry,
    ssl_context: ssl.SSLContext | None,
    stop: asyncio.Event | None = None,
    task: Task | None = None,
) -> None:
    """Serve this edge's nodes until the root says done (and the nodes were told), or SIGINT/SIGTERM."""
    from shoal.tls import client_context

    h, s = cfg.hierarchy, cfg.server
    if not h.parent_token_file:
        raise ConfigError(
            "hierarchy.parent_token_file is not set: an edge authenticates to its root with the token of "
            "`shoal server nodes add EDGE_NAME` there (and EDGE_NAME in the root's hierarchy.edge_names)"
        )
    token = read_secret(h.parent_token_file, "hierarchy.parent_token_file")
    to_root = client_context(h.parent_ca_cert or None) if h.parent.startswith("https://") else None
    edge = EdgeNodes(cfg, edge_spec(cfg, task))
    stop = stop or asyncio.Event()
    on_stop_signals(stop.set)
    app = _edge_app(edge, registry)
    if h.edge_journal and edge.buffer is None:
        journal = app[JOURNAL] = RoundJournal(Path(s.out_dir) / "edge-journal")
        for node in journal.nodes():  # named in the first poll: the root hands back their round's tasks
            edge.seen(node, time.monotonic())
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, keepalive_timeout=s.idle_timeout_s, shutdown_timeout=SHUTDOWN_S
    )
    await runner.setup()
    assert runner.server is not None
    guard = await listen(runner.server, s, ssl_context)
    log.info(
        "edge listening on %s://%s:%d, under the root %s", "https" if ssl_context else "http", s.host, s.port, h.parent
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=POLL_WAIT_S + 30)
    try:
        async with aiohttp.ClientSession(
            timeout=timeout,
            headers={"Authorization": f"Bearer {token}"},
            connector=aiohttp.TCPConnector(ssl=to_root if to_root is not None else True),
        ) as http:
            up = Uplink(edge, app, http, h.parent, to_root)
            app[RELAY].attach(http, h.parent, lambda: edge.name, up.metrics)
            loops = [asyncio.ensure_future(up.poll_root(stop)), asyncio.ensure_future(up.close_rounds(stop))]
            loops.append(asyncio.ensure_future(app[RELAY].send_sums(stop, up._changed)))
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait([*loops, stopper], return_when=asyncio.FIRST_COMPLETED)
            for t in (*loops, stopper):
                t.cancel()
            for t in done:
                if t is not stopper and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if up.sending:  # a partial on its way finishes (bounded by the root's deadline)
                await asyncio.wait(up.sending, timeout=SHUTDOWN_S)
    finally:
        notify(app)
        guard.close()
        await runner.cleanup()
    log.info("edge stopped: %d updates taken, refused %s", edge.accepted, edge.refused)
