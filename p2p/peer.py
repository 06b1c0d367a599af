"""The gossip peer (`shoal peer`): the asyncio driver that ties its parts together.

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
  Membership has heard of, laid out on the virtual grid (p2p/grid_average.py).

Every slot or step also shuffles views (``POST /shuffle``, JSON). The parts:

- p2p/service.py (PeerService): every piece of protocol state and every decision; bodies and
  time in, bodies and decisions out, no I/O;
- p2p/runtime.py (PeerRuntime): local training, evaluation, the local-DP ledger;
- p2p/store.py (PeerStore): the ``--out`` folder (model, metrics, ledger);
- p2p/app.py (PeerApp): the incoming HTTP side; p2p/page.py the peer's dashboard page.

This module keeps time, POSTs what the service hands out (the token only over HTTPS, plain
HTTP only with ``insecure=True``, to addresses p2p/addresses.py allows) and reports answers
and failures back; connections are bounded by p2p/connections.py.

A peer's identity is its advertised URL, so a peer restarted on the same address is the
same peer to the others. It stops after ``gossip.rounds`` local steps (0: until stopped),
or at SIGINT/SIGTERM: it ends the step it is in (waits are cut short), writes its final
model (``model.safetensors``, named tensors) and a last metrics record to ``--out``, and exits.

Every ``simulation.eval_every`` local steps (and the last) the peer evaluates its current
model with every metric the task gives: ``test_<metric>`` on the central test set (only
with ``--data client:<i>`` when the split has one), ``local_test_<metric>`` and
``local_test_num_examples`` on its own test data; one metrics.jsonl record, and
``metrics`` in ``GET /status``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from shoal.config import Config
from shoal.config.rules import check_gossip_settings
from shoal.errors import ShoalError
from shoal.metrics import MetricsLog, json_safe
from shoal.rounds import evaluation_due

from .app import PeerApp
from .connections import (
    HEADER_TIMEOUT_S,
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS_PER_ADDRESS,
    Connections,
    GuardedRunner,
    PolicyResolver,
    guarded_site,
)
from .gossip import GossipNode
from .grid_average import GridAverage
from .group_average import SliceMessage
from .messages import Refused, parse_refusal
from .page import PeerSource, peer_dashboard
from .runtime import PeerData, PeerRuntime, Trainer
from .secure_group import SecureGroup, SecureMessage
from .service import Outgoing, PeerService, Rejected
from .store import PeerStore

__all__ = ["Peer", "PeerData", "PeerSettings"]

log = logging.getLogger(__name__)

OUTGOING_PER_HOST = 8  # our own connections to one peer
MAX_WAITING_STEPS = 8  # D-PSGD requests that may wait for a step about to open


@dataclass
class PeerSettings:
    advertise: str  # our URL, also our identity
    bootstrap: tuple[str, ...] = ()
    token: str = ""
    insecure: bool = False
    ssl_server: ssl.SSLContext | None = None
    ssl_client: ssl.SSLContext | None = None
    out_dir: Path | None = None
    certified: bool = False  # senders bound to client certificates (p2p/identity.py, docs/peer.md)


class Peer:
    """One gossip peer: the PeerService, its runtime and store, and the HTTP around them."""

    def __init__(self, cfg: Config, trainer: Trainer, data: PeerData, settings: PeerSettings):
        g = cfg.gossip
        check_gossip_settings(cfg)
        self.cfg, self.g, self.s = cfg, g, settings
        self.store = PeerStore(settings.out_dir, cfg.output.tensorboard)
        self.runtime = PeerRuntime(cfg, trainer, data, settings.advertise, self.store.ledger_path)
        self.spec = trainer.spec
        self.shared_examples = self.runtime.shared_examples
        self.svc = PeerService(
            cfg,
            self.spec,
            self.runtime.initial_params(),
            self.shared_examples,
            settings.advertise,
            settings.bootstrap,
            settings.insecure,
            wall_offset=time.time() - time.monotonic(),  # loop.time() is time.monotonic() in asyncio
            certified=settings.certified,
        )
        self.max_bytes = self.svc.max_bytes
        self.guard = Connections(MAX_CONNECTIONS_PER_ADDRESS, HEADER_TIMEOUT_S, IDLE_TIMEOUT_S)
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._step_open: dict[int, asyncio.Event] = {}
        page = peer_dashboard(
            PeerSource(self.svc, self.runtime, self.store, self.guard, lambda: self._stop.is_set()), settings.token
        )
        self.http = PeerApp(self.svc, settings.token, self.guard, self, self.status, page, max(5.0, 4 * g.timeout))

    @property
    def node(self) -> GossipNode:
        return self.svc.node

    @property
    def steps(self) -> int:
        return self.runtime.steps

    @property
    def metrics(self) -> MetricsLog | None:
        return self.store.metrics

    @property
    def errors(self) -> int:
        return self.http.errors

    def app(self) -> web.Application:
        return self.http.app()

    # --- what the routes need (p2p/app.py's Exchanges) -----------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def wall_step(self) -> int:
        """The exchange step the wall clock is in: rounds are slots of ``gossip.period`` seconds
        from the epoch, so peers that share a clock and a config agree on the round."""
        return math.floor(time.time() / self.g.period) * self.g.exchanges_per_round

    def wake(self) -> None:
        self._wake.set()

    async def wait_for_step(self, step: int) -> None:
        """A D-PSGD request ahead of us waits for our step ``step`` to open, briefly."""
        if len(self._step_open) > MAX_WAITING_STEPS:
            raise Rejected(503, "busy", "too many requests wait for steps about to open")
        opened = self._step_open.setdefault(step, asyncio.Event())
        try:
            await asyncio.wait_for(opened.wait(), 0.8 * self.g.period)
        except TimeoutError:
            pass

    def status(self) -> dict[str, Any]:
        rt = self.runtime
        return {
            **self.svc.counters(),
            "task": rt.task_name,
            "steps": rt.steps,
            "metrics": json_safe(rt.shown_metrics()),
            "connections_refused": self.guard.refused,
            "errors": self.http.errors,
            **rt.privacy_fields(public=True),
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
        now = self.now()
        out = self.svc.start_exchange(now)
        if out is None:
            return
        target = out.url.rsplit("/", 1)[0]

        def failed(e: Exception) -> None:
            if isinstance(e, Refused) and e.code == "spec_mismatch":
                log.warning("%s refused our model: %s", target, e.detail)
            else:
                log.info("exchange with %s failed: %s", target, e)
            self.svc.on_contact_failure(target, self.now())

        await self._contact(out, lambda data: self.svc.on_exchange_reply(target, data, self.now()), failed)

    async def shuffle(self) -> None:
        out = self.svc.start_shuffle(self.now())
        if out is None:
            return
        target = out.url.rsplit("/", 1)[0]

        def failed(e: Exception) -> None:
            log.info("shuffle with %s failed: %s", target, e)
            self.svc.on_contact_failure(target, self.now())

        await self._contact(out, lambda data: self.svc.on_shuffle_reply(target, data, self.now()), failed)

    def dispatch(self, ex: GridAverage | SecureGroup, msgs: list[SliceMessage] | list[SecureMessage]) -> None:
        for msg in msgs:
            task = asyncio.get_running_loop().create_task(self._send_msg(ex, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_msg(self, ex: GridAverage | SecureGroup, msg: SliceMessage | SecureMessage) -> None:
        """POST a group message; what a failure means for the exchange and the membership is the
        service's to say (PeerService.on_member_failed)."""
        if not self.svc.may_contact(msg.target, self.now()):
            self.dispatch(ex, self.svc.on_member_failed(ex, msg.target, None, self.now()))
            self.wake()
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
        else:
            log.info("%s failed: %s", out.url, e)
        self.dispatch(ex, self.svc.on_member_failed(ex, msg.target, e, self.now()))
        self.wake()

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
            msgs, deadline = self.svc.tick_exchange(obj, loop.time())
            self.dispatch(obj, msgs)
            if obj.done or loop.time() >= until or self._stop.is_set():
                break
            wait = min(until, deadline if deadline is not None else until) - loop.time()
            await self._wait(wait)

    async def group_exchange(self, step: int, weight: float, until: float | None = None) -> float:
        """One group-averaging exchange with the groups of ``step`` laid out over our directory;
        returns the weight behind the averaged model. It ends by ``until`` (loop time) even if
        some members never answered, so a slot's exchange never spills into the next slot."""
        now = self.now()
        until = now + 4 * self.g.timeout if until is None else until
        ex, out = self.svc.open_group(step, weight, now, until)
        if ex is None:
            return weight
        self.dispatch(ex, out)
        await self._drive(ex, until)
        async with self._lock:
            return self.svc.finish_group(ex)

    async def secure_exchange(self, step: int, until: float) -> None:
        """One secure group average (p2p/secure_group.py) in our group of ``step`` (one grid axis)."""
        sg, out = self.svc.open_secure(step, self.shared_examples, self.now())
        if sg is None:
            return
        self.dispatch(sg, out)
        await self._drive(sg, until)
        async with self._lock:
            self.svc.finish_secure(sg, step)

    async def dpsgd_step(self, step: int, until: float) -> None:
        """One D-PSGD mixing step with partners from our view, open to requests until ``until``."""
        st, outs = self.svc.open_mix(step, until, self.now())
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
                self.svc.on_mix_failed(st, target, e, self.now())

            if not self.svc.may_contact(target, self.now()):
                self.svc.on_mix_failed(st, target, None, self.now())
                return
            await self._contact(out, lambda data: self.svc.on_mix_reply(st, target, data, self.now()), failed)

        await asyncio.gather(*[mix(o) for o in outs])
        await self._wait_until(until)  # others may still ask us
        async with self._lock:
            self.svc.finish_mix(st, self.now())

    async def _wait_until(self, until: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(self._stop.wait(), max(0.0, until - loop.time()))
        except TimeoutError:
            pass

    # --- training, evaluation, the loops ---------------------------------------------------

    async def local_step(self) -> bool:
        """One round of local training (p2p/runtime.py); False when local DP's budget is spent."""
        async with self._lock:
            trained = self.runtime.train(self.node.params)
            if trained is None:
                return False
            self.node.local_update(trained)
            return True

    async def evaluate(self, final: bool = False) -> None:
        """Evaluate the current model; one metrics record (with age, view size, bytes sent)."""
        async with self._lock:
            last_eval = self.runtime.evaluate(self.node.params)
        if self.store.metrics is None:
            return
        c, rt = self.svc.counters(), self.runtime
        algo = self.g.algorithm
        stats = {"group_average": "group", "dpsgd": "dpsgd", "secure_groups": "secure"}.get(algo)
        self.store.write_metrics(
            {
                "round": rt.steps,
                **last_eval,
                "train_loss": rt.train_loss,
                "age": self.node.age,
                "merges": self.node.merges,
                "view_size": len(self.node.membership.view),
                "bytes_sent": self.svc.bytes_sent,
                "bytes_sent_per_round": self.svc.bytes_sent / max(rt.steps, 1),
                "rejected": self.svc.rejected,
                "bounded": self.node.bounded,
                "algorithm": algo,
                "directory": len(self.node.membership.known),
                **({f"{stats}_{k}": v for k, v in c[stats].items()} if stats else {}),
                **rt.privacy_fields(),
                **({"final": True} if final else {}),
            }
        )

    def save_model(self) -> Path | None:
        """The current model as named tensors in ``--out``/model.safetensors (p2p/store.py)."""
        return self.store.save_model(self.node.params, self.spec, self.node.version, self.node.age)

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
            self.node.expire(self.now())
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
                end = self.now() + (slot + 0.8 * (k + 1) / m) * g.period - time.time()
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
