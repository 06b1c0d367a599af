"""The gossip peer service (`shoal peer`): aiohttp transport around the protocol objects of p2p/.

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

Every slot or step also shuffles views (``POST /shuffle``, JSON). The protocol decisions
all live in the sans-I/O objects of p2p/; this module only moves bytes.

Every request carries the network credential (``Authorization: Bearer TOKEN``, one
token shared by the peers of a network); a request without it gets 401. Every model
that arrives is validated by shoal.wire (size, spec hash, dtype, shape, finite) and its
header fields (age, num_examples, sender) are type-checked before anything is merged;
a bad one gets 4xx ``{"error": code, "detail": message}`` and the model is untouched. A
model of another spec (a peer running another task) gets 400 ``spec_mismatch`` naming both
spec hashes, even when it is also over the size limit, and the sender logs that detail.
Models travel as ``[compression]`` says (p2p/model_wire.py: dense or q8, optionally
zstd; the header names the encoding, so peers with different settings understand each
other), and a merge bounds the received model's pull to ``robust.norm_bound`` if set
(``gossip.bound_mode``: clip or reject; p2p/merge.py).
HTTPS with a certificate by default; plain HTTP only with ``insecure=True``.

A peer's identity is its advertised URL, so a peer restarted on the same address is
the same peer to the others; after a restart it has an empty view, refills it from
``--bootstrap`` and catches up by merging (the age-gap rule adopts a model far ahead).
Training runs on the event loop between requests (it is short: one round of local
work); requests that arrive meanwhile wait for it.

Every ``simulation.eval_every`` local steps (and the last) the peer evaluates its current
model with every metric the task gives: ``test_<metric>`` on the central test set (only
with ``--data client:<i>`` when the split has one), ``local_test_<metric>`` and
``local_test_num_examples`` on its own test data; one metrics.jsonl record, and
``metrics`` in ``GET /status``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import ssl
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.errors import Malformed, ShoalError, SpecMismatch, TooLarge, WireError
from shoal.metrics import MetricsLog, json_safe
from shoal.seeding import derive_seed
from shoal.task import ClientData, num_examples, task_name
from shoal.wire import default_max_bytes

from .dpsgd import DpsgdStep, MixMessage
from .gossip import GossipNode, ModelMessage
from .group_average import GridAverage, Refusal, SliceMessage, grid_path
from .membership import Membership, ShuffleRequest, ShuffleResponse
from .merge import MergeRule
from .model_wire import (
    decode_gossip_model,
    decode_secure,
    decode_slice,
    encode_gossip_model,
    encode_secure,
    encode_slice,
)
from .robust import check_gossip_settings
from .secure_group import SecureGroup, SecureMessage

_Shuffle = TypeVar("_Shuffle", ShuffleRequest, ShuffleResponse)

log = logging.getLogger(__name__)

MAX_SHUFFLE_BYTES = 64 * 1024
MAX_ID_CHARS = 256
MAX_EARLY = 256  # slice messages held for an exchange this peer has not begun yet
KEEP_EXCHANGES = 8  # finished exchanges kept to answer late repair requests


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


class Refused(ShoalError):
    """The other peer answered our message with an error (its code and detail)."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"HTTP {status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


def _refusal(status: int, body: bytes) -> Refused:
    try:
        data = json.loads(body)
        return Refused(status, str(data["error"]), str(data.get("detail", ""))[:500])
    except (ValueError, KeyError, TypeError):
        return Refused(status, "error", body[:200].decode(errors="replace"))


def _peek_spec_hash(body: bytes | bytearray) -> str | None:
    """The ``spec_hash`` in a message's header, read from its first bytes (None if there is none)."""
    try:
        hlen = struct.unpack("<Q", bytes(body[:8]))[0]
        if hlen > len(body) - 8:
            return None
        meta = json.loads(bytes(body[8 : 8 + hlen]))["__metadata__"]["shoal"]
        value = json.loads(meta).get("spec_hash")
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
        return None
    return value if isinstance(value, str) else None


class _BodyTooLarge(TooLarge):
    """A request body over the peer's limit (HTTP 413)."""


def _check_id(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_ID_CHARS:
        raise Malformed(f"field {key!r} must be a non-empty string of at most {MAX_ID_CHARS} characters")
    return value


def _check_int(header: dict, key: str, minimum: int) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise Malformed(f"header field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


class Peer:
    """State and handlers of one gossip peer; ``run`` serves and trains until stopped."""

    def __init__(self, cfg: Config, trainer: LocalTrainer, data: PeerData, settings: PeerSettings):
        g = cfg.gossip
        check_gossip_settings(cfg)
        self.cfg, self.g, self.trainer, self.data, self.s = cfg, g, trainer, data, settings
        self.spec = trainer.spec
        self.max_bytes = default_max_bytes(self.spec) + 64 * len(self.spec.entries)
        seed = derive_seed(cfg.simulation.seed, zlib.crc32(settings.advertise.encode()))
        membership = Membership(
            settings.advertise,
            g.view_size,
            g.shuffle_length,
            g.timeout,
            g.max_failures,
            quarantine=max(30.0, 10 * g.period),
            seed=seed,
            bootstrap_peers=settings.bootstrap,
        )
        params = trainer.flat.detach().clone()
        self.node = GossipNode(
            membership,
            params,
            num_examples(data.train),
            MergeRule(g.merge, g.staleness_exponent, g.max_age_gap, cfg.robust.norm_bound, g.bound_mode),
            g.timeout,
        )
        self.steps = 0
        self.bytes_sent = 0
        self.rejected = 0
        self._sent = 0  # messages encoded: seeds q8's stochastic rounding
        self.train_loss: float | None = None
        self.last_eval: dict[str, float] = {}  # the latest evaluation's metrics (GET /status)
        self.metrics = MetricsLog(settings.out_dir) if settings.out_dir else None
        self._lock = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        # group averaging (gossip.algorithm = "group_average"): exchanges by step, early messages
        self.exchanges: dict[int, GridAverage] = {}
        self._early: dict[int, list[SliceMessage]] = {}
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.group_stats = {"exchanges": 0, "incomplete": 0, "repaired_slices": 0, "refused": 0, "alone": 0}
        # D-PSGD (gossip.algorithm = "dpsgd"): the open mixing steps, and who waits for one
        self.mixing: dict[int, DpsgdStep] = {}
        self._step_open: dict[int, asyncio.Event] = {}
        self.dpsgd_stats = {"steps": 0, "neighbours": 0, "refused": 0}
        # secure groups (gossip.algorithm = "secure_groups"): the offset from the shared initial model is masked
        self.init = params.clone()
        self.secure: dict[int, SecureGroup] = {}
        self._early_secure: dict[int, list[SecureMessage]] = {}
        self.secure_stats = {"groups": 0, "averaged": 0, "aborted": 0, "alone": 0}

    # --- HTTP handlers ---------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if not self.s.token:
            return True
        got = request.headers.get("Authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.s.token}".encode())

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if not self._authorized(request):
            return _error(401, "unauthorized", "missing or wrong network token (Authorization: Bearer TOKEN)")
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth], client_max_size=self.max_bytes)
        app.router.add_post("/gossip", self.handle_gossip)
        app.router.add_post("/shuffle", self.handle_shuffle)
        app.router.add_post("/group", self.handle_group)
        app.router.add_post("/dpsgd", self.handle_dpsgd)
        app.router.add_post("/secure", self.handle_secure)
        app.router.add_get("/status", self.handle_status)
        return app

    def _encode(self, msg: ModelMessage) -> bytes:
        extra = {"age": msg.age, "num_examples": msg.num_examples, "sender": msg.sender}
        self._sent += 1
        seed = derive_seed(self.cfg.simulation.seed, zlib.crc32(self.node.id.encode()), self._sent)
        return encode_gossip_model(msg.params, self.spec, msg.version, extra, self.cfg.compression, seed)

    def _decode(self, body: bytes, target: str, reply: bool) -> ModelMessage:
        params, header = decode_gossip_model(body, self.spec, self.max_bytes)
        return ModelMessage(
            _check_id(header.get("sender"), "sender"),
            target,
            params,
            _check_int(header, "age", 0),
            header["version"],
            _check_int(header, "num_examples", 1),
            reply,
        )

    def _check_spec_hash(self, body: bytes | bytearray) -> None:
        theirs = _peek_spec_hash(body)
        if theirs is not None and theirs != self.spec.hash:
            raise SpecMismatch(
                f"the model sent has spec hash {theirs!r}, this peer's model {self.spec.hash!r}: "
                "another task, [task.args] or architecture; the peers of one network must run "
                "the same task and config"
            )

    async def _read_model(self, request: web.Request) -> bytes:
        """The body, read up to the size limit. A model of a peer that runs another task is
        refused for its spec hash, even when it is also too large: that says what is wrong."""
        buf = bytearray()
        while chunk := await request.content.read(1 << 16):
            buf += chunk
            if len(buf) > self.max_bytes:
                self._check_spec_hash(buf)
                raise _BodyTooLarge(f"body over the limit of {self.max_bytes} bytes")
        self._check_spec_hash(buf)
        return bytes(buf)

    async def handle_gossip(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_model(request)
            msg = self._decode(body, self.node.id, reply=False)
        except WireError as e:
            self.rejected += 1
            log.warning("refused a model: %s", e)
            return _error(413 if isinstance(e, _BodyTooLarge) else 400, e.code, str(e))
        if msg.sender == self.node.id:
            return _error(400, "malformed", "a peer does not gossip with itself")
        async with self._lock:
            answer = self.node.on_push(msg, asyncio.get_running_loop().time())
        body = self._encode(answer)
        self.bytes_sent += len(body)
        return web.Response(body=body, content_type="application/octet-stream")

    # --- group averaging: POST /group carries one slice message ------------------------------

    def _current_step(self) -> int:
        """The exchange step the wall clock is in: rounds are slots of ``gossip.period`` seconds
        from the epoch, so peers that share a clock and a config agree on the round."""
        return math.floor(time.time() / self.g.period) * self.g.exchanges_per_round

    async def handle_group(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_model(request)
            msg = decode_slice(body, self.spec, self.max_bytes)
        except WireError as e:
            self.rejected += 1
            log.warning("refused a slice: %s", e)
            return _error(413 if isinstance(e, _BodyTooLarge) else 400, e.code, str(e))
        if msg.target != self.node.id or msg.sender == self.node.id:
            return _error(400, "malformed", f"slice for {msg.target!r} from {msg.sender!r} sent to {self.node.id}")
        now = asyncio.get_running_loop().time()
        m = self.node.membership
        m.seen(msg.sender, now)
        for member in msg.members:
            m.learn(member, now)
        ex = self.exchanges.get(msg.round)
        if ex is None:
            cur, span = self._current_step(), 2 * self.g.exchanges_per_round
            held = sum(map(len, self._early.values()))
            if not cur - span <= msg.round <= cur + span or held >= MAX_EARLY:
                return _error(409, "stale_round", f"round {msg.round} is not open here (now {cur})")
            self._early.setdefault(msg.round, []).append(msg)
            return web.json_response({"ok": True, "held": True})
        try:
            out = ex.on_message(msg, now)
        except Refusal as e:
            self.group_stats["refused"] += 1
            return _error(409, e.code, str(e))
        self._dispatch(ex, out)
        self._wake.set()
        return web.json_response({"ok": True})

    def _dispatch(self, ex: GridAverage | SecureGroup, msgs: list) -> None:
        for msg in msgs:
            task = asyncio.get_running_loop().create_task(self._send_msg(ex, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send_msg(self, ex: GridAverage | SecureGroup, msg: SliceMessage | SecureMessage) -> None:
        """POST a group message (a slice to /group, a secure group message to /secure); a member
        that cannot be reached or refuses is gone for this exchange (and a connection failure
        counts against it in the membership)."""
        if isinstance(msg, SliceMessage):
            path, body = "/group", encode_slice(msg, self.spec)
        else:
            path, body = "/secure", encode_secure(msg, self.spec)
        try:
            await self._post(msg.target.rstrip("/") + path, body, "application/octet-stream")
            return
        except Refused as e:  # alive, but it will not take it (another group, a closed round, a bad body)
            (log.warning if e.code == "spec_mismatch" else log.info)("%s refused a message: %s", msg.target, e)
            self.node.membership.seen(msg.target, asyncio.get_running_loop().time())
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            log.info("%s to %s failed: %s", path, msg.target, e)
            if self.node.membership.on_failure(msg.target, asyncio.get_running_loop().time()):
                log.info("%s: removed %s after repeated failures", self.node.id, msg.target)
        self._dispatch(ex, ex.on_unreachable(msg.target, asyncio.get_running_loop().time()))
        self._wake.set()

    async def group_exchange(self, step: int, weight: float, until: float | None = None) -> float:
        """One group-averaging exchange (p2p/group_average.py) with the groups of ``step`` laid out
        over our directory; returns the weight behind the averaged model. ``until`` (loop time):
        the exchange ends then even if some members never answered (the slices that did not come
        keep our own values), so that a slot's exchange never spills into the next slot and the
        peers stay in step; the object stays to answer late repair requests."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        me = self.node.id
        path = grid_path(
            self.node.membership.directory(), me, step, self.g.group_size, self.g.group_levels, self.cfg.simulation.seed
        )
        for old in [k for k in self._early if k < step]:
            del self._early[old]
        if all(len(grp) < 2 for grp in path):
            self.group_stats["alone"] += 1
            return weight
        ex = GridAverage(me, path, step, self.node.params, weight, now, self.g.timeout)
        self.exchanges[step] = ex
        for old in sorted(self.exchanges)[:-KEEP_EXCHANGES]:
            del self.exchanges[old]
        self._dispatch(ex, ex.start())
        for msg in self._early.pop(step, []):
            try:
                self._dispatch(ex, ex.on_message(msg, now))
            except Refusal:
                self.group_stats["refused"] += 1
        while True:
            self._wake.clear()
            self._dispatch(ex, ex.tick(loop.time()))
            if ex.done or (until is not None and loop.time() >= until):
                break
            deadline = ex.next_deadline()
            wait = self.g.timeout if deadline is None else max(0.0, deadline - loop.time())
            if until is not None:
                wait = min(wait, max(0.0, until - loop.time()))
            try:
                await asyncio.wait_for(self._wake.wait(), wait + 1e-3)
            except TimeoutError:
                pass
        res = ex.result()
        async with self._lock:
            self.node.params.copy_(res.values)
            self.node.version += 1
            self.node.merges += 1
        self.group_stats["exchanges"] += 1
        self.group_stats["incomplete"] += int(not res.complete)
        self.group_stats["repaired_slices"] += res.repaired
        return res.weight

    # --- secure groups: POST /secure carries one secure aggregation message of a group ------------

    async def handle_secure(self, request: web.Request) -> web.Response:
        try:
            msg = decode_secure(await self._read_model(request), self.spec, self.max_bytes)
        except WireError as e:
            self.rejected += 1
            log.warning("refused a secure group message: %s", e)
            return _error(413 if isinstance(e, _BodyTooLarge) else 400, e.code, str(e))
        if msg.target != self.node.id or msg.sender == self.node.id:
            return _error(400, "malformed", f"message for {msg.target!r} from {msg.sender!r} sent to {self.node.id}")
        now = asyncio.get_running_loop().time()
        self.node.membership.seen(msg.sender, now)
        for member in msg.members:
            self.node.membership.learn(member, now)
        sg = self.secure.get(msg.round)
        if sg is None:
            cur, span = self._current_step(), 2 * self.g.exchanges_per_round
            held = sum(map(len, self._early_secure.values()))
            if not cur - span <= msg.round <= cur + span or held >= MAX_EARLY:
                return _error(409, "stale_round", f"round {msg.round} is not open here (now {cur})")
            self._early_secure.setdefault(msg.round, []).append(msg)
            return web.json_response({"ok": True, "held": True})
        try:
            out = sg.on_message(msg, now)
        except Refusal as e:
            return _error(409, e.code, str(e))
        self._dispatch(sg, out)
        self._wake.set()
        return web.json_response({"ok": True})

    async def secure_exchange(self, step: int, until: float) -> None:
        """One secure group average (p2p/secure_group.py) in our group of ``step`` (one grid axis),
        the first member relaying; each stage waits at most min(timeout, period / 10); the group's
        average offset from the initial model replaces ours, an aborted group keeps its models."""
        loop = asyncio.get_running_loop()
        g, sa = self.g, self.cfg.secure_aggregation
        members = grid_path(
            self.node.membership.directory(), self.node.id, step, g.group_size, 1, self.cfg.simulation.seed
        )[0]
        for old in [k for k in self._early_secure if k < step]:
            del self._early_secure[old]
        if len(members) < 2:
            self.secure_stats["alone"] += 1
            return
        now = loop.time()
        sg = SecureGroup(
            self.node.id,
            members,
            step,
            self.node.params - self.init,
            num_examples(self.data.train),
            now,
            min(g.timeout, g.period / 10),
            sa.clip,
            sa.bits,
            sa.threshold,
        )
        self.secure[step] = sg
        for old in sorted(self.secure)[:-KEEP_EXCHANGES]:
            del self.secure[old]
        self.secure_stats["groups"] += 1
        self._dispatch(sg, sg.start())
        for msg in self._early_secure.pop(step, []):
            try:
                self._dispatch(sg, sg.on_message(msg, now))
            except Refusal:
                pass
        while True:
            self._wake.clear()
            self._dispatch(sg, sg.tick(loop.time()))
            if sg.done or loop.time() >= until:
                break
            deadline = sg.next_deadline()
            wait = min(until, deadline if deadline is not None else until) - loop.time()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, wait) + 1e-3)
            except TimeoutError:
                pass
        res = sg.result()
        if res.mean is None:
            self.secure_stats["aborted"] += 1
            log.info("secure group of step %d: no average (%s)", step, res.reason or "out of time")
            return
        async with self._lock:
            self.node.params.copy_(self.init + res.mean.to(self.init.device))
            self.node.version += 1
            self.node.merges += 1
        self.secure_stats["averaged"] += 1

    # --- D-PSGD: POST /dpsgd carries a node's model for one mixing step; the answer is ours ----

    def _mix_body(self, msg: MixMessage) -> bytes:
        extra = {"age": self.node.age, "num_examples": self.node.num_examples, "sender": msg.sender, "step": msg.step}
        self._sent += 1
        seed = derive_seed(self.cfg.simulation.seed, zlib.crc32(self.node.id.encode()), self._sent)
        return encode_gossip_model(msg.params, self.spec, self.node.version, extra, self.cfg.compression, seed)

    def _mix_message(self, body: bytes, reply: bool) -> MixMessage:
        params, header = decode_gossip_model(body, self.spec, self.max_bytes)
        return MixMessage(
            _check_id(header.get("sender"), "sender"), self.node.id, _check_int(header, "step", 0), params, reply
        )

    async def handle_dpsgd(self, request: web.Request) -> web.Response:
        try:
            msg = self._mix_message(await self._read_model(request), reply=False)
        except WireError as e:
            self.rejected += 1
            log.warning("refused a model: %s", e)
            return _error(413 if isinstance(e, _BodyTooLarge) else 400, e.code, str(e))
        loop = asyncio.get_running_loop()
        st = self.mixing.get(msg.step)
        if st is None:  # the sender is ahead of us (it trained faster): wait for our step, briefly
            cur, m = self._current_step(), self.g.exchanges_per_round
            if not cur <= msg.step <= cur + 2 * m or len(self._step_open) > 8:
                return _error(409, "stale_round", f"step {msg.step} is not open here (now {cur})")
            opened = self._step_open.setdefault(msg.step, asyncio.Event())
            try:
                await asyncio.wait_for(opened.wait(), 0.8 * self.g.period)
            except TimeoutError:
                pass
            st = self.mixing.get(msg.step)
            if st is None:
                return _error(409, "stale_round", f"step {msg.step} did not open here in time")
        try:
            answer = st.on_request(msg, loop.time())
        except Refusal as e:
            self.dpsgd_stats["refused"] += 1
            return _error(409, e.code, str(e))
        self.node.membership.seen(msg.sender, loop.time())
        body = self._mix_body(answer)
        self.bytes_sent += len(body)
        return web.Response(body=body, content_type="application/octet-stream")

    async def _mix_with(self, st: DpsgdStep, msg: MixMessage) -> None:
        loop = asyncio.get_running_loop()
        try:
            data = await self._post(msg.target.rstrip("/") + "/dpsgd", self._mix_body(msg), "application/octet-stream")
            st.on_reply(self._mix_message(data, reply=True), loop.time())
            self.node.membership.on_success(msg.target, loop.time())
        except Refused as e:  # busy, closed, another step: alive, no edge this step
            (log.warning if e.code == "spec_mismatch" else log.debug)("%s refused to mix: %s", msg.target, e)
            st.on_unreachable(msg.target, loop.time())
        except (TimeoutError, aiohttp.ClientError, OSError, ShoalError) as e:
            log.info("mixing with %s failed: %s", msg.target, e)
            st.on_unreachable(msg.target, loop.time())
            if self.node.membership.on_failure(msg.target, loop.time()):
                log.info("%s: removed %s after repeated failures", self.node.id, msg.target)

    async def dpsgd_step(self, step: int, until: float) -> None:
        """One D-PSGD mixing step (p2p/dpsgd.py DpsgdStep) with partners from our view, open to
        requests until ``until`` (loop time); then mix what we exchanged."""
        loop = asyncio.get_running_loop()
        m = self.node.membership
        partners: list[str] = []
        pool = [p for p in m.peers() if p not in m.suspected()] or m.peers()
        rng = derive_seed(self.cfg.simulation.seed, zlib.crc32(self.node.id.encode()), step)
        order = sorted(pool, key=lambda p: zlib.crc32(f"{rng}/{p}".encode()))
        partners = order[: max(1, self.g.degree // 2)]
        st = DpsgdStep(self.node.id, step, self.node.params, partners, self.g.degree, until)
        self.mixing[step] = st
        for old in sorted(self.mixing)[:-KEEP_EXCHANGES]:
            del self.mixing[old]
        self._step_open.setdefault(step, asyncio.Event()).set()
        for old in [k for k in self._step_open if k < step]:
            del self._step_open[old]
        await asyncio.gather(*[self._mix_with(st, msg) for msg in st.start()])
        await asyncio.sleep(max(0.0, until - loop.time()))  # others may still ask us
        st.tick(loop.time())
        mixed = st.result()
        async with self._lock:
            self.node.params.copy_(mixed)
            self.node.version += 1
            self.node.merges += 1
        self.dpsgd_stats["steps"] += 1
        self.dpsgd_stats["neighbours"] += len(st.neighbours)

    async def handle_shuffle(self, request: web.Request) -> web.Response:
        try:
            req = self._parse_shuffle(await request.read(), ShuffleRequest)
        except web.HTTPRequestEntityTooLarge:
            return _error(413, "too_large", f"body over the limit of {self.max_bytes} bytes")
        except WireError as e:
            return _error(400, e.code, str(e))
        async with self._lock:
            resp = self.node.membership.on_shuffle_request(req, asyncio.get_running_loop().time())
        body = json.dumps({"sender": resp.sender, "entries": resp.entries}).encode()
        self.bytes_sent += len(body)
        return web.Response(body=body, content_type="application/json")

    def _parse_shuffle(self, body: bytes, kind: type[_Shuffle]) -> _Shuffle:
        if len(body) > MAX_SHUFFLE_BYTES:
            raise Malformed(f"shuffle body of {len(body)} bytes is over {MAX_SHUFFLE_BYTES}")
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise Malformed(f"shuffle body is not JSON: {e}") from None
        if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
            raise Malformed("shuffle body must be {'sender': URL, 'entries': [[URL, age], ...]}")
        sender = _check_id(data.get("sender"), "sender")
        entries = []
        for item in data["entries"][: self.g.view_size]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int) and item[1] >= 0):
                raise Malformed("each shuffle entry must be [URL, age >= 0]")
            entries.append((_check_id(item[0], "entry"), int(item[1])))
        return kind(sender, self.node.id, tuple(entries))

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    def status(self) -> dict[str, Any]:
        n = self.node
        return {
            "id": n.id,
            "task": task_name(self.trainer.task),
            "spec_hash": self.spec.hash,
            "steps": self.steps,
            "age": n.age,
            "version": n.version,
            "merges": n.merges,
            "metrics": json_safe(self.last_eval),
            "view": n.membership.peers(),
            "suspected": sorted(n.membership.suspected()),
            "bytes_sent": self.bytes_sent,
            "rejected": self.rejected,
            "bounded": n.bounded,
            "algorithm": self.g.algorithm,
            "directory": len(n.membership.known),
            **({"group": dict(self.group_stats)} if self.g.algorithm == "group_average" else {}),
            **({"dpsgd": dict(self.dpsgd_stats)} if self.g.algorithm == "dpsgd" else {}),
            **({"secure": dict(self.secure_stats)} if self.g.algorithm == "secure_groups" else {}),
        }

    # --- the outgoing side ------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.s.token}"} if self.s.token else {}

    async def _post(self, url: str, body: bytes, content_type: str) -> bytes:
        assert self._session is not None
        self.bytes_sent += len(body)
        async with self._session.post(
            url,
            data=body,
            headers={**self._headers(), "Content-Type": content_type},
            ssl=True if self.s.ssl_client is None else self.s.ssl_client,  # True: aiohttp's default checks
        ) as r:
            data = await r.read()
            if r.status != 200:
                raise _refusal(r.status, data)
            return data

    async def exchange(self) -> None:
        now = asyncio.get_running_loop().time()
        async with self._lock:
            msg = self.node.start_exchange(now)
        if msg is None:
            return
        try:
            data = await self._post(msg.target.rstrip("/") + "/gossip", self._encode(msg), "application/octet-stream")
            answer = self._decode(data, self.node.id, reply=True)
        except (TimeoutError, aiohttp.ClientError, OSError, ShoalError) as e:
            if isinstance(e, Refused) and e.code == "spec_mismatch":
                log.warning("%s refused our model: %s", msg.target, e.detail)
            else:
                log.info("exchange with %s failed: %s", msg.target, e)
            async with self._lock:
                self.node.on_failure(msg.target, asyncio.get_running_loop().time())
            return
        async with self._lock:
            self.node.on_reply(answer, asyncio.get_running_loop().time())

    async def shuffle(self) -> None:
        m = self.node.membership
        now = asyncio.get_running_loop().time()
        async with self._lock:
            m.expire(now)
            req = m.start_shuffle(now)
        if req is None:
            return
        body = json.dumps({"sender": req.sender, "entries": req.entries}).encode()
        try:
            data = await self._post(req.target.rstrip("/") + "/shuffle", body, "application/json")
            resp = self._parse_shuffle(data, ShuffleResponse)
        except (TimeoutError, aiohttp.ClientError, OSError, ShoalError) as e:
            log.info("shuffle with %s failed: %s", req.target, e)
            async with self._lock:
                m.on_failure(req.target, asyncio.get_running_loop().time())
            return
        async with self._lock:
            m.on_shuffle_response(resp, asyncio.get_running_loop().time())

    async def local_step(self) -> None:
        async with self._lock:
            seed = derive_seed(self.cfg.simulation.seed, self.steps, zlib.crc32(self.node.id.encode()))
            update = self.trainer.fit(self.node.params, self.data.train, seed)
            self.train_loss = update.metrics.get("train_loss")
            self.node.local_update(self.trainer.flat)
            self.steps += 1

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

    async def evaluate(self) -> None:
        """Evaluate the current model; one metrics record (with age, view size, bytes sent)."""
        async with self._lock:
            self.last_eval = self.evaluation()
        if self.metrics:
            self.metrics.write(
                {
                    "round": self.steps,
                    **self.last_eval,
                    "train_loss": self.train_loss,
                    "age": self.node.age,
                    "merges": self.node.merges,
                    "view_size": len(self.node.membership.view),
                    "bytes_sent": self.bytes_sent,
                    "bytes_sent_per_round": self.bytes_sent / max(self.steps, 1),
                    "rejected": self.rejected,
                    "algorithm": self.g.algorithm,
                    "directory": len(self.node.membership.known),
                    **(
                        {f"group_{k}": v for k, v in self.group_stats.items()}
                        if self.g.algorithm == "group_average"
                        else {}
                    ),
                    **({f"dpsgd_{k}": v for k, v in self.dpsgd_stats.items()} if self.g.algorithm == "dpsgd" else {}),
                    **(
                        {f"secure_{k}": v for k, v in self.secure_stats.items()}
                        if self.g.algorithm == "secure_groups"
                        else {}
                    ),
                }
            )

    async def run(self, host: str, port: int, stop: asyncio.Event) -> None:
        """Serve on host:port and gossip every ``period`` seconds until ``stop`` is set
        (or ``gossip.rounds`` local steps are done)."""
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=self.s.ssl_server)
        await site.start()
        timeout = aiohttp.ClientTimeout(total=self.g.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout)
        log.info(
            "peer %s listening on %s:%d, bootstrap %s, %s",
            self.node.id,
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
            for task in list(self._tasks):
                task.cancel()
            await self._session.close()
            await runner.cleanup()

    async def _step_done(self) -> bool:
        """Evaluate when due; True when ``gossip.rounds`` local steps are done."""
        last = bool(self.g.rounds) and self.steps >= self.g.rounds
        if last or self.steps % self.cfg.simulation.eval_every == 0:
            await self.evaluate()
        return last

    async def _run_push_pull(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.local_step()
            await asyncio.gather(self.exchange(), self.shuffle())
            last = await self._step_done()
            async with self._lock:
                self.node.expire(asyncio.get_running_loop().time())
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
            shuffle = asyncio.get_running_loop().create_task(self.shuffle())  # never holds up the slot
            self._tasks.add(shuffle)
            shuffle.add_done_callback(self._tasks.discard)
            await self.local_step()
            weight = float(num_examples(self.data.train)) if g.group_weights == "examples" else 1.0
            m = g.exchanges_per_round
            for k in range(m):
                # exchange k ends by 0.8 (k + 1) / m of the slot, on the wall clock
                end = asyncio.get_running_loop().time() + (slot + 0.8 * (k + 1) / m) * g.period - time.time()
                if g.algorithm == "group_average":
                    weight = await self.group_exchange(slot * m + k, weight, end)
                elif g.algorithm == "secure_groups":
                    await self.secure_exchange(slot * m + k, end)
                else:
                    await self.dpsgd_step(slot * m + k, end)
            if await self._step_done():
                break
