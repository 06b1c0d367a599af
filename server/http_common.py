"""What every HTTP app of the server shares (the core's, a federation's, an edge's): the app and
request keys, the JSON error shape and its :class:`Refusal`, the last-line middleware, query
parameters, and the long-poll's wake-up (:func:`notify` / :func:`wait_event`).

Helpers here are public because several apps use them; each app's routes live in its own module."""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from shoal.config import Config
from shoal.errors import ShoalError, TooLarge, UpdateRejected, WireError

from .chunks import ChunkedUploads
from .federation.runs import Federation
from .model_download import ModelDownload
from .registry import Registry, Revocations
from .service import ServerService
from .task_registry import RunError

log = logging.getLogger(__name__)


SERVICE = web.AppKey("service", ServerService)


FEDERATION = web.AppKey("federation", Federation)


class Clock(Protocol):
    """What run_clock drives: the one ServerService, or the Federation."""

    def tick(self, now: float) -> bool: ...

    def finished(self, now: float) -> bool: ...


CLOCK = web.AppKey("clock", Clock)


SETTINGS = web.AppKey("settings", Config)  # the server's own config (listen, limits)


SUBMITTERS = web.AppKey("submitters", dict)  # token hash -> "admin" or a researcher's name


SUBMITTER = web.RequestKey("submitter", str)


REGISTRY = web.AppKey("registry", Registry)


CHANGED = web.AppKey("changed", dict)


CHUNKS = web.AppKey("chunks", ChunkedUploads)  # open chunked uploads (server/chunks.py)


REVOCATIONS = web.AppKey("revocations", Revocations)  # the revoked names, pushed to every run (registry.py)


CHUNK_DIGEST_HEADER = "X-Shoal-Chunk-Sha256"


MODEL_DIGEST_HEADER = "X-Shoal-Sha256"  # the whole model's SHA-256, with every download (whole or a range)


ADMIN = web.AppKey("admin", str)


NODE = web.RequestKey("node", str)


SPEC_HASH_HEADER = "X-Shoal-Spec-Hash"  # a node's model spec hash, sent with every poll


_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{0,9})?")


_INTEGER = re.compile(r"[0-9]{1,18}")


SLICE_S = 1.0  # a long-poll looks this often whether its client is still there


SHUTDOWN_S = 3.0  # on SIGTERM, requests in flight get this long before they are cut


class Refusal(Exception):
    """A request answered with its own 4xx/5xx JSON error before anything was applied."""

    def __init__(self, status: int, code: str, detail: str, close: bool = False):
        super().__init__(detail)
        self.status, self.code, self.detail, self.close = status, code, detail, close


def svc_of(request: web.Request) -> ServerService:
    """The service a node's request is for: the server's one run, or in a federation the run
    of ``/runs/{run}/v1/...`` (404 if there is no such run, 409 once it ended)."""
    run = request.match_info.get("run")
    if run is None:
        return request.app[SERVICE]
    try:
        svc = request.app[FEDERATION].service(run)
    except RunError as e:
        raise Refusal(e.status, e.code, str(e)) from None
    if svc is None:
        raise Refusal(409, "run_over", f"{run} has ended; poll GET /v1/offers for the runs open now")
    if NODE in request and request.app[FEDERATION].db.answer_of(run, request[NODE]) == "refused":
        raise Refusal(403, "refused_run", f"node {request[NODE]} refused {run} for good; it gets none of its work")
    return svc


def error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


def status_of(e: ShoalError) -> int:
    if isinstance(e, TooLarge):
        return 413
    if isinstance(e, WireError):
        return 400
    if isinstance(e, UpdateRejected):
        return 409
    return 400


def gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


@web.middleware
async def last_line(request: web.Request, handler):
    """Every answer is JSON. A known fault is its own 4xx (a :class:`Refusal`); a client that
    went away is one log line; any other exception is a bug: logged with its traceback and
    answered 500 with nothing applied (the handlers change state only after every check)."""
    try:
        return await handler(request)
    except Refusal as e:
        resp = error(e.status, e.code, e.detail)
        if e.close:  # the rest of a body we stopped reading is not waited for: answer, then hang up
            await answer_and_hang_up(request, resp)
        return resp
    except web.HTTPException as e:  # aiohttp's own (404, 405, ...): the same JSON shape
        if e.status < 400:
            raise
        return error(e.status, e.reason.lower().replace(" ", "_"), e.text or e.reason)
    except ConnectionError as e:
        log.info("%s %s: the client went away (%s)", request.method, request.path, e)
        return error(400, "disconnected", "the connection was lost")
    except Exception:
        log.exception("unexpected error in %s %s; answered 500, nothing applied", request.method, request.path)
        return error(500, "internal", "the server hit an unexpected error; nothing was applied (see its log)")


async def answer_and_hang_up(request: web.Request, resp: web.Response) -> None:
    """Send ``resp`` now and close the connection after it, so the unread rest of the request's
    body is neither waited for nor read (aiohttp would otherwise linger reading it for 10 s)."""
    resp.force_close()
    if not gone(request):
        await resp.prepare(request)
        await resp.write_eof()
    request.protocol.force_close()


def seconds_param(request: web.Request, key: str, cap: float) -> float:
    """A query parameter of seconds: a plain finite decimal >= 0, capped at ``cap``."""
    raw = request.query.get(key)
    if raw is None:
        return cap
    if not _SECONDS.fullmatch(raw) or not math.isfinite(float(raw)):
        raise Refusal(
            400,
            "bad_request",
            f"query parameter {key!r} must be a number of seconds >= 0 (digits, optionally a decimal point)",
        )
    return min(float(raw), cap)


def integer_param(request: web.Request, key: str) -> int:
    raw = request.query.get(key)
    if raw is None or not _INTEGER.fullmatch(raw):
        raise Refusal(400, "bad_request", f"query parameter {key!r} (an integer >= 0) is needed")
    return int(raw)


def tick(app: web.Application) -> None:
    """Advance the service's clock after a request; a failure here is the clock's to log
    (run_clock retries), never the request's (its update was already applied)."""
    try:
        if app[CLOCK].tick(time.monotonic()):
            notify(app)
    except Exception:
        log.exception("the service's clock failed after a request; run_clock retries")


def notify(app: web.Application) -> None:
    """Wake every long-poll: the service's state changed."""
    app[CHANGED]["event"].set()
    app[CHANGED]["event"] = asyncio.Event()


async def wait_event(event: asyncio.Event, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass


async def long_poll_secagg(
    request: web.Request,
    round_: int,
    end: float,
    reply: Callable[[], bytes | None],
    refused_status: Callable[[ShoalError], int],
) -> web.Response:
    """A secure-aggregation stage's answer, long-polled until ``end``: ``reply()`` gives the bytes
    (None: not yet); 202 ``wait`` at ``end``; a refusal as ``refused_status`` maps it."""
    while True:
        event = request.app[CHANGED]["event"]
        try:
            body = reply()
        except ShoalError as e:
            return error(refused_status(e), getattr(e, "code", "error"), str(e))
        if body is not None:
            return web.Response(body=body, content_type="application/octet-stream")
        left = end - time.monotonic()
        if left <= 0:
            return web.json_response({"status": "wait", "round": round_}, status=202)
        if gone(request):
            return error(400, "disconnected", "the connection was lost")
        await wait_event(event, min(left, SLICE_S))


def settings_of(request: web.Request) -> Config:
    return request.app[SETTINGS]


_RANGE = re.compile(r"bytes=([0-9]{1,15})-([0-9]{0,15})")


def _byte_range(request: web.Request, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a ``Range: bytes=a-b`` header (one range; ``b`` may be left out), None
    without one; 416 if it is not one range inside the model."""
    spec = request.headers.get("Range")
    if spec is None:
        return None
    m = _RANGE.fullmatch(spec.strip())
    start = int(m.group(1)) if m else size
    end = (int(m.group(2)) + 1 if m.group(2) else size) if m else 0
    if not m or start >= size or end <= start:
        raise Refusal(
            416, "bad_range", f"Range {spec[:60]!r}: ask for one range bytes=a-b inside the model's {size} bytes"
        )
    return start, min(end, size)


async def send_model(request: web.Request, dl: ModelDownload) -> web.StreamResponse:
    """Answer a model download of ``dl`` (a root's, or an edge's copy of its root's): 304 for a
    current If-None-Match, 412 for a stale If-Match, else the whole body or one byte range."""
    headers = {"ETag": dl.etag, "X-Shoal-Version": str(dl.version), "Cache-Control": "no-cache"}
    if dl.etag in [t.strip() for t in request.headers.get("If-None-Match", "").split(",")]:
        return web.Response(status=304, headers=headers)
    match = request.headers.get("If-Match")
    if match is not None and dl.etag not in [t.strip() for t in match.split(",")]:
        raise Refusal(412, "version_changed", f"the model is at version {dl.version} now ({dl.etag}); start over")
    span = _byte_range(request, dl.size)
    start, end = span if span is not None else (0, dl.size)
    headers.update({"Accept-Ranges": "bytes", MODEL_DIGEST_HEADER: await asyncio.to_thread(dl.sha256)})
    if span is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{dl.size}"
        headers[CHUNK_DIGEST_HEADER] = await asyncio.to_thread(dl.sha256, start, end)
    resp = web.StreamResponse(status=206 if span is not None else 200, headers=headers)
    resp.content_type = "application/octet-stream"
    resp.content_length = end - start
    await resp.prepare(request)
    for piece in dl.pieces(start, end):
        await resp.write(piece)  # waits while the connection's buffer is full: memory stays one piece
    await resp.write_eof()
    return resp
