"""A federation's server (docs/deploy.md): each run speaks the node protocol under
``/runs/{run}``; nodes find the open runs at ``GET /v1/offers``; ``/v1/runs`` is `shoal run`'s."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from shoal.web.dashboard import server_dashboard

from ..app_base import RUNS_PATH, base_app, researcher_tokens
from ..bodies import json_body
from ..http_common import (
    ADMIN,
    CHANGED,
    CLOCK,
    FEDERATION,
    NODE,
    REVOCATIONS,
    SLICE_S,
    SUBMITTER,
    SUBMITTERS,
    Refusal,
    gone,
    integer_param,
    seconds_param,
    tick,
    wait_event,
)
from ..node_routes import add_node_routes
from ..registry import Registry
from .bundle_routes import add_bundle_routes
from .runs import DEFAULT_FEDERATION_BODY, Federation, RunError

log = logging.getLogger(__name__)


MAX_RUN_BODY = 128 * 1024  # POST /v1/runs: a task reference and the run's config


def make_federation_app(federation: Federation, registry: Registry) -> web.Application:
    """A federation's server: each run speaks the node protocol under ``/runs/{run}``; nodes find
    the open runs at ``GET /v1/offers`` and answer them; ``/v1/runs`` is `shoal run`'s."""
    cfg = federation.cfg
    app = base_app(cfg, registry, cfg.server.max_body_bytes or DEFAULT_FEDERATION_BODY)
    app[FEDERATION] = federation
    app[CLOCK] = federation
    app[REVOCATIONS].subscribe(lambda names: federation.forget(set(names)))
    app[SUBMITTERS] = researcher_tokens(cfg)
    add_node_routes(app, "/runs/{run}")
    app.router.add_get("/v1/offers", get_offers)
    app.router.add_post("/runs/{run}/v1/answer", post_answer)
    app.router.add_post(RUNS_PATH, post_run)
    add_bundle_routes(app)  # signed task bundles: stored, never imported (bundle_routes.py)
    app.router.add_get(RUNS_PATH, get_runs)
    app.router.add_get("/v1/status", get_runs)
    app.router.add_get(RUNS_PATH + "/{run}", get_run)
    app.router.add_get(RUNS_PATH + "/{run}/metrics", get_run_metrics)
    app.router.add_get(RUNS_PATH + "/{run}/events", get_run_events)
    app.router.add_post(RUNS_PATH + "/{run}/stop", post_run_stop)
    app.router.add_get(RUNS_PATH + "/{run}/files/{name}", get_run_file)
    server_dashboard(app[ADMIN], federation, registry).add_routes(app)
    return app


def _fed_call(fn, *args):
    try:
        return fn(*args)
    except RunError as e:
        raise Refusal(e.status, e.code, str(e)) from None


async def get_offers(request: web.Request) -> web.Response:
    """The runs this node may join now (a node daemon polls this)."""
    return web.json_response({"runs": request.app[FEDERATION].offers(request[NODE])})


async def post_answer(request: web.Request) -> web.Response:
    """A node joins a run, or refuses it with its operator's reason (shown in the run's status)."""
    body = await json_body(request, 4096)
    fed = request.app[FEDERATION]
    return web.json_response(_fed_call(fed.answer, request.match_info["run"], request[NODE], body))


MAX_TASK_CHECKS = 4  # submissions whose task is being checked at once; more are told to retry


async def post_run(request: web.Request) -> web.Response:
    """`shoal run submit`: {"task": NAME, "config": {section: {key: value}}}. The cheap checks here,
    the task's in a thread (a user's task in the worker process), the run stored here."""
    body = await json_body(request, MAX_RUN_BODY)
    if not isinstance(body, dict) or set(body) - {"task", "config"}:
        raise Refusal(400, "malformed", 'send {"task": NAME, "config": {...}}')
    fed, who, changed = request.app[FEDERATION], request[SUBMITTER], request.app[CHANGED]
    sub = _fed_call(fed.prepare, body.get("task"), body.get("config", {}), who)
    if changed.get("checks", 0) >= MAX_TASK_CHECKS:
        raise Refusal(429, "busy", f"{MAX_TASK_CHECKS} submissions are being checked; try again in a few seconds")
    changed["checks"] = changed.get("checks", 0) + 1
    try:
        await asyncio.to_thread(_fed_call, fed.check_task, sub)
    finally:
        changed["checks"] -= 1
    result = _fed_call(fed.enqueue, sub)
    tick(request.app)
    return web.json_response(result, status=201)


async def get_runs(request: web.Request) -> web.Response:
    return web.json_response({"runs": request.app[FEDERATION].runs(request[SUBMITTER])})


async def get_run(request: web.Request) -> web.Response:
    fed = request.app[FEDERATION]
    return web.json_response(_fed_call(fed.status, request.match_info["run"], time.monotonic(), request[SUBMITTER]))


async def get_run_metrics(request: web.Request) -> web.Response:
    """The run's metrics lines after ``after``; with ``wait``, held until one comes (logs --follow)."""
    fed, who = request.app[FEDERATION], request[SUBMITTER]
    run, after = request.match_info["run"], integer_param(request, "after") if "after" in request.query else 0
    end = time.monotonic() + (seconds_param(request, "wait", 60.0) if "wait" in request.query else 0.0)
    while True:
        event = request.app[CHANGED]["event"]
        lines = _fed_call(fed.metrics, run, after, who)
        row = fed.db.get(run)
        status = row.status if row is not None else "unknown"
        left = end - time.monotonic()
        if lines or left <= 0 or status not in ("queued", "running") or gone(request):
            return web.json_response({"run": run, "status": status, "lines": [{"seq": n, **f} for n, f in lines]})
        await wait_event(event, min(left, SLICE_S))


async def get_run_events(request: web.Request) -> web.Response:
    """The run's log lines after ``after`` (the server's events, its nodes' answers); with
    ``wait``, held until one comes (`shoal run logs --follow`)."""
    fed = request.app[FEDERATION]
    run, after = request.match_info["run"], integer_param(request, "after") if "after" in request.query else 0
    end = time.monotonic() + (seconds_param(request, "wait", 60.0) if "wait" in request.query else 0.0)
    while True:
        event = request.app[CHANGED]["event"]
        lines = _fed_call(fed.events, run, after)
        row = fed.db.get(run)
        status = row.status if row is not None else "unknown"
        left = end - time.monotonic()
        if lines or left <= 0 or status not in ("queued", "running") or gone(request):
            return web.json_response({"run": run, "status": status, "lines": lines})
        await wait_event(event, min(left, SLICE_S))


async def post_run_stop(request: web.Request) -> web.Response:
    fed = request.app[FEDERATION]
    result = _fed_call(fed.stop, request.match_info["run"], request[SUBMITTER])
    tick(request.app)
    return web.json_response(result)


async def get_run_file(request: web.Request) -> web.StreamResponse:
    """`shoal run pull`: the final model, metrics.jsonl or summary.json of an ended run (a
    researcher's DP run: what its release policy lets out)."""
    fed, name = request.app[FEDERATION], request.match_info["name"]
    found = _fed_call(fed.file, request.match_info["run"], name, request[SUBMITTER])
    if isinstance(found, bytes):
        return web.Response(body=found, headers={"Content-Type": "application/octet-stream"})
    return web.FileResponse(found, headers={"Content-Type": "application/octet-stream"})
