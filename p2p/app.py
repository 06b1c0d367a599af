"""The incoming side of a gossip peer: its aiohttp application (routes, the network token, bodies
read under a size limit and a deadline, refusals answered as JSON).

Every route is one call into p2p/service.py (PeerService); this module only moves bytes:

- every request carries the network credential (``Authorization: Bearer TOKEN``); a
  request without it gets 401, before ``100 Continue`` when the client asks for one;
- a body may not pause for more than ``body_timeout`` (408, closed) and may not pass the
  service's body limit (413, closed; refused for its spec hash first when it names another task);
- a bad body gets 4xx ``{"error": code, "detail": message}`` and changes nothing; an
  unexpected exception is logged once and answered 500, state untouched.

What a route starts (a group exchange that a message opened, a D-PSGD step a request waits
for) is handed to the peer's :class:`Exchanges` (p2p/peer.py), which sends and drives it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from shoal.errors import TooLarge
from shoal.web.dashboard import Dashboard, is_dashboard_path

from .connections import Connections, GuardedHandler
from .grid_average import GridAverage
from .group_average import SliceMessage
from .identity import cert_hosts
from .secure_group import SecureGroup, SecureMessage
from .service import Parsed, PeerService, Rejected

log = logging.getLogger(__name__)

OFF_LOOP_BYTES = 64 * 1024  # bodies above this are parsed in a worker thread, not on the event loop


class Exchanges(Protocol):
    """What the routes need of the peer's outgoing side."""

    def now(self) -> float: ...

    def wall_step(self) -> int: ...

    def dispatch(self, ex: GridAverage | SecureGroup, msgs: list[SliceMessage] | list[SecureMessage]) -> None: ...

    def wake(self) -> None: ...

    async def wait_for_step(self, step: int) -> None: ...


def error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


class HangUp(Rejected):
    """A refusal after which the connection is closed (the rest of its body is not waited for)."""


class PeerApp:
    """The routes of one peer (module docstring)."""

    def __init__(
        self,
        svc: PeerService,
        token: str,
        guard: Connections,
        exchanges: Exchanges,
        status: Callable[[], dict[str, Any]],
        dashboard: Dashboard,
        body_timeout: float,
    ):
        self.svc, self.token, self.guard, self.ex = svc, token, guard, exchanges
        self.status, self.dashboard, self.body_timeout = status, dashboard, body_timeout
        self.max_bytes = svc.max_bytes
        self.errors = 0  # requests answered 500 (a bug: logged with its traceback)

    def authorized(self, request: web.BaseRequest) -> bool:
        if not self.token:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(errors="replace"), f"Bearer {self.token}".encode())

    @web.middleware
    async def last_line(self, request: web.Request, handler):
        """Every answer is JSON; a known refusal its 4xx; anything else a logged 500 with nothing
        applied. The connection's header deadline is off while a request is handled."""
        conn = request.protocol
        if isinstance(conn, GuardedHandler):
            conn.disarm()
        try:
            if not self.authorized(request) and not is_dashboard_path(request.path):  # the page: its own login
                return error(401, "unauthorized", "missing or wrong network token (Authorization: Bearer TOKEN)")
            return await handler(request)
        except HangUp as e:
            resp = error(e.status, e.code, e.detail)
            resp.force_close()
            if request.transport is not None and not request.transport.is_closing():
                await resp.prepare(request)
                await resp.write_eof()
            request.protocol.force_close()
            return resp
        except Rejected as e:
            return error(e.status, e.code, e.detail)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error(e.status, e.reason.lower().replace(" ", "_"), e.text or e.reason)
        except ConnectionError:
            return error(400, "disconnected", "the connection was lost")
        except Exception:
            self.errors += 1
            log.exception("unexpected error in %s %s; answered 500, nothing applied", request.method, request.path)
            return error(500, "internal", "the peer hit an unexpected error; nothing was applied (see its log)")
        finally:
            if isinstance(conn, GuardedHandler) and conn.transport is not None:
                conn.arm(self.guard.idle_timeout)

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the token and the size are checked before the body is asked for."""
        if not self.authorized(request):
            return error(401, "unauthorized", "missing or wrong network token (Authorization: Bearer TOKEN)")
        if request.content_length is not None and request.content_length > self.max_bytes:
            return error(413, TooLarge.code, f"body of {request.content_length} bytes is over {self.max_bytes}")
        if request.version >= (1, 1) and request.transport is not None:
            request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.last_line], client_max_size=self.max_bytes + 1)
        for path, handler in (
            ("/gossip", self.handle_gossip),
            ("/shuffle", self.handle_shuffle),
            ("/group", self.handle_group),
            ("/dpsgd", self.handle_dpsgd),
            ("/secure", self.handle_secure),
        ):
            app.router.add_post(path, handler, expect_handler=self.expect)
        app.router.add_get("/status", self.handle_status)
        self.dashboard.add_routes(app)  # GET /: this peer's page (p2p/page.py)
        return app

    # --- bodies ----------------------------------------------------------------------------------

    async def body(self, request: web.Request) -> bytes:
        """The body, up to the size limit, each wait for bytes bounded by ``body_timeout``. A body
        over the limit of a peer that runs another task is refused for its spec hash."""
        if request.content_length is not None and request.content_length > self.max_bytes:
            head = await self._chunk(request)
            self._check_spec_hash(head)
            self.svc.rejected += 1
            raise HangUp(413, TooLarge.code, f"body over the limit of {self.max_bytes} bytes")
        buf = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4 * self.body_timeout
        while chunk := await self._chunk(request, max(0.0, min(self.body_timeout, deadline - loop.time()))):
            buf += chunk
            if len(buf) > self.max_bytes:
                self._check_spec_hash(buf)
                self.svc.rejected += 1
                raise HangUp(413, TooLarge.code, f"body over the limit of {self.max_bytes} bytes")
        return bytes(buf)

    def _check_spec_hash(self, head: bytes | bytearray) -> None:
        try:
            self.svc.check_spec_hash(head)
        except Rejected as e:
            raise HangUp(e.status, e.code, e.detail) from None

    async def _chunk(self, request: web.Request, timeout: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(self.body_timeout if timeout is None else timeout):
                return await request.content.readany()
        except TimeoutError:
            raise HangUp(408, "body_timeout", f"no body bytes for {self.body_timeout:g} s") from None

    # --- routes ----------------------------------------------------------------------------------

    async def parsed(self, request: web.Request, kind: str) -> bytes | Parsed:
        """The body, parsed once (PeerService.parse): a large one in a worker thread, so that its
        JSON header and tensors never hold up the event loop (the other requests, the exchanges);
        a small one is left to the service to parse in place."""
        body = await self.body(request)
        if len(body) <= OFF_LOOP_BYTES:
            return body
        return await asyncio.to_thread(self.svc.parse, kind, body)

    @staticmethod
    def identity(request: web.Request) -> frozenset[str] | None:
        """The hosts of the caller's verified TLS client certificate (None: it presented none)."""
        transport = request.transport
        return cert_hosts(transport.get_extra_info("peercert")) if transport is not None else None

    async def handle_gossip(self, request: web.Request) -> web.Response:
        body = await self.parsed(request, "gossip")
        answer = self.svc.on_gossip(body, self.ex.now(), self.identity(request))
        return web.Response(body=answer, content_type="application/octet-stream")

    async def handle_shuffle(self, request: web.Request) -> web.Response:
        body = await self.parsed(request, "shuffle")
        answer = self.svc.on_shuffle(body, self.ex.now(), self.identity(request))
        return web.Response(body=answer, content_type="application/json")

    async def handle_group(self, request: web.Request) -> web.Response:
        body = await self.parsed(request, "group")
        ex, out = self.svc.on_group(body, self.ex.now(), self.ex.wall_step(), self.identity(request))
        if ex is None:
            return web.json_response({"ok": True, "held": True})
        self.ex.dispatch(ex, out)
        self.ex.wake()
        return web.json_response({"ok": True})

    async def handle_secure(self, request: web.Request) -> web.Response:
        body = await self.parsed(request, "secure")
        sg, out = self.svc.on_secure(body, self.ex.now(), self.ex.wall_step(), self.identity(request))
        if sg is None:
            return web.json_response({"ok": True, "held": True})
        self.ex.dispatch(sg, out)
        self.ex.wake()
        return web.json_response({"ok": True})

    async def handle_dpsgd(self, request: web.Request) -> web.Response:
        body = await self.parsed(request, "dpsgd")
        msg = self.svc.parse_mix_request(body, self.ex.wall_step(), self.identity(request))
        if msg.step not in self.svc.mixing:  # the sender is ahead of us: wait for our step, briefly
            await self.ex.wait_for_step(msg.step)
        body = self.svc.on_mix_request(msg, self.ex.now())
        return web.Response(body=body, content_type="application/octet-stream")

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())
