"""The server's web page: runs, live metric curves, privacy, traffic, refusals and nodes.

``GET /`` is the page (docs/dashboard.md). It is behind the admin token of
``server.admin_token_file``: ``POST /login`` takes the token from a form and sets a session
cookie (HttpOnly, Secure, SameSite=Strict, expiring); a token never travels in a URL. The page
is static HTML + JS (no inline script, a strict Content-Security-Policy) that polls three JSON
endpoints, which scripts can read with the admin token as a Bearer header too:

* ``GET /v1/dashboard/runs``: every run with its status, mode, round, version and why it ended;
* ``GET /v1/dashboard/runs/{run}``: one run's curves (every numeric metric of metrics.jsonl over
  versions), epsilon against its target, bytes up and down, accepted and refused uploads by
  reason, stragglers and dropouts;
  in a federation also ``health``: each node's answer, state (online, training, offline, deferred,
  refused, failed), seconds since it was last seen and its last error, and what a waiting run waits for;
* ``GET /v1/dashboard/nodes``: the registered nodes: online, last seen, runs and rounds taken,
  last refusal, revoked.

The charts are drawn by uPlot (MIT, shipped in shoal/web/static with its licence); every string a
node or a task supplies reaches the page as JSON and is put in with ``textContent``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from shoal.tokens import hash_token, well_formed

STATIC = Path(__file__).parent / "static"
STATIC_FILES = {  # name -> content type; nothing else under /static/ is served
    "dashboard.html": "text/html",
    "login.html": "text/html",
    "login.js": "text/javascript",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
}
COOKIE = "__Host-shoal-session"  # __Host-: Secure, Path=/, no Domain (browsers enforce it)
SESSION_S = 8 * 3600.0  # a session ends this long after the login, whatever happens
IDLE_S = 3600.0  # ... or after this long without a request
MAX_SESSIONS = 64  # the oldest session is dropped beyond this
MAX_LOGIN_BODY = 4096
MAX_RECORDS = 20_000  # metrics lines kept per run for the curves (the oldest go first)
RUN = "run"  # the run id of a single-run server
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make the login form's Origin "null"
    "Cache-Control": "no-store",
}
#: Record fields that are bookkeeping, not curves (the x axis, times, counts, privacy fields).
NOT_CURVES = frozenset(
    {
        "round",
        "version",
        "elapsed_s",
        "virtual_time_s",
        "num_results",
        "num_examples",
        "num_late",
        "fed_num_examples",
        "epsilon",
        "epsilon_next",
        "epsilon_node",
        "epsilon_server",
        "target_epsilon",
        "delta",
        "sampling_rate",
        "rounds_charged",
        "nodes_reporting",
    }
)


def is_dashboard_path(path: str) -> bool:
    """The routes this module answers (and authenticates) itself."""
    return path in ("/", "/login", "/logout") or path.startswith(("/static/", "/v1/dashboard/"))


# --- sessions (no I/O: time is passed in) --------------------------------------------------------


@dataclass
class Session:
    created: float
    used: float


@dataclass
class Sessions:
    """Logged-in browsers: the SHA-256 of each session id (the id itself is only in the cookie)."""

    ttl_s: float = SESSION_S
    idle_s: float = IDLE_S
    cap: int = MAX_SESSIONS
    by_hash: OrderedDict[str, Session] = field(default_factory=OrderedDict)

    def create(self, now: float) -> str:
        sid = secrets.token_urlsafe(32)
        self.by_hash[_digest(sid)] = Session(now, now)
        while len(self.by_hash) > self.cap:
            self.by_hash.popitem(last=False)
        return sid

    def valid(self, sid: str | None, now: float) -> bool:
        """A live session: known, not past its lifetime nor idle too long (it is used now)."""
        if not sid or len(sid) > 100:
            return False
        key = _digest(sid)  # looked up by a hash: no comparison of secret bytes leaks timing
        s = self.by_hash.get(key)
        if s is None:
            return False
        if now - s.created > self.ttl_s or now - s.used > self.idle_s:
            del self.by_hash[key]
            return False
        s.used = now
        return True

    def end(self, sid: str | None) -> None:
        if sid:
            self.by_hash.pop(_digest(sid), None)


def _digest(sid: str) -> str:
    return hashlib.sha256(sid.encode("utf-8", "replace")).hexdigest()


# --- what the page shows (plain data in, JSON-ready dicts out) -----------------------------------


@dataclass
class RecordCache:
    """A run's metrics lines read so far (metrics.jsonl is only appended to): each poll reads
    only what is new. ``offset`` is a byte offset (a file) or the last sequence number (a
    federation's database)."""

    offset: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, new: list[dict[str, Any]]) -> None:
        self.records.extend(new)
        if len(self.records) > MAX_RECORDS:
            del self.records[: len(self.records) - MAX_RECORDS]


def read_new_lines(path: Path, cache: RecordCache) -> RecordCache:
    """Append the complete lines written to ``path`` since the last call (a file that shrank,
    a fresh run, is read again from the start)."""
    try:
        size = path.stat().st_size
    except OSError:
        return cache
    if size < cache.offset:
        cache = RecordCache()
    if size == cache.offset:
        return cache
    with path.open("rb") as f:
        f.seek(cache.offset)
        chunk = f.read(size - cache.offset)
    end = chunk.rfind(b"\n") + 1  # a line being written is read on the next call
    new = []
    for line in chunk[:end].splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            new.append(rec)
    cache.offset += end
    cache.extend(new)
    return cache


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def curves(records: list[dict[str, Any]], x: str = "version") -> dict[str, Any]:
    """Every numeric metric of the records as points ``[x, value]`` (a metric missing from a
    record has no point there), epsilon with its target, and participation per version."""
    metrics: dict[str, list[list[float]]] = {}
    epsilon: list[list[float]] = []
    against_server: list[list[float]] = []  # epsilon against the server itself, where noise protects against it
    participation: dict[str, list[list[float]]] = {"num_results": [], "num_late": []}
    target = None
    mode = None  # the run's privacy mode: a local-DP run whose nodes keep their epsilons has no points
    for rec in records:
        if not _number(rec.get(x)):
            continue
        at: float = rec[x]
        for key, v in rec.items():
            if not _number(v) or not isinstance(key, str):
                continue
            if key in participation:
                participation[key].append([at, v])
            elif key not in NOT_CURVES:
                metrics.setdefault(key, []).append([at, v])
        if _number(rec.get("epsilon")):
            epsilon.append([at, rec["epsilon"]])
        if _number(rec.get("epsilon_server")):
            against_server.append([at, rec["epsilon_server"]])
        if _number(rec.get("target_epsilon")):
            target = rec["target_epsilon"]
        if rec.get("privacy_mode") in ("central", "distributed", "local"):
            mode = rec["privacy_mode"]
    return {
        "x": x,
        "metrics": dict(sorted(metrics.items())),
        "epsilon": {"points": epsilon, "server": against_server, "target": target, "mode": mode},
        "participation": participation,
    }


def traffic(svc: Any | None) -> dict[str, Any]:
    """A live run's totals and their history over versions (empty once the run ended)."""
    if svc is None:
        return {"live": False}
    a, c = svc.activity, svc.counters
    return {
        "live": True,
        "bytes_up": a.bytes_up,
        "bytes_down": a.bytes_down,
        "accepted": c.accepted,
        "refused": dict(sorted(c.rejected.items())),
        "stragglers": a.stragglers,
        "dropouts": a.dropouts,
        "rounds_completed": c.rounds_completed,
        "rounds_failed": c.rounds_abandoned,
        "history": list(a.history),
    }


def run_summary(svc: Any, now: float) -> dict[str, Any]:
    """Status, mode, round, version and time of a live service."""
    out: dict[str, Any] = {
        "mode": svc.mode,
        "round": svc.rounds.round,
        "version": svc.version,
        "rounds_target": svc.cfg.server.rounds,
        "connected": len(svc.connected(now)),
        "elapsed_s": round(now - svc.clock.started_at, 1) if svc.clock.started_at is not None else 0.0,
    }
    if svc.privacy is not None:
        out["epsilon"] = svc.privacy.epsilon
        sv = svc.privacy.server_view
        out["epsilon_server"] = sv.epsilon if sv is not None else None
        out["target_epsilon"] = svc.privacy.p.target_epsilon or None
    if svc.stop_reason:
        out["reason"] = svc.stop_reason
    return out


def node_rows(registry_nodes: list[Any], services: dict[str, Any], now: float, wall: float) -> list[dict[str, Any]]:
    """The registered nodes with what each live run saw of them."""
    rows = []
    online_now = set().union(*(svc.connected(now) for svc in services.values()))
    for n in registry_nodes:
        runs, last_refusal, online = {}, None, n.name in online_now
        for run_id, svc in services.items():
            act = svc.activity.nodes.get(n.name)
            if act is None:
                continue
            runs[run_id] = {"accepted": act.accepted, "rounds": act.rounds, "refused": act.refused}
            r = act.last_refusal
            if r is not None and (last_refusal is None or r["at"] > last_refusal["at"]):
                last_refusal = {"run": run_id, "code": r["code"], "detail": r["detail"], "at": r["at"]}
        if last_refusal is not None:
            last_refusal["ago_s"] = round(now - last_refusal.pop("at"), 1)
        rows.append(
            {
                "name": n.name,
                "online": online and n.enabled,
                "revoked": not n.enabled,
                "last_seen_ago_s": round(wall - n.last_seen, 1) if n.last_seen else None,
                "auth": "key" if n.key else "token",
                "runs": runs,
                "last_refusal": last_refusal,
            }
        )
    return rows


# --- HTTP ------------------------------------------------------------------------------------------


def _secure(resp: web.StreamResponse) -> None:
    resp.headers.update(SECURITY_HEADERS)


def _json(data: Any, status: int = 200) -> web.Response:
    resp = web.json_response(data, status=status)
    _secure(resp)
    return resp


def _redirect(location: str) -> web.Response:
    resp = web.Response(status=303, headers={"Location": location})
    _secure(resp)
    return resp


def _static(name: str) -> web.Response:
    body = (STATIC / name).read_bytes()
    resp = web.Response(body=body, content_type=STATIC_FILES[name], charset="utf-8")
    _secure(resp)
    return resp


class Source(Protocol):
    """Where the page's numbers come from: a server's runs (:class:`ServerSource`) or a peer."""

    kind: str  # "server" or "peer": the page's title and its nodes table's columns

    def runs(self, now: float) -> list[dict[str, Any]]: ...

    def run(self, run_id: str, now: float) -> dict[str, Any] | None: ...

    def nodes(self, now: float) -> list[dict[str, Any]]: ...


class ServerSource:
    """The runs of ``shoal server``: its one ServerService, or a Federation's runs table."""

    kind = "server"

    def __init__(self, source: Any, registry: Any):
        self.source = source  # a ServerService (one run) or a Federation (many)
        self.registry = registry
        self.caches: dict[str, RecordCache] = {}

    def _services(self) -> dict[str, Any]:
        if hasattr(self.source, "active"):
            return dict(self.source.active)
        return {RUN: self.source}

    def _records(self, run: str) -> list[dict[str, Any]]:
        cache = self.caches.get(run, RecordCache())
        if hasattr(self.source, "db"):  # a federation: the run's lines in its database
            while True:
                lines = self.source.db.metrics(run, cache.offset)
                if not lines:
                    break
                cache.offset = lines[-1][0]
                cache.extend([f for _, f in lines])
        else:
            cache = read_new_lines(Path(self.source.cfg.server.out_dir) / "metrics.jsonl", cache)
        self.caches[run] = cache
        return cache.records

    def runs(self, now: float) -> list[dict[str, Any]]:
        if not hasattr(self.source, "db"):
            svc = self.source
            # as a federation's runs table says it: a spent privacy budget finishes a run (with its
            # reason), server.max_failed_rounds fails it
            status = "running" if not svc.done else "failed" if svc.stopped is not None else "finished"
            task = svc.cfg.task.app or f"built-in: {svc.cfg.data.dataset} / {svc.cfg.model.name}"
            return [{"run": RUN, "task": task, "status": status, **run_summary(svc, now)}]
        out = []
        for row in self.source.db.runs():
            item: dict[str, Any] = {"run": row.id, "task": row.task, "status": row.status}
            if row.reason:
                item["reason"] = row.reason
            svc = self.source.active.get(row.id)
            if svc is not None:
                item.update(run_summary(svc, now))
            else:
                item["mode"] = row.config.get("server", {}).get("mode", self.source.cfg.server.mode)
                item.update(self.source.final(row))  # an ended run: its last round and version
                if row.ended is not None:
                    item["elapsed_s"] = round(row.ended - row.created, 1)
            out.append(item)
        return out

    def run(self, run_id: str, now: float) -> dict[str, Any] | None:
        found = next((r for r in self.runs(now) if r["run"] == run_id), None)
        if found is None:
            return None
        records = self._records(run_id)
        out = {**found, "records": len(records), **curves(records), "traffic": traffic(self._services().get(run_id))}
        if hasattr(self.source, "health"):  # a federation: each node's health in this run, as `shoal run status`
            out["health"] = self.source.health(run_id, now)
        return out

    def nodes(self, now: float) -> list[dict[str, Any]]:
        return node_rows(self.registry.list(), self._services(), now, time.time())


class Dashboard:
    """The page's routes on one aiohttp application. ``check_token`` says whether a token is the
    one that opens the page (the server's admin token, a peer's network token); ``off`` is why
    the page is unavailable (no such token configured), or "" when it is on."""

    def __init__(self, source: Source, check_token: Callable[[str], bool], off: str = ""):
        self.source = source
        self.check_token = check_token
        self.off = off
        self.sessions = Sessions()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/", self.page)
        app.router.add_get("/login", self.login_page)
        app.router.add_post("/login", self.login)
        app.router.add_post("/logout", self.logout)
        app.router.add_get("/static/{name}", self.static)
        app.router.add_get("/v1/dashboard/runs", self.api_runs)
        app.router.add_get("/v1/dashboard/runs/{run}", self.api_run)
        app.router.add_get("/v1/dashboard/nodes", self.api_nodes)

    # --- who may look -------------------------------------------------------------------------

    def _token_ok(self, token: str | None) -> bool:
        return not self.off and bool(token) and self.check_token(str(token))

    def allowed(self, request: web.Request) -> bool:
        """A live session cookie, or the token as ``Authorization: Bearer`` (scripts)."""
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return self._token_ok(header[7:].strip())
        return not self.off and self.sessions.valid(request.cookies.get(COOKIE), time.monotonic())

    def _refuse_json(self) -> web.Response:
        if self.off:
            return _json({"error": "dashboard_off", "detail": self.off}, 403)
        detail = "log in at /login, or send the token as a Bearer header"
        return _json({"error": "unauthenticated", "detail": detail}, 401)

    # --- pages ----------------------------------------------------------------------------------

    async def page(self, request: web.Request) -> web.StreamResponse:
        if not self.allowed(request):
            return _redirect("/login")
        return _static("dashboard.html")

    async def login_page(self, request: web.Request) -> web.Response:
        return _static("login.html")

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC_FILES or name.endswith(".html"):
            return _json({"error": "not_found", "detail": "no such file"}, 404)
        return _static(name)

    async def login(self, request: web.Request) -> web.StreamResponse:
        """The login form: same-origin only (with the SameSite=Strict cookie: no cross-site
        request can log in or ride a session), a small body, the token compared in constant time."""
        if not _same_origin(request):
            return _json({"error": "cross_origin", "detail": "log in from this server's own page"}, 403)
        if self.off:
            return _json({"error": "dashboard_off", "detail": self.off}, 403)
        length = request.content_length
        if length is None or length > MAX_LOGIN_BODY:
            return _json({"error": "bad_request", "detail": f"send the form (at most {MAX_LOGIN_BODY} bytes)"}, 400)
        try:
            form = await request.post()
        except (UnicodeDecodeError, ValueError):  # a body that is no form (not UTF-8, bad encoding)
            return _json({"error": "bad_request", "detail": "send the login form (UTF-8, urlencoded)"}, 400)
        token = form.get("token")
        if not isinstance(token, str) or not self._token_ok(token.strip()):
            return _redirect("/login?failed=1")
        sid = self.sessions.create(time.monotonic())
        resp = _redirect("/")
        resp.set_cookie(COOKIE, sid, max_age=int(SESSION_S), path="/", secure=True, httponly=True, samesite="Strict")
        return resp

    async def logout(self, request: web.Request) -> web.StreamResponse:
        if not _same_origin(request):
            return _json({"error": "cross_origin", "detail": "log out from this server's own page"}, 403)
        self.sessions.end(request.cookies.get(COOKIE))
        resp = _redirect("/login")
        resp.del_cookie(COOKIE, path="/", secure=True, httponly=True, samesite="Strict")
        return resp

    # --- the JSON behind every figure ----------------------------------------------------------

    async def api_runs(self, request: web.Request) -> web.Response:
        if not self.allowed(request):
            return self._refuse_json()
        return _json({"kind": self.source.kind, "runs": self.source.runs(time.monotonic())})

    async def api_run(self, request: web.Request) -> web.Response:
        if not self.allowed(request):
            return self._refuse_json()
        found = self.source.run(request.match_info["run"], time.monotonic())
        if found is None:
            return _json({"error": "unknown_run", "detail": "no such run"}, 404)
        return _json(found)

    async def api_nodes(self, request: web.Request) -> web.Response:
        if not self.allowed(request):
            return self._refuse_json()
        return _json({"kind": self.source.kind, "nodes": self.source.nodes(time.monotonic())})


def server_dashboard(admin_hash: str, source: Any, registry: Any) -> Dashboard:
    """The page of ``shoal server``, opened by the admin token of server.admin_token_file."""

    def check(token: str) -> bool:
        return well_formed(token) and hmac.compare_digest(hash_token(token), admin_hash)

    off = "" if admin_hash else "set server.admin_token_file (`shoal server admin-token FILE`) to use the page"
    return Dashboard(ServerSource(source, registry), check, off)


def _same_origin(request: web.Request) -> bool:
    """The browser says the request comes from this server's own page: ``Origin`` (sent with
    every form POST) is this server, or a client without it sent no cross-site fetch metadata."""
    origin = request.headers.get("Origin")
    if origin is not None:
        return origin == f"{request.scheme}://{request.host}"
    return request.headers.get("Sec-Fetch-Site", "same-origin") in ("same-origin", "none")
