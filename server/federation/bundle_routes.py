"""The routes of signed task bundles (server/federation/bundle_store.py): a researcher uploads a
bundle (``POST /v1/runs/bundles``, answered with the task name to submit), a node fetches the
bundle of a run it considers (``GET /runs/{run}/v1/bundle``) to verify it itself. The server
checks a bundle's format, limits and hashes in a thread and never imports it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from ..app_base import RUNS_PATH
from ..bodies import read_body
from ..http_common import FEDERATION, NODE, SUBMITTER, Refusal
from .runs import DEFAULT_FEDERATION_BODY, RunError


def add_bundle_routes(app: web.Application) -> None:
    app.router.add_post(RUNS_PATH + "/bundles", post_bundle)  # a researcher's (or the admin's) token
    app.router.add_get("/runs/{run}/v1/bundle", get_run_bundle)  # a node's


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except RunError as e:
        raise Refusal(e.status, e.code, str(e)) from None


async def post_bundle(request: web.Request) -> web.Response:
    """`shoal run submit --bundle`: a signed task bundle's bytes; answers the task name to submit."""
    fed = request.app[FEDERATION]
    cfg = fed.cfg
    if not cfg.federation.max_bundle_mb:
        raise Refusal(403, "bundles_off", "this federation takes no task bundles (federation.max_bundle_mb = 0)")
    limit = min(cfg.federation.max_bundle_mb << 20, cfg.server.max_body_bytes or DEFAULT_FEDERATION_BODY)
    blob = await read_body(request, limit, cfg.server.body_timeout_s, what="bundle")
    result = await asyncio.to_thread(_call, fed.upload_bundle, request[SUBMITTER], blob, fed.bundles_in_use())
    return web.json_response(result, status=201)


async def get_run_bundle(request: web.Request) -> web.Response:
    """A node fetches a bundle run's task to verify it against its own trusted publishers."""
    blob = _call(request.app[FEDERATION].bundle, request.match_info["run"], request[NODE])
    return web.Response(body=blob, headers={"Content-Type": "application/octet-stream"})
