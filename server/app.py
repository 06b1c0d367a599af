"""HTTP transport of the aggregator (aiohttp): routes, auth, body limits, long-poll.

It only moves messages: every decision is a call into :class:`ServerService`. The
protocol is written up in docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import ssl
import time
import weakref
from contextlib import contextmanager
from typing import Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shoal.aggregation.secagg.identity import read_roster
from shoal.config import Config
from shoal.errors import ConfigError, ShoalError, TooLarge, UpdateRejected, WireError
from shoal.log_redaction import install as redact_logs
from shoal.log_redaction import redact
from shoal.pki import peer_fingerprint, read_secret
from shoal.signals import on_stop_signals
from shoal.strict_json import loads_strict

from .bodies import read_body
from .chunks import MAX_BEGIN_BODY, ChunkedUploads, ChunkError
from .connections import listen
from .dashboard import is_dashboard_path, server_dashboard
from .edge import MAX_EDGE_POLL_BODY, PartialIntake, check_edge
from .edge_secure import get_edge_secagg, post_edge_secagg
from .exposition import prometheus_text
from .federation import DEFAULT_FEDERATION_BODY, Federation, RunError
from .registry import AuthError, Registry, Revocations, hash_token, well_formed
from .service import MAX_EVAL_BODY, MAX_FAILURE_BODY, ModelDownload, ServerService

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
INTAKES = web.AppKey("intakes", weakref.WeakKeyDictionary)  # each run's PartialIntake (server/edge.py)
CHUNK_DIGEST_HEADER = "X-Shoal-Chunk-Sha256"
MODEL_DIGEST_HEADER = "X-Shoal-Sha256"  # the whole model's SHA-256, with every download (whole or a range)
ADMIN = web.AppKey("admin", str)
NODE = web.RequestKey("node", str)
SPEC_HASH_HEADER = "X-Shoal-Spec-Hash"  # a node's model spec hash, sent with every poll
INVITES_PER_SLOT = 4
ADMIN_PATHS = frozenset({"/v1/status", "/metrics"})
RUNS_PATH = "/v1/runs"  # a federation's runs: the admin's and researchers' routes (shoal run ...)
MAX_RUN_BODY = 128 * 1024  # POST /v1/runs: a task reference and the run's config
_SECONDS = re.compile(r"[0-9]{1,9}(\.[0-9]{0,9})?")
_INTEGER = re.compile(r"[0-9]{1,18}")
_SLICE_S = 1.0  # a long-poll looks this often whether its client is still there
SHUTDOWN_S = 3.0  # on SIGTERM, requests in flight get this long before they are cut
REVOKED_EVERY_S = 0.25  # a federation reads the revoked nodes this often (`shoal server nodes revoke`)


class Refusal(Exception):
    """A request answered with its own 4xx/5xx JSON error before anything was applied."""

    def __init__(self, status: int, code: str, detail: str, close: bool = False):
        super().__init__(detail)
        self.status, self.code, self.detail, self.close = status, code, detail, close


class Slot:
    """One preallocated body buffer, given back exactly once: by the handler, or, should
    the connection drop before the handler runs, when the connection's task ends."""

    def __init__(self, queue: asyncio.Queue, buf: bytearray):
        self.queue = queue
        self.buf: bytearray | None = buf
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


INVITE = web.RequestKey("invite", Slot)


def _svc(request: web.Request) -> ServerService:
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


def _status_of(e: ShoalError) -> int:
    if isinstance(e, TooLarge):
        return 413
    if isinstance(e, WireError):
        return 400
    if isinstance(e, UpdateRejected):
        return 409
    return 400


def _gone(request: web.Request) -> bool:
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
            await _answer_and_hang_up(request, resp)
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


async def _answer_and_hang_up(request: web.Request, resp: web.Response) -> None:
    """Send ``resp`` now and close the connection after it, so the unread rest of the request's
    body is neither waited for nor read (aiohttp would otherwise linger reading it for 10 s)."""
    resp.force_close()
    if not _gone(request):
        await resp.prepare(request)
        await resp.write_eof()
    request.protocol.force_close()


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header.startswith("Bearer ") else None


def _client_key(request: web.Request) -> str | None:
    """The registry fingerprint of the TLS client certificate (server.tls_client_ca), if any:
    the TLS handshake already proved the client holds its key and that the CA signed it."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return peer_fingerprint(ssl_object.getpeercert(binary_form=True)) if ssl_object is not None else None


def _authenticate(request: web.Request) -> web.Response | None:
    registry = request.app[REGISTRY]
    try:
        token = _bearer(request)
        key = _client_key(request) if token is None else None
        node = request[NODE] = registry.authenticate_key(key) if key else registry.authenticate(token)
    except AuthError as e:
        return error(e.status, e.code, str(e))
    touched = request.app[CHANGED]["touched"]
    now = time.time()
    if now - touched.get(node, 0.0) > 10.0:  # `nodes list` shows last seen; one write per 10 s per node
        registry.touch(node, now)
        touched[node] = now
    return None


def _authenticate_admin(request: web.Request) -> web.Response | None:
    """/v1/status and /metrics show node names, selections and counters: only to the admin
    token of server.admin_token_file, never to a node's token. A federation's runs routes
    also take a researcher's token (federation.researcher_tokens_file)."""
    admin = request.app[ADMIN]
    token = _bearer(request)
    if token and well_formed(token) and request.path.startswith(RUNS_PATH):
        who = request.app[SUBMITTERS].get(hash_token(token))
        if who is not None:
            request[SUBMITTER] = who
            return None
    if not admin:
        return error(
            403,
            "admin_disabled",
            f"{request.path} is off: set server.admin_token_file "
            "(make one with `shoal server admin-token FILE`) and send that token",
        )
    if not token or not well_formed(token) or not hmac.compare_digest(hash_token(token), admin):
        return error(
            401,
            "unauthenticated",
            f"{request.path[:80]} takes the admin token of server.admin_token_file"
            f"{' or a researcher token' if request.path.startswith(RUNS_PATH) else ''}, not a node's token",
        )
    request[SUBMITTER] = "admin"
    return None


@web.middleware
async def auth(request: web.Request, handler):
    """Every route needs ``Authorization: Bearer <token>``: of an enabled node, or for the
    admin routes the admin token. The page (server/dashboard.py) checks its own login."""
    if is_dashboard_path(request.path):
        return await handler(request)
    if request.path in ADMIN_PATHS or request.path == RUNS_PATH or request.path.startswith(RUNS_PATH + "/"):
        refused = _authenticate_admin(request)
    elif NODE not in request:
        refused = _authenticate(request)
    else:
        refused = None
    if refused is None:
        return await handler(request)
    if request.body_exists and not request.content.at_eof():  # a body from a caller we refused: not read
        await _answer_and_hang_up(request, refused)
    return refused


def _seconds(request: web.Request, key: str, cap: float) -> float:
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


def _integer(request: web.Request, key: str) -> int:
    raw = request.query.get(key)
    if raw is None or not _INTEGER.fullmatch(raw):
        raise Refusal(400, "bad_request", f"query parameter {key!r} (an integer >= 0) is needed")
    return int(raw)


@contextmanager
def _upload_of(request: web.Request):
    """Count the node's uploads in flight; 429 above server.uploads_per_node."""
    node, svc = request[NODE], _svc(request)
    uploads: dict[str, int] = request.app[CHANGED]["uploads"]
    limit = svc.cfg.server.uploads_per_node
    if uploads.get(node, 0) >= limit:
        svc.refused("too_many_uploads")
        raise Refusal(
            429, "too_many_uploads", f"node {node!r} already has {limit} uploads in flight (server.uploads_per_node)"
        )
    uploads[node] = uploads.get(node, 0) + 1
    try:
        yield
    finally:
        uploads[node] -= 1
        if not uploads[node]:
            del uploads[node]


def _check_length(request: web.Request) -> int:
    svc = _svc(request)
    length = request.content_length
    if length is None:
        svc.refused("length_required")
        raise Refusal(411, "length_required", "send the body with a Content-Length header")
    if length > svc.max_body_bytes:
        svc.refused(TooLarge.code)
        raise Refusal(413, TooLarge.code, f"body of {length} bytes is over the limit of {svc.max_body_bytes} bytes")
    return length


async def _chunk(request: web.Request, timeout: float, what: str) -> bytes:
    try:
        async with asyncio.timeout(timeout):
            return await request.content.readany()
    except TimeoutError:
        _svc(request).refused("body_timeout")
        raise Refusal(
            408, "body_timeout", f"{what}: no body bytes for {timeout:g} s (server.body_timeout_s)", close=True
        ) from None


async def _read_into(request: web.Request, view: memoryview, length: int, first: bytes) -> None:
    """Fill ``view[:length]``, starting with ``first``: each wait for bytes bounded by
    server.body_timeout_s, the whole body by server.upload_timeout_s and by the open round's
    deadline (a held buffer never outlives its round), and after server.upload_grace_s the
    bytes so far must keep server.min_upload_rate (a slow drip cannot hold a buffer)."""
    svc, node = _svc(request), request[NODE]
    s = svc.cfg.server
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + s.upload_timeout_s
    # a plain sync round closes at its deadline (a secure round's stages keep their own clocks)
    plain_round = svc.sync is not None and svc.sync.open and svc.secure_round is None
    left_in_round = svc.rounds.time_left(time.monotonic()) if plain_round else None
    if left_in_round is not None:
        deadline = min(deadline, start + left_in_round + 1.0)
    got, quiet_since = 0, start
    chunk: bytes | None = first
    while True:
        if chunk:
            if got + len(chunk) > length:
                raise Refusal(400, "malformed", f"body is longer than its Content-Length of {length} bytes", close=True)
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
            quiet_since = loop.time()
            if got == length:
                break
        elif chunk is not None:  # b"": the body ended
            break
        now = loop.time()
        if now - quiet_since >= s.body_timeout_s:
            svc.refused("body_timeout")
            raise Refusal(
                408,
                "body_timeout",
                f"upload: no body bytes for {s.body_timeout_s:g} s (server.body_timeout_s)",
                close=True,
            )
        elapsed = now - start
        if s.min_upload_rate and elapsed > s.upload_grace_s and got < s.min_upload_rate * elapsed:
            svc.refused("too_slow")
            raise Refusal(
                408,
                "too_slow",
                f"upload sent {got} bytes in {elapsed:.1f} s, below server.min_upload_rate = "
                f"{s.min_upload_rate:g} bytes/s after the {s.upload_grace_s:g} s grace",
                close=True,
            )
        horizon = svc.upload_horizon(node, time.monotonic()) if got and elapsed > s.upload_grace_s else None
        if horizon is not None and (length - got) * elapsed / got > horizon:
            svc.refused("too_slow")
            raise Refusal(
                408,
                "too_slow",
                f"at {got / elapsed:.0f} bytes/s this upload ends after its task is more than "
                f"asynchronous.max_staleness versions old (in about {max(horizon, 0.0):.1f} s at the recent pace "
                "of versions), when it would be refused: ask for a new task, or send faster",
                close=True,
            )
        if now >= deadline:
            svc.refused("upload_timeout")
            raise Refusal(
                408,
                "upload_timeout",
                f"body not complete after {elapsed:.1f} s (server.upload_timeout_s, or the round's deadline)",
                close=True,
            )
        wait = min(s.body_timeout_s - (now - quiet_since), deadline - now)
        if s.min_upload_rate:  # wake in time to check the rate, not only at body_timeout_s
            wait = min(wait, max(s.upload_grace_s - elapsed, 0.0) + 0.5)
        # bytes already buffered are taken at once; only an empty buffer is waited on
        chunk = request.content.read_nowait() or await _next_chunk(request, max(wait, 0.01))
    if got < length:
        svc.refused("malformed")
        raise Refusal(400, "malformed", f"body ended after {got} of {length} bytes (truncated)")


async def _next_chunk(request: web.Request, timeout: float) -> bytes | None:
    """The next body bytes (b"" at the end), or None if none came within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            return await request.content.readany()
    except TimeoutError:
        return None


async def _take(request: web.Request, pool: str) -> Slot:
    """A free body buffer (``pool = "slots"``) or upload invitation (``"invites"``); 503
    (retry later) if none frees up within server.upload_timeout_s."""
    s = _svc(request).cfg.server
    queue: asyncio.Queue = request.app[CHANGED][pool]
    try:
        async with asyncio.timeout(s.upload_timeout_s):
            return Slot(queue, await queue.get())
    except TimeoutError:
        _svc(request).refused("busy")
        raise Refusal(
            503, "busy", f"every one of the {queue.maxsize} upload {pool} stayed taken; try again later", close=True
        ) from None


async def _invited(request: web.Request) -> Slot:
    """The upload's invitation: taken before ``100 Continue`` (or, without Expect, before
    its body is read). Invitations cost no memory and are INVITES_PER_SLOT x ingest_slots
    many, so clients that send headers and then no body cannot stop others' uploads (each
    holds one for at most server.body_timeout_s, a node at most server.uploads_per_node);
    they bound the bodies in flight, so waiting uploads cost nothing (they do not send)."""
    invite = request.get(INVITE)
    if invite is None or invite.buf is None:
        invite = request[INVITE] = await _take(request, "invites")
    return invite


def _tick(app: web.Application) -> None:
    """Advance the service's clock after a request; a failure here is the clock's to log
    (run_clock retries), never the request's (its update was already applied)."""
    try:
        if app[CLOCK].tick(time.monotonic()):
            _notify(app)
    except Exception:
        log.exception("the service's clock failed after a request; run_clock retries")


async def expect_update(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue``: check token, size and the node's uploads in flight before
    the node sends its body. No buffer is taken here: a client that never sends its body
    holds nothing (post_update takes a buffer once bytes flow)."""
    try:
        refused = _authenticate(request)
        if refused is not None:
            return refused
        _check_length(request)
        node = request[NODE]
        if request.app[CHANGED]["uploads"].get(node, 0) >= _svc(request).cfg.server.uploads_per_node:
            _svc(request).refused("too_many_uploads")
            return error(
                429, "too_many_uploads", f"node {node!r} has too many uploads in flight (server.uploads_per_node)"
            )
    except Refusal as e:
        return error(e.status, e.code, e.detail)
    except Exception:  # runs outside the middlewares: its own last line
        log.exception("unexpected error in the 100-continue check of %s", request.path)
        return error(500, "internal", "the server hit an unexpected error; nothing was applied (see its log)")
    try:
        await _invited(request)
    except Refusal as e:
        return error(e.status, e.code, e.detail)
    transport = request.transport
    if _gone(request) or transport is None:
        return error(400, "disconnected", "the connection was lost")
    if request.version >= (1, 1):
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None


def _notify(app: web.Application) -> None:
    """Wake every long-poll: the service's state changed."""
    app[CHANGED]["event"].set()
    app[CHANGED]["event"] = asyncio.Event()


async def _wait_event(event: asyncio.Event, timeout: float) -> None:
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        pass


async def get_task(request: web.Request) -> web.Response:
    app, node = request.app, request[NODE]
    run = request.match_info.get("run")
    if run is not None and FEDERATION in app:
        try:
            if app[FEDERATION].service(run) is None:  # the run ended: its nodes go back to the offers
                return web.json_response({"status": "done", "run": run, **app[FEDERATION].ended(run)})
        except RunError as e:
            return error(e.status, e.code, str(e))
    svc = _svc(request)
    end = time.monotonic() + _seconds(request, "wait", svc.cfg.server.poll_s)
    try:  # a node with another model is refused before it is counted as connected
        svc.check_spec(request.headers.get(SPEC_HASH_HEADER))
    except ShoalError as e:
        return error(_status_of(e), e.code, str(e))
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
        if _gone(request):
            return error(400, "disconnected", "the connection was lost")
        await _wait_event(event, min(left, _SLICE_S))


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


async def get_model(request: web.Request) -> web.StreamResponse:
    """The global model: whole, or one byte range (a node's chunked download, resumable by offset).
    Each answer names the version (ETag) and the whole model's SHA-256; a range its own SHA-256.
    ``If-Match`` with an older version's ETag: 412 (the model moved on, start over)."""
    svc = _svc(request)
    svc.seen(request[NODE], time.monotonic())
    resp = await send_model(request, svc.model_download())
    if resp.status != 304:
        svc.activity.sent(request[NODE], resp.content_length or 0, time.monotonic())
    return resp


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


async def post_update(request: web.Request) -> web.Response:
    app, node = request.app, request[NODE]
    svc = _svc(request)
    length = _check_length(request)
    # At most ``ingest_slots`` bodies are read at once, each into a preallocated buffer
    # that the update is decoded in place from and streamed into the aggregate. A buffer
    # is taken only once the body's first bytes arrived (a client that sends headers and
    # no body holds none), and given back however the request ends. Bodies in flight are
    # bounded by the invitations (see _invited): memory stays O(slots x model).
    with _upload_of(request):
        invite = await _invited(request)
        try:
            first = await _chunk(request, svc.cfg.server.body_timeout_s, "upload") if length else b""
            slot = await _take(request, "slots")
            assert slot.buf is not None  # a slot taken from the queue holds its buffer until released
            view = memoryview(slot.buf)
            try:
                await _read_into(request, view, length, first)
                try:
                    result = svc.submit(node, view[:length], time.monotonic())
                except ShoalError as e:
                    log.info("update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
                    return error(_status_of(e), getattr(e, "code", "error"), str(e))
            finally:
                del view
                slot.release()
        finally:
            invite.release()
    _tick(app)
    return web.json_response(result)


def _intake(request: web.Request, svc: ServerService) -> PartialIntake:
    intake = request.app[INTAKES].get(svc)
    if intake is None:
        intake = request.app[INTAKES][svc] = PartialIntake(svc)
    return intake


async def post_edge_poll(request: web.Request) -> web.Response:
    """An edge aggregator's poll: its connected nodes in, the open round's tasks for them out
    (server/edge.py's PartialIntake.poll, docs/hierarchy.md); held up to ``wait`` seconds while
    there is no work for it."""
    app, edge = request.app, request[NODE]
    svc = _svc(request)
    intake = _intake(request, svc)
    body = await _json_body(request, MAX_EDGE_POLL_BODY)
    end = time.monotonic() + _seconds(request, "wait", min(svc.cfg.server.poll_s, svc.cfg.hierarchy.edge_timeout_s / 2))
    registry = app[REGISTRY]
    while True:
        event = app[CHANGED]["event"]
        try:
            answer = intake.poll(edge, body, registry.enabled, time.monotonic(), app[REVOCATIONS].names.__contains__)
        except ShoalError as e:
            status = 403 if getattr(e, "code", "") == "not_an_edge" else _status_of(e)
            return error(status, getattr(e, "code", "error"), str(e))
        _tick(app)  # the nodes it named may complete the quorum that opens a round
        if answer["status"] != "wait" or time.monotonic() >= end or _gone(request):
            return web.json_response(answer)
        await _wait_event(event, min(end - time.monotonic(), _SLICE_S))


async def post_partial(request: web.Request) -> web.Response:
    """An edge aggregator's partial for the open round (server/edge.py, docs/hierarchy.md): read
    under the upload limits (per-node count, body timeouts, minimum rate), then checked and merged."""
    app, edge = request.app, request[NODE]
    svc = _svc(request)
    intake = _intake(request, svc)
    try:
        check_edge(svc, edge)  # a node may not speak for other nodes
    except UpdateRejected as err:
        svc.refused(err.code)
        raise Refusal(403, err.code, str(err)) from None
    length = request.content_length
    if length is None:
        raise Refusal(411, "length_required", "send the body with a Content-Length header")
    if length > intake.max_bytes:
        svc.refused(TooLarge.code)
        raise Refusal(413, TooLarge.code, f"partial of {length} bytes is over the limit of {intake.max_bytes} bytes")
    with _upload_of(request):
        first = await _chunk(request, svc.cfg.server.body_timeout_s, "partial") if length else b""
        body = bytearray(length)
        await _read_into(request, memoryview(body), length, first)
        try:
            result = intake.submit(edge, body, time.monotonic())
        except ShoalError as e:
            log.info("partial from %s refused: %s: %s", edge, getattr(e, "code", "error"), e)
            return error(_status_of(e), getattr(e, "code", "error"), str(e))
    _tick(app)
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
    svc, node = _svc(request), request[NODE]
    body = await _json_body(request, MAX_BEGIN_BODY)
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
    svc, node = _svc(request), request[NODE]
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
    svc = _svc(request)
    chunks = app[CHUNKS]
    offset = _integer(request, "offset")
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
        first = await _chunk(request, svc.cfg.server.body_timeout_s, "upload chunk")
        await _read_into(request, view, length, first)
    finally:
        s.busy = False
    try:
        complete = chunks.accept_chunk(s, view, digest)
    except ChunkError as e:
        return _chunk_refusal(svc, e)
    except ShoalError as e:  # the update itself, refused at this chunk: the upload is over
        svc.upload_refused(node, e, time.monotonic())
        log.info("chunked update from %s refused at byte %d: %s: %s", node, offset, getattr(e, "code", "error"), e)
        return error(_status_of(e), getattr(e, "code", "error"), str(e))
    finally:
        view.release()
    if not complete:
        return web.json_response({"upload": s.id, "received": s.received})
    try:
        result = svc.submit_staged(node, s.stream, s.staged, time.monotonic())
    except ShoalError as e:
        log.info("chunked update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(_status_of(e), getattr(e, "code", "error"), str(e))
    finally:
        s.staged.close()
    _tick(app)
    return web.json_response(result)


async def post_secagg(request: web.Request) -> web.Response:
    """One secure aggregation message of the open round (server/secure_round.py)."""
    app, node = request.app, request[NODE]
    svc = _svc(request)
    length = _check_length(request)
    with _upload_of(request):
        invite = await _invited(request)  # bounds the bodies read at once here too
        try:
            body = bytearray(length)
            first = (
                await _chunk(request, svc.cfg.server.body_timeout_s, "secure aggregation message") if length else b""
            )
            await _read_into(request, memoryview(body), length, first)
        finally:
            invite.release()
    now = time.monotonic()
    try:
        result = svc.secure(node, now).receive(node, request.match_info["stage"], bytes(body))
    except ShoalError as e:
        svc.refused(getattr(e, "code", "error"))
        log.info("secure aggregation message from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(_status_of(e), getattr(e, "code", "error"), str(e))
    _tick(app)
    return web.json_response(result)


async def get_secagg(request: web.Request) -> web.Response:
    """Long-poll for the server's answer to a stage: 200 with the message once the stage
    closed, 202 ``{"status": "wait"}`` if it is still open when ``wait`` runs out."""
    app, node = request.app, request[NODE]
    svc = _svc(request)
    round_ = _integer(request, "round")
    end = time.monotonic() + _seconds(request, "wait", svc.cfg.server.poll_s)
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
        if _gone(request):
            return error(400, "disconnected", "the connection was lost")
        await _wait_event(event, min(left, _SLICE_S))


async def _small_report(request: web.Request, limit: int, what: str, handle) -> web.Response | dict:
    """Read a node's small JSON report (server/bodies.py: Content-Length required, at most ``limit``
    bytes, within server.body_timeout_s) and hand it to ``handle(node, body, now)``; the handler's
    refusal is answered here (4xx, JSON), a result returned."""
    svc, node = _svc(request), request[NODE]
    body = await read_body(request, limit, svc.cfg.server.body_timeout_s, what="report", refused=svc.refused)
    try:
        return handle(node, body, time.monotonic())
    except ShoalError as e:
        log.info("%s report from %s refused: %s: %s", what, node, getattr(e, "code", "error"), e)
        return error(_status_of(e), getattr(e, "code", "error"), str(e))


async def post_eval(request: web.Request) -> web.Response:
    """A node's evaluation of a global version on its own test data (JSON, docs/protocol.md)."""
    result = await _small_report(request, MAX_EVAL_BODY, "evaluation", _svc(request).report_eval)
    return result if isinstance(result, web.Response) else web.json_response(result)


async def post_failed(request: web.Request) -> web.Response:
    """A node's report that its task failed on the node (JSON, docs/protocol.md)."""
    result = await _small_report(request, MAX_FAILURE_BODY, "failure", _svc(request).report_failure)
    if isinstance(result, web.Response):
        return result
    run = request.match_info.get("run")
    if run is not None:  # a federation's run: the report goes into its log (`shoal run logs`)
        fed = request.app[FEDERATION]
        fed.event(run, request[NODE], f"round {result['round']}: reports its task {result['reason']}")
    _tick(request.app)  # every selected node answered or failed: the round may close now
    return web.json_response(result)


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(_svc(request).status(time.monotonic()))


async def get_metrics(request: web.Request) -> web.Response:
    text = prometheus_text(_svc(request), time.monotonic())
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})


def admin_token_hash(cfg: Config) -> str:
    """The SHA-256 of the admin token in server.admin_token_file ("" when none is set)."""
    path = cfg.server.admin_token_file
    if not path:
        return ""
    token = read_secret(path, "server.admin_token_file")
    if len(token) < 32 or not well_formed(token):
        raise ConfigError(
            f"server.admin_token_file = {path!r} must hold one token of 32 to 256 URL-safe "
            "characters (make one with `shoal server admin-token FILE`)"
        )
    return hash_token(token)


class _QuietBadRequests(logging.Filter):
    """aiohttp logs a malformed request (a header line too long, bytes that are not HTTP)
    with a traceback; it is the client's fault and already answered 400: one info line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            # the parser's message quotes the raw request bytes (an Authorization header among them)
            record.msg, record.args = "malformed HTTP request answered %s: %s", (exc.code, redact(str(exc.message)))
            record.exc_info, record.exc_text, record.stack_info = None, None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def make_app(service: ServerService, registry: Registry) -> web.Application:
    """The aiohttp application (run it with ``web.AppRunner(app, keepalive_timeout=server.idle_timeout_s)``,
    as :func:`serve` does, so idle connections are closed)."""
    app = _base_app(service.cfg, registry, service.max_body_bytes)
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
    _node_routes(app, "")
    app.router.add_get("/v1/status", get_status)
    app.router.add_get("/metrics", get_metrics)
    server_dashboard(app[ADMIN], service, registry).add_routes(app)
    return app


def _base_app(cfg: Config, registry: Registry, max_body: int) -> web.Application:
    """What every server has: middlewares, the registry, the admin token, the body buffers."""
    app = web.Application(middlewares=[last_line, auth], client_max_size=max_body + 1024)
    app[REGISTRY] = registry
    app[SETTINGS] = cfg
    app[ADMIN] = admin_token_hash(cfg)
    app[SUBMITTERS] = {}
    slots: asyncio.Queue = asyncio.Queue(maxsize=cfg.server.ingest_slots)
    for _ in range(cfg.server.ingest_slots):
        slots.put_nowait(bytearray(max_body))
    invites: asyncio.Queue = asyncio.Queue(maxsize=INVITES_PER_SLOT * cfg.server.ingest_slots)
    for _ in range(invites.maxsize):
        invites.put_nowait(True)
    app[CHANGED] = {"event": asyncio.Event(), "slots": slots, "invites": invites, "touched": {}, "uploads": {}}
    app[CHUNKS] = ChunkedUploads(cfg.server.ingest_slots)
    app[INTAKES] = weakref.WeakKeyDictionary()
    revocations = app[REVOCATIONS] = Revocations(registry)
    revocations.subscribe(app[CHUNKS].drop_nodes)  # a revoked node's uploads let go of their buffers
    revocations.subscribe(lambda _names: _notify(app))  # its held long poll is answered 403 at once
    quiet = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _QuietBadRequests) for f in quiet.filters):
        quiet.addFilter(_QuietBadRequests())
    return app


def _node_routes(app: web.Application, prefix: str) -> None:
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
    app.router.add_post(prefix + "/v1/partial", post_partial)  # edge aggregators (server/edge.py)
    app.router.add_post(prefix + "/v1/edge/poll", post_edge_poll)
    app.router.add_post(prefix + "/v1/edge/secagg/{stage}", post_edge_secagg)  # server/edge_secure.py
    app.router.add_get(prefix + "/v1/edge/secagg/{stage}", get_edge_secagg)


def make_federation_app(federation: Federation, registry: Registry) -> web.Application:
    """A federation's server: each run speaks the node protocol under ``/runs/{run}``; nodes find
    the open runs at ``GET /v1/offers`` and answer them; ``/v1/runs`` is `shoal run`'s."""
    cfg = federation.cfg
    app = _base_app(cfg, registry, cfg.server.max_body_bytes or DEFAULT_FEDERATION_BODY)
    app[FEDERATION] = federation
    app[CLOCK] = federation
    app[REVOCATIONS].subscribe(lambda names: federation.forget(set(names)))
    app[SUBMITTERS] = researcher_tokens(cfg)
    _node_routes(app, "/runs/{run}")
    app.router.add_get("/v1/offers", get_offers)
    app.router.add_post("/runs/{run}/v1/answer", post_answer)
    app.router.add_post(RUNS_PATH, post_run)
    app.router.add_post(RUNS_PATH + "/bundles", post_bundle)  # server/bundle_store.py: stored, never imported
    app.router.add_get("/runs/{run}/v1/bundle", get_run_bundle)
    app.router.add_get(RUNS_PATH, get_runs)
    app.router.add_get("/v1/status", get_runs)
    app.router.add_get(RUNS_PATH + "/{run}", get_run)
    app.router.add_get(RUNS_PATH + "/{run}/metrics", get_run_metrics)
    app.router.add_get(RUNS_PATH + "/{run}/events", get_run_events)
    app.router.add_post(RUNS_PATH + "/{run}/stop", post_run_stop)
    app.router.add_get(RUNS_PATH + "/{run}/files/{name}", get_run_file)
    server_dashboard(app[ADMIN], federation, registry).add_routes(app)
    return app


async def _json_body(request: web.Request, limit: int) -> object:
    body = await read_body(request, limit, _settings(request).server.body_timeout_s)
    try:
        return loads_strict(body)
    except ValueError as e:
        raise Refusal(400, "malformed", f"the body is not JSON: {e}"[:200]) from None


def _settings(request: web.Request) -> Config:
    return request.app[SETTINGS]


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
    body = await _json_body(request, 4096)
    fed = request.app[FEDERATION]
    return web.json_response(_fed_call(fed.answer, request.match_info["run"], request[NODE], body))


MAX_TASK_CHECKS = 4  # submissions whose task is being checked at once; more are told to retry


async def post_run(request: web.Request) -> web.Response:
    """`shoal run submit`: {"task": NAME, "config": {section: {key: value}}}. The cheap checks here,
    the task's in a thread (a user's task in the worker process), the run stored here."""
    body = await _json_body(request, MAX_RUN_BODY)
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
    _tick(request.app)
    return web.json_response(result, status=201)


async def post_bundle(request: web.Request) -> web.Response:
    """`shoal run submit --bundle`: a signed task bundle's bytes; answers the task name to submit."""
    fed = request.app[FEDERATION]
    if not fed.cfg.federation.max_bundle_mb:
        raise Refusal(403, "bundles_off", "this federation takes no task bundles (federation.max_bundle_mb = 0)")
    limit = min(fed.cfg.federation.max_bundle_mb << 20, fed.cfg.server.max_body_bytes or DEFAULT_FEDERATION_BODY)
    blob = await read_body(request, max(limit, 1), _settings(request).server.body_timeout_s, what="bundle")
    result = await asyncio.to_thread(_fed_call, fed.upload_bundle, request[SUBMITTER], blob, fed.bundles_in_use())
    return web.json_response(result, status=201)


async def get_run_bundle(request: web.Request) -> web.Response:
    """A node fetches a bundle run's task to verify it against its own trusted publishers."""
    blob = _fed_call(request.app[FEDERATION].bundle, request.match_info["run"], request[NODE])
    return web.Response(body=blob, headers={"Content-Type": "application/octet-stream"})


async def get_runs(request: web.Request) -> web.Response:
    return web.json_response({"runs": request.app[FEDERATION].runs(request[SUBMITTER])})


async def get_run(request: web.Request) -> web.Response:
    fed = request.app[FEDERATION]
    return web.json_response(_fed_call(fed.status, request.match_info["run"], time.monotonic(), request[SUBMITTER]))


async def get_run_metrics(request: web.Request) -> web.Response:
    """The run's metrics lines after ``after``; with ``wait``, held until one comes (logs --follow)."""
    fed, who = request.app[FEDERATION], request[SUBMITTER]
    run, after = request.match_info["run"], _integer(request, "after") if "after" in request.query else 0
    end = time.monotonic() + (_seconds(request, "wait", 60.0) if "wait" in request.query else 0.0)
    while True:
        event = request.app[CHANGED]["event"]
        lines = _fed_call(fed.metrics, run, after, who)
        row = fed.db.get(run)
        status = row.status if row is not None else "unknown"
        left = end - time.monotonic()
        if lines or left <= 0 or status not in ("queued", "running") or _gone(request):
            return web.json_response({"run": run, "status": status, "lines": [{"seq": n, **f} for n, f in lines]})
        await _wait_event(event, min(left, _SLICE_S))


async def get_run_events(request: web.Request) -> web.Response:
    """The run's log lines after ``after`` (the server's events, its nodes' answers); with
    ``wait``, held until one comes (`shoal run logs --follow`)."""
    fed = request.app[FEDERATION]
    run, after = request.match_info["run"], _integer(request, "after") if "after" in request.query else 0
    end = time.monotonic() + (_seconds(request, "wait", 60.0) if "wait" in request.query else 0.0)
    while True:
        event = request.app[CHANGED]["event"]
        lines = _fed_call(fed.events, run, after)
        row = fed.db.get(run)
        status = row.status if row is not None else "unknown"
        left = end - time.monotonic()
        if lines or left <= 0 or status not in ("queued", "running") or _gone(request):
            return web.json_response({"run": run, "status": status, "lines": lines})
        await _wait_event(event, min(left, _SLICE_S))


async def post_run_stop(request: web.Request) -> web.Response:
    fed = request.app[FEDERATION]
    result = _fed_call(fed.stop, request.match_info["run"], request[SUBMITTER])
    _tick(request.app)
    return web.json_response(result)


async def get_run_file(request: web.Request) -> web.StreamResponse:
    """`shoal run pull`: the final model, metrics.jsonl or summary.json of an ended run (a
    researcher's DP run: what its release policy lets out)."""
    fed, name = request.app[FEDERATION], request.match_info["name"]
    found = _fed_call(fed.file, request.match_info["run"], name, request[SUBMITTER])
    if isinstance(found, bytes):
        return web.Response(body=found, headers={"Content-Type": "application/octet-stream"})
    return web.FileResponse(found, headers={"Content-Type": "application/octet-stream"})


def researcher_tokens(cfg: Config) -> dict[str, str]:
    """federation.researcher_tokens_file: lines of ``name token`` -> {token hash: name}."""
    path = cfg.federation.researcher_tokens_file
    if not path:
        return {}
    lines = read_secret(path, "federation.researcher_tokens_file").splitlines()
    out = {}
    for i, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or len(parts[1]) < 32 or not well_formed(parts[1]) or parts[0] == "admin":
            raise ConfigError(
                f"{path}:{i}: expected 'NAME TOKEN' (a token of 32 to 256 URL-safe characters; "
                "`shoal server admin-token FILE` makes one)"
            )
        out[hash_token(parts[1])] = parts[0]
    return out


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
                _notify(app)
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
        _notify(app)
        guard.close()  # no new connections, those not through their handshake dropped; the runner ends the rest
        await runner.cleanup()
    if isinstance(service, Federation):
        log.info("stopped; runs in progress resume from their checkpoints on the next start")
    else:
        log.info("stopped at version %d", service.version)
