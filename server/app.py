"""HTTP transport of the aggregator (aiohttp): routes, auth, body limits, long-poll.

It only moves messages: every decision is a call into :class:`ServerService`. The
protocol is written up in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import time

from aiohttp import web

from shoal.errors import ShoalError, TooLarge, UpdateRejected, WireError

from .registry import AuthError, Registry
from .service import MAX_EVAL_BODY, ServerService

log = logging.getLogger(__name__)

SERVICE = web.AppKey("service", ServerService)
REGISTRY = web.AppKey("registry", Registry)
CHANGED = web.AppKey("changed", dict)
NODE = web.RequestKey("node", str)
SPEC_HASH_HEADER = "X-Shoal-Spec-Hash"  # a node's model spec hash, sent with every poll


class Slot:
    """One preallocated body buffer, given back exactly once: by the handler, or, should
    the connection drop before the handler runs, when the connection's task ends."""

    def __init__(self, queue: asyncio.Queue, buf: bytearray):
        self.queue, self.buf = queue, buf
        self.task = asyncio.current_task()
        if self.task is not None:
            self.task.add_done_callback(self._on_task_done)

    def _on_task_done(self, _task: asyncio.Task) -> None:
        self.release()

    def release(self) -> None:
        if self.buf is not None:
            self.queue.put_nowait(self.buf)
            self.buf = None
            if self.task is not None:  # a keep-alive connection's task serves many requests
                self.task.remove_done_callback(self._on_task_done)


SLOT = web.RequestKey("slot", Slot)


def error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


def _status_of(e: ShoalError) -> int:
    if isinstance(e, TooLarge):
        return 413
    if isinstance(e, WireError):
        return 400
    if isinstance(e, UpdateRejected):
        return 409
    return 400


def _authenticate(request: web.Request) -> web.Response | None:
    header = request.headers.get("Authorization", "")
    token = header[7:].strip() if header.startswith("Bearer ") else None
    registry = request.app[REGISTRY]
    try:
        node = request[NODE] = registry.authenticate(token)
    except AuthError as e:
        return error(e.status, e.code, str(e))
    touched = request.app[CHANGED]["touched"]
    now = time.time()
    if now - touched.get(node, 0.0) > 10.0:  # `nodes list` shows last seen; one write per 10 s per node
        registry.touch(node, now)
        touched[node] = now
    return None


@web.middleware
async def auth(request: web.Request, handler):
    """Every route needs ``Authorization: Bearer <token>`` of an enabled node."""
    if NODE not in request:
        refused = _authenticate(request)
        if refused is not None:
            return refused
    return await handler(request)


async def _take_slot(request: web.Request) -> Slot:
    slots: asyncio.Queue = request.app[CHANGED]["slots"]
    return Slot(slots, await slots.get())


async def expect_update(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue``: check auth and size, and wait for a free body buffer,
    before the node sends its body; so waiting uploads cost no server memory at all."""
    refused = _authenticate(request)
    if refused is not None:
        return refused
    svc = request.app[SERVICE]
    length = request.content_length
    if length is not None and length > svc.max_body_bytes:
        svc.refused(TooLarge.code)
        return error(413, TooLarge.code, f"body of {length} bytes is over the limit of {svc.max_body_bytes} bytes")
    request[SLOT] = await _take_slot(request)
    if request.version >= (1, 1):
        request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


def _notify(app: web.Application) -> None:
    """Wake every long-poll: the service's state changed."""
    app[CHANGED]["event"].set()
    app[CHANGED]["event"] = asyncio.Event()


async def get_task(request: web.Request) -> web.Response:
    app, node = request.app, request[NODE]
    svc = app[SERVICE]
    try:
        wait = min(float(request.query.get("wait", svc.cfg.server.poll_s)), svc.cfg.server.poll_s)
    except ValueError:
        return error(400, "bad_request", "query parameter 'wait' must be a number of seconds")
    try:  # a node with another model is refused before it is counted as connected
        svc.check_spec(request.headers.get(SPEC_HASH_HEADER))
    except ShoalError as e:
        return error(_status_of(e), e.code, str(e))
    evaluates = request.query.get("eval") == "1"
    end = time.monotonic() + max(wait, 0.0)
    while True:
        event = app[CHANGED]["event"]
        work = svc.poll(node, time.monotonic(), evaluates)
        if work is not None:
            return web.json_response(work)
        left = end - time.monotonic()
        if left <= 0:
            return web.json_response({"status": "wait", "version": svc.version})
        try:
            await asyncio.wait_for(event.wait(), left)
        except asyncio.TimeoutError:
            pass


async def get_model(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    svc.seen(request[NODE], time.monotonic())
    etag = svc.etag
    headers = {"ETag": etag, "X-Shoal-Version": str(svc.version), "Cache-Control": "no-cache"}
    if etag in [t.strip() for t in request.headers.get("If-None-Match", "").split(",")]:
        return web.Response(status=304, headers=headers)
    return web.Response(body=svc.model_body(), headers=headers, content_type="application/octet-stream")


async def post_update(request: web.Request) -> web.Response:
    app, node = request.app, request[NODE]
    svc = app[SERVICE]
    length = request.content_length
    if length is None:
        svc.refused("length_required")
        return error(411, "length_required", "send the update with a Content-Length header")
    if length > svc.max_body_bytes:
        svc.refused(TooLarge.code)
        return error(413, TooLarge.code, f"body of {length} bytes is over the limit of {svc.max_body_bytes} bytes")
    # At most ``ingest_slots`` bodies are read at once, each into a preallocated buffer
    # that the update is decoded in place from and streamed into the aggregate; the
    # other uploads wait (before sending, with Expect: 100-continue; else in their
    # sockets). Memory stays O(slots x model) for any number of nodes.
    slot = request.get(SLOT) or await _take_slot(request)
    view = memoryview(slot.buf)
    try:
        got = 0
        while got < length:
            chunk = await request.content.readany()
            if not chunk:
                break
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
        if got < length:
            svc.refused("malformed")
            return error(400, "malformed", f"body ended after {got} of {length} bytes (truncated)")
        try:
            result = svc.submit(node, view[:length], time.monotonic())
        except ShoalError as e:
            log.info("update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
            return error(_status_of(e), getattr(e, "code", "error"), str(e))
    finally:
        del view
        slot.release()
    if svc.tick(time.monotonic()):
        _notify(app)
    return web.json_response(result)


async def post_secagg(request: web.Request) -> web.Response:
    """One secure aggregation message of the open round (server/secure_round.py)."""
    app, node = request.app, request[NODE]
    svc = app[SERVICE]
    length = request.content_length
    if length is not None and length > svc.max_body_bytes:
        svc.refused(TooLarge.code)
        return error(413, TooLarge.code, f"body of {length} bytes is over the limit of {svc.max_body_bytes} bytes")
    body = await request.read()
    now = time.monotonic()
    try:
        result = svc.secure(node, now).receive(node, request.match_info["stage"], body)
    except ShoalError as e:
        svc.refused(getattr(e, "code", "error"))
        log.info("secure aggregation message from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(_status_of(e), getattr(e, "code", "error"), str(e))
    if svc.tick(now):
        _notify(app)
    return web.json_response(result)


async def get_secagg(request: web.Request) -> web.Response:
    """Long-poll for the server's answer to a stage: 200 with the message once the stage
    closed, 202 ``{"status": "wait"}`` if it is still open when ``wait`` runs out."""
    app, node = request.app, request[NODE]
    svc = app[SERVICE]
    try:
        round_ = int(request.query["round"])
        wait = min(float(request.query.get("wait", svc.cfg.server.poll_s)), svc.cfg.server.poll_s)
    except (KeyError, ValueError):
        return error(400, "bad_request", "query parameters: 'round' (an integer) and 'wait' (seconds) are needed")
    end = time.monotonic() + max(wait, 0.0)
    while True:
        event = app[CHANGED]["event"]
        try:
            body = svc.secure(node, time.monotonic()).reply(node, request.match_info["stage"], round_)
        except ShoalError as e:
            return error(_status_of(e), getattr(e, "code", "error"), str(e))
        if body is not None:
            return web.Response(body=body, content_type="application/octet-stream")
        left = end - time.monotonic()
        if left <= 0:
            return web.json_response({"status": "wait", "round": round_}, status=202)
        try:
            await asyncio.wait_for(event.wait(), left)
        except asyncio.TimeoutError:
            pass


async def post_eval(request: web.Request) -> web.Response:
    """A node's evaluation of a global version on its own test data (JSON, docs/protocol.md)."""
    svc, node = request.app[SERVICE], request[NODE]
    length = request.content_length
    if length is None:
        svc.refused("length_required")
        return error(411, "length_required", "send the report with a Content-Length header")
    if length > MAX_EVAL_BODY:
        svc.refused(TooLarge.code)
        return error(413, TooLarge.code, f"report of {length} bytes is over the limit of {MAX_EVAL_BODY} bytes")
    body = await request.read()
    try:
        result = svc.report_eval(node, body, time.monotonic())
    except ShoalError as e:
        log.info("evaluation report from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(_status_of(e), getattr(e, "code", "error"), str(e))
    return web.json_response(result)


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].status(time.monotonic()))


async def get_metrics(request: web.Request) -> web.Response:
    text = request.app[SERVICE].prometheus(time.monotonic())
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


def make_app(service: ServerService, registry: Registry) -> web.Application:
    app = web.Application(middlewares=[auth], client_max_size=service.max_body_bytes + 1024)
    app[SERVICE] = service
    app[REGISTRY] = registry
    slots: asyncio.Queue = asyncio.Queue()
    for _ in range(service.cfg.server.ingest_slots):
        slots.put_nowait(bytearray(service.max_body_bytes))
    app[CHANGED] = {"event": asyncio.Event(), "slots": slots, "touched": {}}
    app.router.add_get("/v1/task", get_task)
    app.router.add_get("/v1/model", get_model)
    app.router.add_post("/v1/update", post_update, expect_handler=expect_update)
    app.router.add_post("/v1/secagg/{stage}", post_secagg)
    app.router.add_get("/v1/secagg/{stage}", get_secagg)
    app.router.add_post("/v1/eval", post_eval)
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/metrics", get_metrics)
    return app


async def run_clock(app: web.Application, stop: asyncio.Event) -> None:
    """Drive the service's time: open rounds when nodes are there, close them at deadlines."""
    svc = app[SERVICE]
    while not stop.is_set():
        if svc.tick(time.monotonic()):
            _notify(app)
        if svc.finished(time.monotonic()):
            stop.set()
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass


async def serve(service: ServerService, registry: Registry, ssl_context: ssl.SSLContext | None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until every round is done (and the nodes were told), or SIGINT/SIGTERM."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    app = make_app(service, registry)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    s = service.cfg.server
    site = web.TCPSite(runner, s.host, s.port, ssl_context=ssl_context)
    await site.start()
    scheme = "https" if ssl_context else "http"
    log.info("listening on %s://%s:%d (version %d of %d)", scheme, s.host, s.port, service.version, s.rounds)
    try:
        await run_clock(app, stop)
    finally:
        _notify(app)
        await runner.cleanup()
    log.info("stopped at version %d", service.version)
