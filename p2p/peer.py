"""The gossip peer's transport (`shoal peer`): aiohttp around the sans-I/O PeerService.

One peer trains on its own data (the task's, shoal/task.py) and exchanges models as
``gossip.algorithm`` says:

- ``gossip``: every ``gossip.period`` seconds, train, then push the model to a peer drawn
  from the Cyclon view (``POST /gossip``, safetensors body, the answer is the other's
  pre-merge model; GossipNode);
- ``group_average``, ``dpsgd``, ``secure_groups``: synchronous rounds on wall-clock slots
  of ``gossip.period`` seconds: train at the slot's start, then exchange, over by 0.8 of the
  slot with whatever arrived: group averaging's slices (``POST /group``, GridAverage), a
  D-PSGD mixing step with partners from the view (``POST /dpsgd``, DpsgdStep), or a secure
  group average (``POST /secure``, SecureGroup). Groups come from the directory of peers the
  Membership has heard of, laid out on the virtual grid (p2p/group_average.py).

Every slot or step also shuffles views (``POST /shuffle``, JSON). Every decision is a call
into p2p/service.py (PeerService: bodies and time in, bodies and decisions out); every body
is parsed by p2p/messages.py; this module moves bytes, keeps time and bounds connections:

- every request carries the network credential (``Authorization: Bearer TOKEN``); a
  request without it gets 401, before ``100 Continue`` when the client asks for one;
- every connection has a deadline: a request's headers must arrive within
  HEADER_TIMEOUT_S of the connection's start, the next request's within IDLE_TIMEOUT_S of
  the previous answer (an idle keep-alive connection is closed then), and a body may not
  pause for more than ``body_timeout`` (408, closed); at most MAX_CONNECTIONS_PER_ADDRESS connections per
  remote address;
- a bad body gets 4xx ``{"error": code, "detail": message}`` and changes nothing; an
  unexpected exception is logged once and answered 500, state untouched;
- outgoing contacts go only where the address policy allows (p2p/addresses.py), with the
  token only over HTTPS (plain HTTP only with ``insecure=True``).

With ``privacy.mode = "local"`` the trainer runs DP-SGD on a seed only this peer knows, and
the peer keeps its own epsilon over its trainings (client/node.py's NodePrivacy, the
simulator's accountant), stopping before a training that would pass ``target_epsilon``.

A peer's identity is its advertised URL, so a peer restarted on the same address is the
same peer to the others. It stops after ``gossip.rounds`` local steps (0: until stopped),
or at SIGINT/SIGTERM: it ends the step it is in (waits are cut short), writes its final
model (``model.safetensors``) and a last metrics record to ``--out``, and exits.

Every ``simulation.eval_every`` local steps (and the last) the peer evaluates its current
model with every metric the task gives: ``test_<metric>`` on the central test set (only
with ``--data client:<i>`` when the split has one), ``local_test_<metric>`` and
``local_test_num_examples`` on its own test data; one metrics.jsonl record, and
``metrics`` in ``GET /status``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import ssl
import time
import zlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from shoal.client.node import NodePrivacy
from shoal.client.pipeline import local_step
from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.errors import ShoalError, TooLarge
from shoal.metrics import MetricsLog, json_safe
from shoal.privacy_plan import LOCAL_UPLOAD_EXAMPLES, plan_of
from shoal.rounds import evaluation_due
from shoal.seeding import derive_seed
from shoal.server.dashboard import is_dashboard_path
from shoal.task import ClientData, num_examples, task_name
from shoal.wire import encode_model

from .connections import (
    HEADER_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS_PER_ADDRESS,
    Connections,
    GuardedHandler,
    GuardedRunner,
    PolicyResolver,
    guarded_site,
)
from .gossip import GossipNode
from .group_average import GridAverage, SliceMessage
from .messages import Refused, parse_refusal
from .page import peer_dashboard
from .robust import check_gossip_settings
from .secure_group import SecureGroup, SecureMessage
from .service import Outgoing, PeerService, Rejected

log = logging.getLogger(__name__)

OUTGOING_PER_HOST = 8  # our own connections to one peer


@dataclass
class PeerData:
    """A peer's own data: what it trains on, its own test data (optional) and, in a
    simulation-style run (``--data client:<i>``), the split's central test set (optional).
    Each is an (x, y) tensor pair or a torch Dataset (shoal.task.ClientData)."""

    train: ClientData
    test: ClientData | None = None
    central_test: ClientData | None = None


@dataclass
class PeerSettings:
    advertise: str  # our URL, also our identity
    bootstrap: tuple[str, ...] = ()
    token: str = ""
    insecure: bool = False
    ssl_server: ssl.SSLContext | None = None
    ssl_client: ssl.SSLContext | None = None
    out_dir: Path | None = None


def _error(status: int, code: str, detail: str) -> web.Response:
    return web.json_response({"error": code, "detail": detail}, status=status)


class _HangUp(Rejected):
    """A refusal after which the connection is closed (the rest of its body is not waited for)."""


class Peer:
    """One gossip peer: the PeerService, its trainer and data, and the HTTP around them."""

    def __init__(self, cfg: Config, trainer: LocalTrainer, data: PeerData, settings: PeerSettings):
        g = cfg.gossip
        check_gossip_settings(cfg)
        self.cfg, self.g, self.trainer, self.data, self.s = cfg, g, trainer, data, settings
        self.spec = trainer.spec
        self.plan = plan_of(cfg)
        # what this peer tells others of its data: its example count weighs its model in merges and
        # group averages; under local DP it is data-dependent and not noised, so it says 1 (uniform)
        self.shared_examples = LOCAL_UPLOAD_EXAMPLES if self.plan.dp_sgd else num_examples(data.train)
        params = trainer.flat.detach().clone()
        self.svc = PeerService(
            cfg,
            self.spec,
            params,
            self.shared_examples,
            settings.advertise,
            settings.bootstrap,
            settings.insecure,
            wall_offset=time.time() - time.monotonic(),  # loop.time() is time.monotonic() in asyncio
        )
        self.max_bytes = self.svc.max_bytes
        self.body_timeout = max(5.0, 4 * g.timeout)
        self.steps = 0
        self.train_loss: float | None = None
        self.last_eval: dict[str, float] = {}  # the latest evaluation's metrics (GET /status)
        self.metrics = MetricsLog(settings.out_dir, cfg.output.tensorboard) if settings.out_dir else None
        # local DP (privacy.mode = "local"): the trainer runs DP-SGD; this peer's epsilon over its own
        # trainings, kept in a ledger in --out so a restarted peer goes on from it
        self.privacy = (
            NodePrivacy(
                cfg,
                settings.advertise,
                num_examples(data.train),
                settings.out_dir / "privacy_ledger.json" if settings.out_dir else None,
            )
            if self.plan.dp_sgd
            else None
        )
        self.guard = Connections(MAX_CONNECTIONS_PER_ADDRESS, HEADER_TIMEOUT_S, IDLE_TIMEOUT_S)
        self.errors = 0  # requests answered 500 (a bug: logged with its traceback)
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._step_open: dict[int, asyncio.Event] = {}

    @property
    def node(self) -> GossipNode:
        return self.svc.node

    # --- the incoming side -------------------------------------------------------------------

    def _authorized(self, request: web.BaseRequest) -> bool:
        if not self.s.token:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(errors="replace"), f"Bearer {self.s.token}".encode())

    @web.middleware
    async def _last_line(self, request: web.Request, handler):
        """Every answer is JSON; a known refusal its 4xx; anything else a logged 500 with nothing
        applied. The connection's header deadline is off while a request is handled."""
        conn = request.protocol
        if isinstance(conn, GuardedHandler):
            conn.disarm()
        try:
            if not self._authorized(request) and not is_dashboard_path(request.path):  # the page: its own login
                return _error(401, "unauthorized", "missing or wrong network token (Authorization: Bearer TOKEN)")
            return await handler(request)
        except _HangUp as e:
            resp = _error(e.status, e.code, e.detail)
            resp.force_close()
            if request.transport is not None and not request.transport.is_closing():
                await resp.prepare(request)
                await resp.write_eof()
            request.protocol.force_close()
            return resp
        except Rejected as e:
            return _error(e.status, e.code, e.detail)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error(e.status, e.reason.lower().replace(" ", "_"), e.text or e.reason)
        except ConnectionError:
            return _error(400, "disconnected", "the connection was lost")
        except Exception:
            self.errors += 1
            log.exception("unexpected error in %s %s; answered 500, nothing applied", request.method, request.path)
            return _error(500, "internal", "the peer hit an unexpected error; nothing was applied (see its log)")
        finally:
            if isinstance(conn, GuardedHandler) and conn.transport is not None:
                conn.arm(self.guard.idle_timeout)

    async def _expect(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the token and the size are checked before the body is asked for."""
        if not self._authorized(request):
            return _error(401, "unauthorized", "missing or wrong network token (Authorization: Bearer TOKEN)")
        if request.content_length is not None and request.content_length > self.max_bytes:
            return _error(413, TooLarge.code, f"body of {request.content_length} bytes is over {self.max_bytes}")
        if request.version >= (1, 1) and request.transport is not None:
            request.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._last_line], client_max_size=self.max_bytes + 1)
        for path, handler in (
            ("/gossip", self.handle_gossip),
            ("/shuffle", self.handle_shuffle),
            ("/group", self.handle_group),
            ("/dpsgd", self.handle_dpsgd),
            ("/secure", self.handle_secure),
        ):
            app.router.add_post(path, handler, expect_handler=self._expect)
        app.router.add_get("/status", self.handle_status)
        peer_dashboard(self).add_routes(app)  # GET /: this peer's page (p2p/page.py)
        return app

    async def _body(self, request: web.Request) -> bytes:
        """The body, up to the size limit, each wait for bytes bounded by ``body_timeout``. A body
        over the limit of a peer that runs another task is refused for its spec hash."""
        if request.content_length is not None and request.content_length > self.max_bytes:
            head = await self._chunk(request)
            self._check_spec_hash(head)
            self.svc.rejected += 1
            raise _HangUp(413, TooLarge.code, f"body over the limit of {self.max_bytes} bytes")
        buf = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4 * self.body_timeout
        while chunk := await self._chunk(request, max(0.0, min(self.body_timeout, deadline - loop.time()))):
            buf += chunk
            if len(buf) > self.max_bytes:
                self._check_spec_hash(buf)
                self.svc.rejected += 1
                raise _HangUp(413, TooLarge.code, f"body over the limit of {self.max_bytes} bytes")
        return bytes(buf)

    def _check_spec_hash(self, head: bytes | bytearray) -> None:
        try:
            self.svc.check_spec_hash(head)
        except Rejected as e:
            raise _HangUp(e.status, e.code, e.detail) from None

    async def _chunk(self, request: web.Request, timeout: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(self.body_timeout if timeout is None else timeout):
                return await request.content.readany()
        except TimeoutError:
            raise _HangUp(408, "body_timeout", f"no body bytes for {self.body_timeout:g} s") from None

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _wall_step(self) -> int:
        """The exchange step the wall clock is in: rounds are slots of ``gossip.period`` seconds
        from the epoch, so peers that share a clock and a config agree on the round."""
        return math.floor(time.time() / self.g.period) * self.g.exchanges_per_round

    async def handle_gossip(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return web.Response(body=self.svc.on_gossip(body, self._now()), content_type="application/octet-stream")

    async def handle_shuffle(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return web.Response(body=self.svc.on_shuffle(body, self._now()), content_type="application/json")

    async def handle_group(self, request: web.Request) -> web.Response:
        ex, out = self.svc.on_group(await self._body(request), self._now(), self._wall_step())
        if ex is None:
            return web.json_response({"ok": True, "held": True})
        self._dispatch(ex, out)
        self._wake.set()
        return web.json_response({"ok": True})

    async def handle_secure(self, request: web.Request) -> web.Response:
        sg, out = self.svc.on_secure(await self._body(request), self._now(), self._wall_step())
        if sg is None:
            return web.json_response({"ok": True, "held": True})
        self._dispatch(sg, out)
        self._wake.set()
        return web.json_response({"ok": True})

    async def handle_dpsgd(self, request: web.Request) -> web.Response:
        msg = self.svc.parse_mix_request(await self._body(request), self._wall_step())
        if msg.step not in self.svc.mixing:  # the sender is ahead of us: wait for our step, briefly
            if len(self._step_open) > 8:
                raise Rejected(503, "busy", "too many requests wait for steps about to open")
            opened = self._step_open.setdefault(msg.step, asyncio.Event())
            try:
                await asyncio.wait_for(opened.wait(), 0.8 * self.g.period)
            except TimeoutError:
                pass
        body = self.svc.on_mix_request(msg, self._now())
        return web.Response(body=body, content_type="application/octet-stream")

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def status(self) -> dict[str, Any]:
        return {
            **self.svc.counters(),
            "task": task_name(self.trainer.task),
            "steps": self.steps,
            "metrics": json_safe(self._shown_metrics()),
            "connections_refused": self.guard.refused,
            "errors": self.errors,
            **self._privacy_fields(public=True),
        }

    def _shown_metrics(self) -> dict[str, float]:
        """What GET /status shows of the latest evaluation: under DP (privacy.release not clear) only
        the model on the central test set, not the figures of this peer's own test data."""
        if not self.plan.withholds:
            return self.last_eval
        return {k: v for k, v in self.last_eval.items() if k.startswith("test_")}

    def _privacy_fields(self, public: bool = False) -> dict[str, Any]:
        """Local DP: this peer's epsilon so far (over its trainings), delta, trainings, the accountant.
        ``public`` (GET /status, which answers anyone): the epsilon only where it says nothing of the
        peer's data (PrivacyPlan.node_reports: at q = B / n_k it would reveal roughly how many
        examples the peer holds); the peer's own log and metrics.jsonl have it either way."""
        if self.privacy is None or self.privacy.accountant is None:
            return {}
        if public and not self.plan.node_reports:
            return {
                "delta": self.cfg.privacy.delta,
                "dp_trainings": self.privacy.rounds,
                "accountant": "withheld: this peer's epsilon, at q = B / n_k, would reveal roughly its example "
                "count (its log and metrics.jsonl have it; privacy.local_sampling_rate or release = 'clear' "
                "shows it here)",
            }
        return {
            "epsilon": self.privacy.epsilon,
            "delta": self.cfg.privacy.delta,
            "dp_trainings": self.privacy.rounds,
            "accountant": self.privacy.accountant.describe(),
        }

    # --- the outgoing side ------------------------------------------------------------------

    def _headers(self, url: str) -> dict[str, str]:
        """The token, never over plain HTTP unless --insecure."""
        if not self.s.token or (url.startswith("http://") and not self.s.insecure):
            return {}
        return {"Authorization": f"Bearer {self.s.token}"}

    async def _post(self, out: Outgoing) -> bytes:
        """POST ``out``; the answer's body (at most our body limit), or Refused / a transport error."""
        if self._session is None or self._session.closed:
            raise Refused(0, "stopping", "this peer is stopping")
        if not out.url.startswith("https://") and not self.s.insecure:
            raise Refused(0, "insecure", f"{out.url}: plain HTTP without --insecure")
        async with self._session.post(
            out.url,
            data=out.body,
            headers={**self._headers(out.url), "Content-Type": out.content_type},
            ssl=True if self.s.ssl_client is None else self.s.ssl_client,  # True: aiohttp's default checks
            allow_redirects=False,
        ) as r:
            data = await r.content.read(self.max_bytes + 1)
            if len(data) > self.max_bytes:
                raise Refused(r.status, "too_large", "answer over our body limit")
            if r.status != 200:
                raise parse_refusal(r.status, data)
            return data

    async def _contact(self, out: Outgoing, ok: Callable[[bytes], None], failed: Callable[[Exception], None]) -> None:
        """POST ``out``; hand the answer to ``ok`` or the failure to ``failed``. Never raises
        (a peer's answer, however wrong, is a failure of that peer, not of ours)."""
        try:
            data = await self._post(out)
        except (TimeoutError, aiohttp.ClientError, OSError, ShoalError, ValueError, UnicodeError) as e:
            failed(e)
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug on our side: logged, the contact counts as failed
            log.exception("contacting %s failed unexpectedly", out.url)
            failed(e)
            return
        ok(data)

    async def exchange(self) -> None:
        now = self._now()
        out = self.svc.start_exchange(now)
        if out is None:
            return
        target = out.url.rsplit("/", 1)[0]

        def failed(e: Exception) -> None:
            if isinstance(e, Refused) and e.code == "spec_mismatch":
                log.warning("%s refused our model: %s", target, e.detail)
            else:
                log.info("exchange with %s failed: %s", target, e)
            self.svc.on_contact_failure(target, self._now())

        await self._contact(out, lambda data: self.svc.on_exchange_reply(target, data, self._now()), failed)

    async def shuffle(self) -> None:
        out = self.svc.start_shuffle(self._now())
        if out is None:
            return
        target = out.url.rsplit("/", 1)[0]

        def failed(e: Exception) -> None:
            log.info("shuffle with %s failed: %s", target, e)
            self.svc.on_contact_failure(target, self._now())

        await self._contact(out, lambda data: self.svc.on_shuffle_reply(target, data, self._now()), failed)

    def _dispatch(self, ex: GridAverage | SecureGroup, msgs: list) -> None:
        for msg in msgs:
            task = asyncio.get_running_loop().create_task(self._send_msg(ex, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_msg(self, ex: GridAverage | SecureGroup, msg: SliceMessage | SecureMessage) -> None:
        """POST a group message; a member that cannot be reached or refuses is gone for this
        exchange (and a connection failure counts against it in the membership)."""
        m = self.svc.node.membership
        if not self.svc.may_contact(msg.target, self._now()):
            self._dispatch(ex, ex.on_unreachable(msg.target, self._now()))
            self._wake.set()
            return
        out = self.svc.encode_group_message(msg)
        result: list[Exception] = []
        await self._contact(out, lambda data: None, result.append)
        if not result:
            self.svc.policy.on_success(msg.target)
            return
        e = result[0]
        if isinstance(e, Refused):  # alive, but it will not take it (another group, a closed round, a bad body)
            (log.warning if e.code == "spec_mismatch" else log.info)("%s refused a message: %s", msg.target, e)
            m.seen(msg.target, self._now())
        else:
            log.info("%s failed: %s", out.url, e)
            if self.svc.on_contact_failure(msg.target, self._now()):
                log.info("%s: removed %s after repeated failures", self.svc.id, msg.target)
        self._dispatch(ex, ex.on_unreachable(msg.target, self._now()))
        self._wake.set()

    async def _wait(self, seconds: float) -> None:
        """Wait for a message (``_wake``), ``seconds`` at most, or less when the peer is stopping."""
        if self._stop.is_set():
            return
        waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self._stop.wait())]
        try:
            await asyncio.wait(waits, timeout=max(0.0, seconds) + 1e-3, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _drive(self, obj: GridAverage | SecureGroup, until: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            self._dispatch(obj, obj.tick(loop.time()))
            if obj.done or loop.time() >= until or self._stop.is_set():
                break
            deadline = obj.next_deadline()
            wait = min(until, deadline if deadline is not None else until) - loop.time()
            await self._wait(wait)

    async def group_exchange(self, step: int, weight: float, until: float | None = None) -> float:
        """One group-averaging exchange with the groups of ``step`` laid out over our directory;
        returns the weight behind the averaged model. It ends by ``until`` (loop time) even if
        some members never answered, so a slot's exchange never spills into the next slot."""
        now = self._now()
        until = now + 4 * self.g.timeout if until is None else until
        ex, out = self.svc.open_group(step, weight, now, until)
        if ex is None:
            return weight
        self._dispatch(ex, out)
        await self._drive(ex, until)
        async with self._lock:
            return self.svc.finish_group(ex)

    async def secure_exchange(self, step: int, until: float) -> None:
        """One secure group average (p2p/secure_group.py) in our group of ``step`` (one grid axis)."""
        sg, out = self.svc.open_secure(step, self.shared_examples, self._now())
        if sg is None:
            return
        self._dispatch(sg, out)
        await self._drive(sg, until)
        async with self._lock:
            self.svc.finish_secure(sg, step)

    async def dpsgd_step(self, step: int, until: float) -> None:
        """One D-PSGD mixing step with partners from our view, open to requests until ``until``."""
        st, outs = self.svc.open_mix(step, until, self._now())
        self._step_open.setdefault(step, asyncio.Event()).set()
        for old in [k for k in self._step_open if k < step]:
            del self._step_open[old]

        async def mix(out: Outgoing) -> None:
            target = out.url.rsplit("/", 1)[0]

            def failed(e: Exception) -> None:
                if isinstance(e, Refused):  # busy, closed, another step: alive, no edge this step
                    (log.warning if e.code == "spec_mismatch" else log.debug)("%s refused to mix: %s", target, e)
                else:
                    log.info("mixing with %s failed: %s", target, e)
                    self.svc.on_contact_failure(target, self._now())
                st.on_unreachable(target, self._now())

            if not self.svc.may_contact(target, self._now()):
                st.on_unreachable(target, self._now())
                return
            await self._contact(out, lambda data: self.svc.on_mix_reply(st, target, data, self._now()), failed)

        await asyncio.gather(*[mix(o) for o in outs])
        await self._wait_until(until)  # others may still ask us
        async with self._lock:
            self.svc.finish_mix(st, self._now())

    async def _wait_until(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._stop.wait(), max(0.0, until - loop.time()))
        except TimeoutError:
            pass

    # --- training, evaluation, the loops ---------------------------------------------------

    async def local_step(self) -> bool:
        """One round of local training; False (nothing trained) when local DP's budget is spent:
        one more training would take epsilon past ``privacy.target_epsilon``."""
        async with self._lock:
            if self.privacy is not None and not self.privacy.allows_next_round():
                return False
            seed = derive_seed(self.cfg.simulation.seed, self.steps, zlib.crc32(self.node.id.encode()))
            if self.privacy is not None:
                seed = self.privacy.training_seed(seed)  # DP-SGD's noise and sampling on a seed only we know
            update = local_step(self.trainer, self.node.params, self.data.train, seed)  # the client pipeline's
            self.train_loss = update.metrics.get("train_loss")
            self.node.local_update(self.trainer.flat)
            self.steps += 1
            if self.privacy is not None:  # the model leaves this peer with its next message
                self.privacy.spend(self.steps)
            return True

    def evaluation(self) -> dict[str, float]:
        """Every metric the task gives for the current (merged) model: ``test_<metric>`` on
        the central test set, ``local_test_<metric>`` (+ ``local_test_num_examples``) on the
        peer's own test data; empty when the peer has neither."""
        out: dict[str, float] = {}
        if self.data.central_test is not None:
            ev = self.trainer.evaluate_data(self.node.params, self.data.central_test)
            out.update({f"test_{k}": v for k, v in ev.items() if k != "num_examples"})
        if self.data.test is not None:
            ev = self.trainer.evaluate_data(self.node.params, self.data.test)
            out.update({f"local_test_{k}": v for k, v in ev.items() if k != "num_examples"})
            out["local_test_num_examples"] = int(ev["num_examples"])
        return out

    async def evaluate(self, final: bool = False) -> None:
        """Evaluate the current model; one metrics record (with age, view size, bytes sent)."""
        async with self._lock:
            self.last_eval = self.evaluation()
        if self.metrics:
            c = self.svc.counters()
            algo = self.g.algorithm
            stats = {"group_average": "group", "dpsgd": "dpsgd", "secure_groups": "secure"}.get(algo)
            self.metrics.write(
                {
                    "round": self.steps,
                    **self.last_eval,
                    "train_loss": self.train_loss,
                    "age": self.node.age,
                    "merges": self.node.merges,
                    "view_size": len(self.node.membership.view),
                    "bytes_sent": self.svc.bytes_sent,
                    "bytes_sent_per_round": self.svc.bytes_sent / max(self.steps, 1),
                    "rejected": self.svc.rejected,
                    "bounded": self.node.bounded,
                    "algorithm": algo,
                    "directory": len(self.node.membership.known),
                    **({f"{stats}_{k}": v for k, v in c[stats].items()} if stats else {}),
                    **self._privacy_fields(),
                    **({"final": True} if final else {}),
                }
            )

    def save_model(self) -> Path | None:
        """The current model as ``model.safetensors`` in the output folder (written whole, then renamed)."""
        if self.s.out_dir is None:
            return None
        self.s.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.s.out_dir / "model.safetensors"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(encode_model(self.node.params, self.spec, self.node.version, {"age": self.node.age}))
        tmp.replace(path)
        return path

    async def run(self, host: str, port: int, stop: asyncio.Event) -> None:
        """Serve on host:port and gossip every ``period`` seconds until ``stop`` is set (or
        ``gossip.rounds`` local steps are done); then save the final model and metrics."""
        self._stop = stop
        runner = GuardedRunner(self.app(), self.guard, access_log=None, keepalive_timeout=IDLE_TIMEOUT_S)
        await runner.setup()
        site = guarded_site(runner, host, port, self.s.ssl_server, self.guard)
        await site.start()
        timeout = aiohttp.ClientTimeout(total=self.g.timeout, sock_connect=self.g.timeout)
        connector = aiohttp.TCPConnector(limit_per_host=OUTGOING_PER_HOST, resolver=PolicyResolver(self.svc.policy))
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        log.info(
            "peer %s listening on %s:%d, bootstrap %s, %s",
            self.svc.id,
            host,
            port,
            ",".join(self.s.bootstrap) or "-",
            self.g.algorithm,
        )
        try:
            if self.g.algorithm == "gossip":
                await self._run_push_pull(stop)
            else:
                await self._run_rounds(stop)
        finally:
            await runner.cleanup()  # no new requests, so no new messages to send
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._session.close()
            if stop.is_set():  # stopped by a signal: the last record marks it
                await self.evaluate(final=True)
            saved = self.save_model()
            log.info("stopped after %d local steps%s", self.steps, f"; final model in {saved}" if saved else "")

    async def _step_done(self) -> bool:
        """Evaluate when due; True when ``gossip.rounds`` local steps are done."""
        last = bool(self.g.rounds) and self.steps >= self.g.rounds
        if evaluation_due(self.steps, self.cfg.simulation.eval_every, stop=last):
            await self.evaluate(final=last)
        return last

    async def _run_push_pull(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not await self.local_step():
                await self.evaluate(final=True)
                return
            await asyncio.gather(self.exchange(), self.shuffle())
            last = await self._step_done()
            self.node.expire(self._now())
            if last:
                break
            try:
                await asyncio.wait_for(stop.wait(), self.g.period)
            except TimeoutError:
                pass

    async def _run_rounds(self, stop: asyncio.Event) -> None:
        """Synchronous rounds on the wall clock (slots of ``gossip.period`` seconds): at the start
        of a slot, train, then ``exchanges_per_round`` exchanges of the algorithm, all over by
        0.8 of the slot (whatever did not arrive by then is left out); a Cyclon shuffle per slot
        keeps the views and the directory fresh. Training that overruns a slot makes the peer
        skip to the next one."""
        g = self.g
        while not stop.is_set():
            slot = math.floor(time.time() / g.period) + 1
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, slot * g.period - time.time()))
                break
            except TimeoutError:
                pass
            self._spawn(self.shuffle())  # never holds up the slot
            if not await self.local_step():
                await self.evaluate(final=True)
                return
            weight = float(self.shared_examples) if g.group_weights == "examples" else 1.0
            m = g.exchanges_per_round
            for k in range(m):
                if stop.is_set():
                    break
                # exchange k ends by 0.8 (k + 1) / m of the slot, on the wall clock
                end = self._now() + (slot + 0.8 * (k + 1) / m) * g.period - time.time()
                if g.algorithm == "group_average":
                    weight = await self.group_exchange(slot * m + k, weight, end)
                elif g.algorithm == "secure_groups":
                    await self.secure_exchange(slot * m + k, end)
                else:
                    await self.dpsgd_step(slot * m + k, end)
            if await self._step_done():
                break

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
