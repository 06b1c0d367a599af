"""A root's routes for its edge aggregators (docs/hierarchy.md): an edge's poll, its partial of
the open round, and the secure aggregation messages it relays; the checks are server/edge/intake.py's
:class:`PartialIntake` and server/edge/secure.py's."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from shoal.errors import ShoalError, TooLarge, UpdateRejected, short_repr
from shoal.wire import MAX_HEADER_BYTES

from .bodies import json_body, read_body
from .edge.intake import MAX_EDGE_POLL_BODY, PartialIntake, check_edge
from .edge.secure import body_limit
from .http_common import (
    CHANGED,
    NODE,
    REGISTRY,
    REVOCATIONS,
    SLICE_S,
    Refusal,
    error,
    gone,
    integer_param,
    long_poll_secagg,
    seconds_param,
    status_of,
    svc_of,
    tick,
    wait_event,
)
from .secure_round import SecureRound
from .service import ServerService
from .upload_reading import first_chunk, read_into, upload_of

log = logging.getLogger(__name__)


def intake_of(svc: ServerService) -> PartialIntake:
    """The run's edge intake; a server without edges (``hierarchy.edge_names`` empty) has none."""
    if not isinstance(svc.tier, PartialIntake):
        raise Refusal(403, "not_an_edge", "this server has no edge aggregators (hierarchy.edge_names is empty)")
    return svc.tier


async def post_edge_poll(request: web.Request) -> web.Response:
    """An edge aggregator's poll: its connected nodes in, the open round's tasks for them out
    (server/edge/intake.py's PartialIntake.poll, docs/hierarchy.md); held up to ``wait`` seconds while
    there is no work for it."""
    app, edge = request.app, request[NODE]
    svc = svc_of(request)
    body = await json_body(request, MAX_EDGE_POLL_BODY)  # bounded and timed as every body, first
    intake = intake_of(svc)
    end = time.monotonic() + seconds_param(
        request, "wait", min(svc.cfg.server.poll_s, svc.cfg.hierarchy.edge_timeout_s / 2)
    )
    registry = app[REGISTRY]
    while True:
        event = app[CHANGED]["event"]
        try:
            answer = intake.poll(edge, body, registry.enabled, time.monotonic(), app[REVOCATIONS].names.__contains__)
        except ShoalError as e:
            status = 403 if getattr(e, "code", "") == "not_an_edge" else status_of(e)
            return error(status, getattr(e, "code", "error"), str(e))
        tick(app)  # the nodes it named may complete the quorum that opens a round
        if answer["status"] != "wait" or time.monotonic() >= end or gone(request):
            return web.json_response(answer)
        await wait_event(event, min(end - time.monotonic(), SLICE_S))


async def post_partial(request: web.Request) -> web.Response:
    """An edge aggregator's partial for the open round (server/edge/intake.py, docs/hierarchy.md): read
    under the upload limits (per-node count, body timeouts, minimum rate), then checked and merged."""
    app, edge = request.app, request[NODE]
    svc = svc_of(request)
    try:
        check_edge(svc, edge)  # a node may not speak for other nodes
    except UpdateRejected as err:
        svc.refused(err.code)
        raise Refusal(403, err.code, str(err)) from None
    intake = intake_of(svc)
    length = request.content_length
    if length is None:
        raise Refusal(411, "length_required", "send the body with a Content-Length header")
    if length > intake.max_bytes:
        svc.refused(TooLarge.code)
        raise Refusal(413, TooLarge.code, f"partial of {length} bytes is over the limit of {intake.max_bytes} bytes")
    with upload_of(request):
        first = await first_chunk(request, svc.cfg.server.body_timeout_s, "partial") if length else b""
        body = bytearray(length)
        await read_into(request, memoryview(body), length, first)
        try:
            result = intake.submit(edge, body, time.monotonic())
        except ShoalError as e:
            log.info("partial from %s refused: %s: %s", edge, getattr(e, "code", "error"), e)
            return error(status_of(e), getattr(e, "code", "error"), str(e))
    tick(app)
    return web.json_response(result)


def relayed_round(
    svc: ServerService, intake: PartialIntake, edge: str, node: str | None, now: float
) -> tuple[SecureRound, dict[str, str]]:
    """The open secure round and who speaks for whom in it, for a message ``edge`` relays (from
    ``node``; None: its masked sum). UpdateRejected unless ``edge`` is an edge of this server that
    speaks for ``node`` in the open round; only then is ``node`` seen (alive, heard through its
    edge): the name an edge puts in a query is no node of the root's until the roster says so."""
    check_edge(svc, edge)
    sr, r = svc.secure_round, svc.sync
    if sr is None or r is None:
        what = "secure aggregation is off" if not svc.cfg.secure_aggregation.enabled else "no secure round is open"
        raise UpdateRejected("round_closed", f"{what} (version {svc.version})")
    held = intake.roster.round_edges(r.round, r.version, r.selected, now)
    if node is not None:
        if held.get(node) != edge:
            raise UpdateRejected(
                "not_your_node",
                f"edge {edge!r} does not speak for {short_repr(node)} in round {r.round} (POST /v1/edge/poll)",
            )
        svc.seen(node, now)
    return sr, held


def _node_of(request: web.Request) -> str:
    node = request.query.get("node", "")
    if not 1 <= len(node) <= 256:
        raise Refusal(400, "bad_request", "query parameter 'node' (the relayed node's name) is needed")
    return node


async def post_edge_secagg(request: web.Request) -> web.Response:
    """``POST /v1/edge/secagg/{stage}?node=NAME``: an edge relays one of its node's messages;
    ``POST /v1/edge/secagg/masked_sum``: an edge's sum of its nodes' masked inputs."""
    app, edge = request.app, request[NODE]
    svc = svc_of(request)
    stage = request.match_info["stage"]
    try:
        check_edge(svc, edge)
    except UpdateRejected as e:  # a node's or a stranger's body is not read: answered, hung up on
        svc.refused(e.code)
        raise Refusal(403, e.code, str(e), close=True) from None
    limit = body_limit(svc.secure_round.params.vector_size) if svc.secure_round is not None else MAX_HEADER_BYTES
    body = await read_body(request, limit, svc.cfg.server.body_timeout_s)
    now = time.monotonic()
    try:
        if stage == "masked_sum":
            sr, held = relayed_round(svc, intake_of(svc), edge, None, now)
            result = sr.receive_masked_sum(edge, body, held)
        elif stage == "masked":
            raise UpdateRejected("not_relayed", "an edge sends its nodes' masked inputs only in its masked sum")
        else:
            node = _node_of(request)
            sr, _ = relayed_round(svc, intake_of(svc), edge, node, now)
            result = sr.receive(node, stage, body)
    except ShoalError as e:
        svc.refused(getattr(e, "code", "error"))
        log.info("relayed secure aggregation message from edge %s refused: %s: %s", edge, getattr(e, "code", ""), e)
        return error(_relay_status(e), getattr(e, "code", "error"), str(e))
    tick(app)
    return web.json_response(result)


async def get_edge_secagg(request: web.Request) -> web.Response:
    """``GET /v1/edge/secagg/{stage}?node=NAME&round=R&wait=S``: the root's answer to a stage for one
    of the edge's nodes (long-polled as GET /v1/secagg/{stage})."""
    edge = request[NODE]
    svc = svc_of(request)
    node = _node_of(request)
    round_ = integer_param(request, "round")
    end = time.monotonic() + seconds_param(request, "wait", svc.cfg.server.poll_s)
    stage = request.match_info["stage"]

    def reply() -> bytes | None:
        sr, _ = relayed_round(svc, intake_of(svc), edge, node, time.monotonic())
        return sr.reply(node, stage, round_)

    return await long_poll_secagg(request, round_, end, reply, _relay_status)


def _relay_status(e: ShoalError) -> int:
    """A relayed request's refusal: 403 for a caller that is not an edge, else as any refusal."""
    return 403 if getattr(e, "code", "") == "not_an_edge" else status_of(e)
