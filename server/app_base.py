"""What every server app is built on: authentication (a node's token or client certificate, the
admin's and researchers' tokens), the registry, and the shared body buffers (:func:`base_app`)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from shoal.config import Config
from shoal.errors import ConfigError
from shoal.log_redaction import redact
from shoal.pki import peer_fingerprint, read_secret
from shoal.web.dashboard import is_dashboard_path

from .chunks import ChunkedUploads
from .http_common import (
    ADMIN,
    CHANGED,
    CHUNKS,
    NODE,
    REGISTRY,
    REVOCATIONS,
    SETTINGS,
    SUBMITTER,
    SUBMITTERS,
    answer_and_hang_up,
    error,
    last_line,
    notify,
)
from .registry import AuthError, Registry, Revocations, hash_token, well_formed

log = logging.getLogger(__name__)


INVITES_PER_SLOT = 4


ADMIN_PATHS = frozenset({"/v1/status", "/metrics"})


RUNS_PATH = "/v1/runs"  # a federation's runs: the admin's and researchers' routes (shoal run ...)


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header.startswith("Bearer ") else None


def _client_key(request: web.Request) -> str | None:
    """The registry fingerprint of the TLS client certificate (server.tls_client_ca), if any:
    the TLS handshake already proved the client holds its key and that the CA signed it."""
    transport = request.transport
    ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
    return peer_fingerprint(ssl_object.getpeercert(binary_form=True)) if ssl_object is not None else None


def authenticate_node(request: web.Request) -> web.Response | None:
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
        refused = authenticate_node(request)
    else:
        refused = None
    if refused is None:
        return await handler(request)
    if request.body_exists and not request.content.at_eof():  # a body from a caller we refused: not read
        await answer_and_hang_up(request, refused)
    return refused


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


def base_app(cfg: Config, registry: Registry, max_body: int) -> web.Application:
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
    revocations = app[REVOCATIONS] = Revocations(registry)
    revocations.subscribe(app[CHUNKS].drop_nodes)  # a revoked node's uploads let go of their buffers
    revocations.subscribe(lambda _names: notify(app))  # its held long poll is answered 403 at once
    quiet = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _QuietBadRequests) for f in quiet.filters):
        quiet.addFilter(_QuietBadRequests())
    return app


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
