"""The node protocol's routes at a root (docs/protocol.md): tasks, the model, updates (whole or
chunked), secure aggregation, evaluation and failure reports; :func:`add_node_routes` mounts
them (and the routes of its edge aggregators) on an app."""

from __future__ import annotations

import logging
import time

from aiohttp import web

from shoal.errors import ShoalError

from .bodies import json_body, read_body
from .chunks import MAX_BEGIN_BODY, ChunkError
from .exposition import prometheus_text
from .http_common import (
    CHANGED,
    CHUNK_DIGEST_HEADER,
    CHUNKS,
    FEDERATION,
    NODE,
    REVOCATIONS,
    SLICE_S,
    SPEC_HASH_HEADER,
    Refusal,
    error,
    gone,
    integer_param,
    long_poll_secagg,
    seconds_param,
    send_model,
    status_of,
    svc_of,
    tick,
    wait_event,
)
from .node_reports import MAX_EVAL_BODY, MAX_FAILURE_BODY
from .partial_routes import get_edge_secagg, post_edge_poll, post_edge_secagg, post_partial
from .service import ServerService
from .task_registry import RunError
from .upload_reading import check_length, expect_update, first_chunk, invited, read_into, take_buffer, upload_of

log = logging.getLogger(__name__)


async def get_task(request: web.Request) -> web.Response:
    app, node = request.app, request[NODE]
    run = request.match_info.get("run")
    if run is not None and FEDERATION in app:
        try:
            if app[FEDERATION].service(run) is None:  # the run ended: its nodes go back to the offers
                return web.json_response({"status": "done", "run": run, **app[FEDERATION].ended(run)})
        except RunError as e:
            return error(e.status, e.code, str(e))
    svc = svc_of(request)
    end = time.monotonic() + seconds_param(request, "wait", svc.cfg.server.poll_s)
    try:  # a node with another model is refused before it is counted as connected
        svc.check_spec(request.headers.get(SPEC_HASH_HEADER))
    except ShoalError as e:
        return error(status_of(e), e.code, str(e))
    evaluates = request.query.get("eval") == "1"
    while True:
        event = app[CHANGED]["event"]
        if node in app[REVOCATIONS].names:  # revoked while its poll was held
            return error(403, "revoked", f"node {node!r} was revoked")
        work = svc.poll(node, time.monotonic(), evaluates)
        if work is not None:
            if run is not None and FEDERATION in app:  # the run's config travels with each of its tasks
                work = {**work, **app[FEDERATION].task_fields(run)}
            return web.json_response(work)
        left = end - time.monotonic()
        if left <= 0:
            return web.json_response({"status": "wait", "version": svc.version})
        if gone(request):
            return error(400, "disconnected", "the connection was lost")
        await wait_event(event, min(left, SLICE_S))


async def get_model(request: web.Request) -> web.StreamResponse:
    """The global model: whole, or one byte range (a node's chunked download, resumable by offset).
    Each answer names the version (ETag) and the whole model's SHA-256; a range its own SHA-256.
    ``If-Match`` with an older version's ETag: 412 (the model moved on, start over)."""
    svc = svc_of(request)
    svc.seen(request[NODE], time.monotonic())
    resp = await send_model(request, svc.model_download())
    if resp.status != 304:
        svc.activity.sent(request[NODE], resp.content_length or 0, time.monotonic())
    return resp


async def post_update(request: web.Request) -> web.Response:
    app, node = request.app, request[NODE]
    svc = svc_of(request)
    length = check_length(request)
    # At most ``ingest_slots`` bodies are read at once, each into a preallocated buffer
    # that the update is decoded in place from and streamed into the aggregate. A buffer
    # is taken only once the body's first bytes arrived (a client that sends headers and
    # no body holds none), and given back however the request ends. Bodies in flight are
    # bounded by the invitations (see invited): memory stays O(slots x model).
    with upload_of(request):
        invite = await invited(request)
        try:
            first = await first_chunk(request, svc.cfg.server.body_timeout_s, "upload") if length else b""
            slot = await take_buffer(request, "slots")
            assert slot.buf is not None  # a slot taken from the queue holds its buffer until released
            view = memoryview(slot.buf)
            try:
                await read_into(request, view, length, first)
                try:
                    result = svc.submit(node, view[:length], time.monotonic())
                except ShoalError as e:
                    log.info("update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
                    return error(status_of(e), getattr(e, "code", "error"), str(e))
            finally:
                del view
                slot.release()
        finally:
            invite.release()
    tick(app)
    return web.json_response(result)


def _chunk_refusal(svc: ServerService, e: ChunkError) -> web.Response:
    svc.refused(e.code)
    return web.json_response({"error": e.code, "detail": str(e), **e.extra}, status=e.status)


def _upload_deadline(svc: ServerService, now: float) -> float:
    """When a chunked upload opened now is dropped: server.upload_timeout_s, and the open plain
    sync round's deadline (its buffer never outlives the round)."""
    deadline = now + svc.cfg.server.upload_timeout_s
    if svc.sync is not None and svc.sync.open and svc.secure_round is None:
        left = svc.rounds.time_left(now)
        if left is not None:
            deadline = min(deadline, now + left + 1.0)
    return deadline


async def post_upload_begin(request: web.Request) -> web.Response:
    """Open a chunked upload: ``{"size", "sha256"}`` of the whole update (docs/protocol.md)."""
    svc, node = svc_of(request), request[NODE]
    body = await json_body(request, MAX_BEGIN_BODY)
    now = time.monotonic()
    svc.seen(node, now)
    run = request.match_info.get("run", "")
    if not svc.holds_work(node):  # a session holds a buffer: only for work the run still takes
        svc.refused("no_task")
        return error(409, "no_task", f"node {node!r} holds no open task in this run: ask for one first")
    try:
        session = request.app[CHUNKS].begin(
            run, node, body, svc.update_limit, now, _upload_deadline(svc, now), svc.update_stream
        )
    except ChunkError as e:
        return _chunk_refusal(svc, e)
    chunk = min(svc.max_body_bytes, session.size)
    left = round(session.deadline - now, 3)
    return web.json_response(
        {"upload": session.id, "chunk_bytes": chunk, "received": 0, "expires_in_s": left}, status=201
    )


async def get_upload(request: web.Request) -> web.Response:
    """Where a chunked upload stands: the offset to send from (after a lost connection)."""
    svc, node = svc_of(request), request[NODE]
    try:
        s = request.app[CHUNKS].get(
            request.match_info.get("run", ""), node, request.match_info["upload"], time.monotonic()
        )
    except ChunkError as e:
        return _chunk_refusal(svc, e)
    return web.json_response({"upload": s.id, "size": s.size, "received": s.received})


async def put_upload_chunk(request: web.Request) -> web.Response:
    """One chunk at ``offset`` with its SHA-256; the last one hands the whole update to the service."""
    app, node = request.app, request[NODE]
    svc = svc_of(request)
    chunks = app[CHUNKS]
    offset = integer_param(request, "offset")
    length = request.content_length
    if length is None:
        svc.refused("length_required")
        raise Refusal(411, "length_required", "send the chunk with a Content-Length header")
    try:
        s = chunks.get(request.match_info.get("run", ""), node, request.match_info["upload"], time.monotonic())
        digest = request.headers.get(CHUNK_DIGEST_HEADER)
        again = chunks.check_chunk(s, offset, length, digest, svc.max_body_bytes)
    except ChunkError as e:
        return _chunk_refusal(svc, e)
    if again:  # the last chunk taken, sent again: where the upload stands, nothing counted
        return web.json_response({"upload": s.id, "received": s.received, "again": True})
    assert digest is not None  # check_chunk refuses a missing digest
    s.busy = True
    buf = bytearray(length)  # one chunk: what an upload holds in memory while it is being sent
    view = memoryview(buf)
    try:
        first = await first_chunk(request, svc.cfg.server.body_timeout_s, "upload chunk")
        await read_into(request, view, length, first)
    finally:
        s.busy = False
    try:
        complete = chunks.accept_chunk(s, view, digest)
    except ChunkError as e:
        return _chunk_refusal(svc, e)
    except ShoalError as e:  # the update itself, refused at this chunk: the upload is over
        svc.upload_refused(node, e, time.monotonic())
        log.info("chunked update from %s refused at byte %d: %s: %s", node, offset, getattr(e, "code", "error"), e)
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    finally:
        view.release()
    if not complete:
        return web.json_response({"upload": s.id, "received": s.received})
    try:
        result = svc.submit_staged(node, s.stream, s.staged, time.monotonic())
    except ShoalError as e:
        log.info("chunked update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    finally:
        s.staged.close()
    tick(app)
    return web.json_response(result)


async def post_secagg(request: web.Request) -> web.Response:
    """One secure aggregation message of the open round (server/secure_round.py)."""
    app, node = request.app, request[NODE]
    svc = svc_of(request)
    length = check_length(request)
    with upload_of(request):
        invite = await invited(request)  # bounds the bodies read at once here too
        try:
            body = bytearray(length)
            first = (
                await first_chunk(request, svc.cfg.server.body_timeout_s, "secure aggregation message")
                if length
                else b""
            )
            await read_into(request, memoryview(body), length, first)
        finally:
            invite.release()
    now = time.monotonic()
    try:
        result = svc.secure(node, now).receive(node, request.match_info["stage"], bytes(body))
    except ShoalError as e:
        svc.refused(getattr(e, "code", "error"))
        log.info("secure aggregation message from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    tick(app)
    return web.json_response(result)


async def get_secagg(request: web.Request) -> web.Response:
    """Long-poll for the server's answer to a stage: 200 with the message once the stage
    closed, 202 ``{"status": "wait"}`` if it is still open when ``wait`` runs out."""
    node = request[NODE]
    svc = svc_of(request)
    round_ = integer_param(request, "round")
    end = time.monotonic() + seconds_param(request, "wait", svc.cfg.server.poll_s)
    stage = request.match_info["stage"]
    return await long_poll_secagg(
        request, round_, end, lambda: svc.secure(node, time.monotonic()).reply(node, stage, round_), status_of
    )


async def _small_report(request: web.Request, limit: int, what: str, handle) -> web.Response | dict:
    """Read a node's small JSON report (server/bodies.py: Content-Length required, at most ``limit``
    bytes, within server.body_timeout_s) and hand it to ``handle(node, body, now)``; the handler's
    refusal is answered here (4xx, JSON), a result returned."""
    svc, node = svc_of(request), request[NODE]
    body = await read_body(request, limit, svc.cfg.server.body_timeout_s, what="report", refused=svc.refused)
    try:
        return handle(node, body, time.monotonic())
    except ShoalError as e:
        log.info("%s report from %s refused: %s: %s", what, node, getattr(e, "code", "error"), e)
        return error(status_of(e), getattr(e, "code", "error"), str(e))


async def post_eval(request: web.Request) -> web.Response:
    """A node's evaluation of a global version on its own test data (JSON, docs/protocol.md)."""
    result = await _small_report(request, MAX_EVAL_BODY, "evaluation", svc_of(request).report_eval)
    return result if isinstance(result, web.Response) else web.json_response(result)


async def post_failed(request: web.Request) -> web.Response:
    """A node's report that its task failed on the node (JSON, docs/protocol.md)."""
    result = await _small_report(request, MAX_FAILURE_BODY, "failure", svc_of(request).report_failure)
    if isinstance(result, web.Response):
        return result
    run = request.match_info.get("run")
    if run is not None:  # a federation's run: the report goes into its log (`shoal run logs`)
        fed = request.app[FEDERATION]
        fed.event(run, request[NODE], f"round {result['round']}: reports its task {result['reason']}")
    tick(request.app)  # every selected node answered or failed: the round may close now
    return web.json_response(result)


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(svc_of(request).status(time.monotonic()))


async def get_metrics(request: web.Request) -> web.Response:
    text = prometheus_text(svc_of(request), time.monotonic())
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})


def add_node_routes(app: web.Application, prefix: str) -> None:
    """The node protocol (docs/protocol.md), under ``prefix`` (a federation: ``/runs/{run}``)."""
    app.router.add_get(prefix + "/v1/task", get_task)
    app.router.add_get(prefix + "/v1/model", get_model)
    app.router.add_post(prefix + "/v1/update", post_update, expect_handler=expect_update)
    app.router.add_post(prefix + "/v1/secagg/{stage}", post_secagg)
    app.router.add_get(prefix + "/v1/secagg/{stage}", get_secagg)
    app.router.add_post(prefix + "/v1/eval", post_eval)
    app.router.add_post(prefix + "/v1/failed", post_failed)
    app.router.add_post(prefix + "/v1/uploads", post_upload_begin)
    app.router.add_put(prefix + "/v1/uploads/{upload}", put_upload_chunk)
    app.router.add_get(prefix + "/v1/uploads/{upload}", get_upload)
    app.router.add_post(prefix + "/v1/partial", post_partial)  # edge aggregators (server/edge/intake.py)
    app.router.add_post(prefix + "/v1/edge/poll", post_edge_poll)
    app.router.add_post(prefix + "/v1/edge/secagg/{stage}", post_edge_secagg)  # server/edge/secure.py
    app.router.add_get(prefix + "/v1/edge/secagg/{stage}", get_edge_secagg)
