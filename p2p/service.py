"""One gossip peer's protocol state, without I/O: bodies and time in, bodies and decisions out.

The aiohttp transport (p2p/peer.py) turns each request into one call here and answers what
it returns (or the :class:`Rejected` it raises: a 4xx with a JSON body); it POSTs the
messages the calls hand out and reports answers and failures back. No sockets, no clock,
no sleeps: ``now`` (monotonic seconds) and the wall clock's exchange step are passed in,
so a test drives a peer through any sequence of messages without a network.

What it holds: the model (GossipNode, with the merge bound of p2p/merge.py), the Cyclon
membership and the address policy (p2p/addresses.py), the open exchanges of the
synchronous algorithms (GridAverage, DpsgdStep, SecureGroup) and the messages held for an
exchange about to open. Every body is parsed by p2p/messages.py first; a message that
fails a check raises before anything here changes, so bad input moves no state and no
counter but ``rejected``.

Held messages. A group or secure group message for an exchange this peer has not opened
yet is held only when the peer runs that algorithm, the round is the current wall-clock
slot's or the next one's, the message is addressed to us and names us among its members;
at most ``max_held`` are held (and their bytes bounded by the body limit each), and they
go when their round opens or passes.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from shoal.config import Config
from shoal.errors import ShoalError, SpecMismatch, TooLarge, WireError
from shoal.params import ParamSpec
from shoal.seeding import derive_seed
from shoal.wire import default_max_bytes

from .addresses import AddressPolicy
from .dpsgd import DpsgdStep, MixMessage
from .freshness import Freshness, Stale
from .gossip import GossipNode, ModelMessage, bump
from .grid_average import GridAverage, grid_path
from .group_average import Refusal, SliceMessage
from .identity import sender_matches
from .membership import Membership, ShuffleRequest, ShuffleResponse
from .merge import MergeRule
from .messages import Limits, Refused, parse_mix, parse_model, parse_secure, parse_shuffle, parse_slice, peek_spec_hash
from .model_wire import encode_gossip_model, encode_secure, encode_slice
from .robust import make_merge_bound
from .secure_group import SecureGroup, SecureMessage

log = logging.getLogger(__name__)

MAX_HELD = 64  # group / secure group messages held for an exchange about to open
KEEP_EXCHANGES = 8  # finished exchanges kept to answer late repair requests
MAX_KNOWN = 1024  # the directory's bound (peers heard of)
FORGET_AFTER = 20.0  # seconds (at least 10 periods) before the directory forgets a peer no one vouched for
LOGGED_REFUSALS = 20  # refusals logged one by one; after that one in a thousand
PATHS = {"gossip": "/gossip", "shuffle": "/shuffle", "group": "/group", "secure": "/secure", "dpsgd": "/dpsgd"}


# what PeerService.parse gives: a typed message, or the WireError that refuses the body
Parsed = ModelMessage | MixMessage | SliceMessage | SecureMessage | ShuffleRequest | WireError


class Rejected(ShoalError):
    """A request this peer will not take: answered ``status`` with ``{"error": code, "detail": ...}``."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(detail)
        self.status, self.code, self.detail = status, code, detail


@dataclass(frozen=True)
class Outgoing:
    """A body for the transport to POST to ``url`` (a peer's URL plus the route)."""

    url: str
    body: bytes
    content_type: str = "application/octet-stream"


def _status(e: WireError) -> int:
    return 413 if isinstance(e, TooLarge) else 400


class PeerService:
    """The protocol side of one peer (see the module docstring)."""

    def __init__(
        self,
        cfg: Config,
        spec: ParamSpec,
        params: torch.Tensor,
        num_examples: int,
        me: str,
        bootstrap: tuple[str, ...] = (),
        insecure: bool = False,
        wall_offset: float = 0.0,
        certified: bool = False,
    ):
        g = cfg.gossip
        self.cfg, self.g, self.spec = cfg, g, spec
        self.max_bytes = default_max_bytes(spec) + 64 * len(spec.entries)
        self.limits = Limits(spec, self.max_bytes, insecure, g.max_abs, g.view_size)
        seed = derive_seed(cfg.simulation.seed, zlib.crc32(me.encode()))
        membership = Membership(
            me,
            g.view_size,
            g.shuffle_length,
            g.timeout,
            g.max_failures,
            quarantine=max(30.0, 10 * g.period),
            seed=seed,
            bootstrap_peers=bootstrap,
            max_known=MAX_KNOWN,
            forget_after=max(FORGET_AFTER, 10 * g.period),
            period=g.period,
            samplers=g.samplers,
            push_share=g.push_share,
            pull_share=g.pull_share,
        )  # the history samplers' keys come from the OS (Membership's default)
        self.policy = AddressPolicy((me, *bootstrap), g.allow_networks, interval=g.period, burst=g.view_size)
        rule = MergeRule(g.merge, g.staleness_exponent, g.max_age_gap, cfg.robust.norm_bound, g.bound_mode)
        self.node = GossipNode(membership, params, num_examples, rule, g.timeout, make_merge_bound(cfg))
        self.node.wall_offset = wall_offset  # the transport's wall clock minus its ``now``
        self.shuffle_fresh = Freshness()  # shuffle requests taken (model pushes: the node's own table)
        self.mix_fresh = Freshness()  # D-PSGD requests taken
        self.init = params.clone()  # secure groups mask the offset from the shared initial model
        self.rejected = 0
        # with a peer certificate and a CA: every message's sender is bound to the caller's client
        # certificate (p2p/identity.py); without: the sender is what the message says
        self.certified = certified
        self.bytes_sent = 0
        self._sent = 0  # messages encoded: seeds q8's stochastic rounding
        self.exchanges: dict[int, GridAverage] = {}
        self.mixing: dict[int, DpsgdStep] = {}
        self.secure: dict[int, SecureGroup] = {}
        self.held: dict[int, list[SliceMessage | SecureMessage]] = {}
        self.group_stats = {"exchanges": 0, "incomplete": 0, "repaired_slices": 0, "refused": 0, "alone": 0}
        self.dpsgd_stats = {"steps": 0, "neighbours": 0, "refused": 0}
        self.secure_stats = {"groups": 0, "averaged": 0, "aborted": 0, "alone": 0}

    @property
    def id(self) -> str:
        return self.node.id

    # --- checks every incoming body passes ------------------------------------------------------

    def check_spec_hash(self, body: bytes | bytearray) -> None:
        """A message of a peer that runs another task is refused for its spec hash, even when it is
        also too large or broken: that says what is wrong."""
        theirs = peek_spec_hash(body)
        if theirs is not None and theirs != self.spec.hash:
            self.rejected += 1
            detail = self._spec_detail(theirs)
            if self._loud():
                log.warning("refused a model: %s", detail)
            raise Rejected(400, SpecMismatch.code, detail)

    def _spec_detail(self, theirs: str) -> str:
        return (
            f"the model sent has spec hash {theirs[:80]!r}, this peer's model {self.spec.hash!r}: another "
            "task, [task.args] or architecture; the peers of one network must run the same task and config"
        )

    def parse(self, kind: str, body: bytes) -> Parsed:
        """The typed message of a ``POST /<kind>`` body, or the WireError that refuses it (returned,
        not raised). Pure: it reads only this peer's limits and writes nothing, so the transport
        may run it off its event loop for a large body; the header's JSON is parsed once (a
        refused body's spec hash is read again, to say when it is another task's)."""
        try:
            if kind == "gossip":
                return parse_model(body, self.limits, self.id, reply=False)
            if kind == "dpsgd":
                return parse_mix(body, self.limits, self.id, reply=False)
            if kind == "group":
                return parse_slice(body, self.limits)
            if kind == "secure":
                return parse_secure(body, self.limits)
            if kind == "shuffle":
                return parse_shuffle(body, self.limits, ShuffleRequest, self.id)
        except WireError as e:
            theirs = peek_spec_hash(body) if kind != "shuffle" else None
            if theirs is not None and theirs != self.spec.hash:
                return SpecMismatch(self._spec_detail(theirs))
            return e
        raise ValueError(f"no message kind {kind!r}")

    def _take(self, parsed: bytes | Parsed, kind: str, what: str, identity: frozenset[str] | None) -> Any:
        """The message of a body (parsed here unless the transport parsed it already), its sender
        checked against the caller's certificate; raises Rejected (nothing changed) otherwise."""
        if isinstance(parsed, bytes | bytearray):
            parsed = self.parse(kind, bytes(parsed))
        if isinstance(parsed, SpecMismatch):
            self.rejected += 1
            if self._loud():
                log.warning("refused %s: %s", what, parsed)
            raise Rejected(400, SpecMismatch.code, str(parsed))
        if isinstance(parsed, WireError):
            raise self.refuse(parsed, what)
        self.check_sender(parsed.sender, identity)
        return parsed

    def check_sender(self, sender: str, identity: frozenset[str] | None) -> None:
        """With certificates (``certified``): ``sender`` must be a host of the caller's client
        certificate (``identity``: its subjectAltName hosts; None when it presented none)."""
        if not self.certified:
            return
        if identity is None:
            self.rejected += 1
            raise Rejected(
                403,
                "client_certificate_required",
                "this peer takes messages only from peers with a client certificate of its CA (shoal pki peer-cert)",
            )
        if not sender_matches(sender, identity):
            self.rejected += 1
            if self._loud():
                log.warning("refused a message from %s: its certificate names %s", sender, sorted(identity)[:4])
            raise Rejected(
                403,
                "sender_mismatch",
                f"the message names sender {sender[:100]!r}, which the caller's client certificate does not cover",
            )

    def _loud(self) -> bool:
        """Whether this refusal is logged: the first LOGGED_REFUSALS, then one in a thousand
        (a flood of hostile messages must not fill the disk with log lines)."""
        return self.rejected <= LOGGED_REFUSALS or self.rejected % 1000 == 0

    def refuse(self, e: WireError, what: str) -> Rejected:
        self.rejected += 1
        if self._loud():
            log.info("refused %s (%d refused so far): %s", what, self.rejected, e)
        return Rejected(_status(e), e.code, str(e))

    def stale(self, e: Stale, what: str) -> Rejected:
        """A replayed, older or expired message: 409 (replayed) or 400 (expired), nothing moved."""
        self.rejected += 1
        if self._loud():
            log.info("refused %s (%d refused so far): %s", what, self.rejected, e)
        return Rejected(e.status, e.code, str(e))

    def wall(self, now: float) -> float:
        return now + self.node.wall_offset

    def _fresh(self, table: Freshness, sender: str, seq: int, now: float, what: str) -> None:
        """Raise Rejected unless ``seq`` is ``sender``'s next fresh counter (the caller takes it once accepted)."""
        try:
            table.check(sender, seq, self.wall(now))
        except Stale as e:
            raise self.stale(e, what) from None

    def _not_self(self, sender: str) -> None:
        if sender == self.id:
            self.rejected += 1
            raise Rejected(400, "malformed", "a peer does not exchange with itself")

    def _running(self, algorithm: str) -> None:
        if self.g.algorithm != algorithm:
            self.rejected += 1
            raise Rejected(409, "not_running", f"this peer runs gossip.algorithm = {self.g.algorithm!r}")

    # --- push-pull gossip -------------------------------------------------------------------------

    def encode_model(self, msg: ModelMessage) -> bytes:
        extra = {"age": msg.age, "num_examples": msg.num_examples, "sender": msg.sender, "seq": msg.seq}
        self._sent = bump(self._sent)
        seed = derive_seed(self.cfg.simulation.seed, zlib.crc32(self.id.encode()), self._sent)
        body = encode_gossip_model(msg.params, self.spec, msg.version, extra, self.cfg.compression, seed)
        self.bytes_sent += len(body)
        return body

    def on_gossip(self, body: bytes | Parsed, now: float, identity: frozenset[str] | None = None) -> bytes:
        """``POST /gossip``: answer with our pre-merge model, then merge theirs (through the bound)."""
        self._running("gossip")
        msg: ModelMessage = self._take(body, "gossip", "a model", identity)
        self._not_self(msg.sender)
        try:
            answer = self.node.on_push(msg, now)
        except Stale as e:
            raise self.stale(e, "a model") from None
        return self.encode_model(answer)

    def start_exchange(self, now: float) -> Outgoing | None:
        msg = self.node.start_exchange(now)
        if msg is None:
            return None
        if not self.policy.may_contact(msg.target, now):
            self._not_contacted(msg.target, now)
            return None
        return Outgoing(msg.target + PATHS["gossip"], self.encode_model(msg))

    def on_exchange_reply(self, target: str, body: bytes, now: float) -> None:
        """The answer to our push: merged if it checks out, else a failure of ``target``."""
        try:
            answer = parse_model(body, self.limits, self.id, reply=True)
        except WireError as e:
            log.info("answer of %s refused: %s", target, e)
            self.on_contact_failure(target, now)
            return
        if answer.sender != target:
            log.info("answer of %s names another sender %s", target, answer.sender)
            self.on_contact_failure(target, now)
            return
        self.policy.on_success(target)
        self.node.on_reply(answer, now)

    def _not_contacted(self, target: str, now: float) -> None:
        """A contact the address policy would not make: a kind we never contact leaves the view;
        one deferred by the rate of new contacts counts as a failed contact (an unverified address
        is dropped), so made-up addresses cannot sit in a view for good."""
        self.node.cancel(target)
        if not self.policy.allowed(target):
            self.node.membership.remove(target, now)
        else:
            self.on_contact_failure(target, now)

    def on_contact_failure(self, target: str, now: float) -> bool:
        """A contact with ``target`` failed (no answer, refused, a bad answer): a failure in the
        membership; an address only heard of (never reached) is removed at its first failure.
        Returns True when ``target`` was removed."""
        self.node.cancel(target)
        m = self.node.membership
        removed = m.on_failure(target, now)
        if not removed and target not in self.policy.verified:
            m.remove(target, now)
            removed = True
        if removed:
            self.policy.forget(target)
        return removed

    # --- Cyclon shuffles --------------------------------------------------------------------------

    def _usable(self, entries: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int], ...]:
        """Entries of kinds this peer may contact; the others are dropped (not an error: another
        network's addresses are well formed, just not ours)."""
        return tuple((p, a) for p, a in entries if self.policy.allowed(p))

    def on_shuffle(self, body: bytes | Parsed, now: float, identity: frozenset[str] | None = None) -> bytes:
        """``POST /shuffle``: a Cyclon shuffle request; the answer is a JSON shuffle response."""
        req: ShuffleRequest = self._take(body, "shuffle", "a shuffle", identity)
        self._not_self(req.sender)
        self._fresh(self.shuffle_fresh, req.sender, req.seq, now, "a shuffle")
        self.shuffle_fresh.take(req.sender, req.seq)
        req = ShuffleRequest(req.sender, req.target, self._usable(req.entries))
        resp = self.node.membership.on_shuffle_request(req, now)
        out = self._shuffle_body(resp.sender, resp.entries, now)
        self.bytes_sent += len(out)
        return out

    def start_shuffle(self, now: float) -> Outgoing | None:
        m = self.node.membership
        m.expire(now)
        req = m.start_shuffle(now)
        if req is None:
            return None
        if not self.policy.may_contact(req.target, now):
            m.cancel(req.target)
            self._not_contacted(req.target, now)
            return None
        body = self._shuffle_body(req.sender, req.entries, now)
        self.bytes_sent += len(body)
        return Outgoing(req.target + PATHS["shuffle"], body, "application/json")

    def _shuffle_body(self, sender: str, entries: tuple[tuple[str, int], ...], now: float) -> bytes:
        seq = self.node.counter.next(self.wall(now))
        return json.dumps({"sender": sender, "entries": [list(e) for e in entries], "seq": seq}).encode()

    def on_shuffle_reply(self, target: str, body: bytes, now: float) -> None:
        try:
            resp = parse_shuffle(body, self.limits, ShuffleResponse, self.id)
        except WireError as e:
            log.info("shuffle answer of %s refused: %s", target, e)
            self.on_contact_failure(target, now)
            return
        if resp.sender != target:
            self.on_contact_failure(target, now)
            return
        self.policy.on_success(target)
        usable = ShuffleResponse(resp.sender, resp.target, self._usable(resp.entries))
        self.node.membership.on_shuffle_response(usable, now)

    # --- group averaging and secure groups: messages for open rounds ----------------------------

    def _hold(self, msg: SliceMessage | SecureMessage, wall_step: int) -> None:
        m = self.g.exchanges_per_round
        self.held = {r: v for r, v in self.held.items() if r >= wall_step}  # expiry: rounds gone by
        if not wall_step <= msg.round < wall_step + 2 * m:
            raise Rejected(409, "stale_round", f"round {msg.round} is not open here (now {wall_step})")
        if self.id not in msg.members or msg.sender not in msg.members:
            self.rejected += 1
            raise Rejected(400, "malformed", "the message's members do not name both its sender and this peer")
        if sum(map(len, self.held.values())) >= MAX_HELD:
            raise Rejected(503, "busy", f"{MAX_HELD} messages already held for rounds about to open")
        self.held.setdefault(msg.round, []).append(msg)

    def _learn(self, msg: SliceMessage | SecureMessage, now: float) -> None:
        """A message an open exchange took: its sender is alive, its members go into the directory."""
        m = self.node.membership
        m.seen(msg.sender, now)
        for member in msg.members:
            if self.policy.allowed(member):
                m.learn(member, now)

    def on_group(
        self, body: bytes | Parsed, now: float, wall_step: int, identity: frozenset[str] | None = None
    ) -> tuple[GridAverage | None, list[SliceMessage]]:
        """``POST /group``: a slice for an open exchange (its answers returned), or held for one about to open."""
        self._running("group_average")
        msg: SliceMessage = self._take(body, "group", "a slice", identity)
        if msg.target != self.id or msg.sender == self.id:
            self.rejected += 1
            raise Rejected(400, "malformed", f"slice for {msg.target!r} from {msg.sender!r} sent to {self.id}")
        ex = self.exchanges.get(msg.round)
        if ex is None:
            self._hold(msg, wall_step)
            return None, []
        try:
            out = ex.on_message(msg, now)
        except Refusal as e:
            self.group_stats["refused"] += 1
            raise Rejected(409, e.code, str(e)) from None
        self._learn(msg, now)
        return ex, out

    def on_secure(
        self, body: bytes | Parsed, now: float, wall_step: int, identity: frozenset[str] | None = None
    ) -> tuple[SecureGroup | None, list[SecureMessage]]:
        """``POST /secure``: a secure group message for an open group, or held for one about to open."""
        self._running("secure_groups")
        msg: SecureMessage = self._take(body, "secure", "a secure group message", identity)
        if msg.target != self.id or msg.sender == self.id:
            self.rejected += 1
            raise Rejected(400, "malformed", f"message for {msg.target!r} from {msg.sender!r} sent to {self.id}")
        sg = self.secure.get(msg.round)
        if sg is None:
            self._hold(msg, wall_step)
            return None, []
        try:
            out = sg.on_message(msg, now)
        except Refusal as e:
            raise Rejected(409, e.code, str(e)) from None
        self._learn(msg, now)
        return sg, out

    def encode_group_message(self, msg: SliceMessage | SecureMessage) -> Outgoing:
        if isinstance(msg, SliceMessage):
            out = Outgoing(msg.target + PATHS["group"], encode_slice(msg, self.spec))
        else:
            out = Outgoing(msg.target + PATHS["secure"], encode_secure(msg, self.spec))
        self.bytes_sent += len(out.body)
        return out

    def open_group(
        self, step: int, weight: float, now: float, until: float
    ) -> tuple[GridAverage | None, list[SliceMessage]]:
        """Open the group averaging exchange of ``step`` over our directory (None when alone)."""
        g, directory = self.g, self.node.membership.directory()
        path = grid_path(directory, self.id, step, g.group_size, g.group_levels, self.cfg.simulation.seed)
        if all(len(grp) < 2 for grp in path):
            self.group_stats["alone"] += 1
            self.held.pop(step, None)
            return None, []
        ex = GridAverage(self.id, path, step, self.node.params, weight, now, self.g.timeout, self.node.merge_bound)
        self.exchanges[step] = ex
        for old in sorted(self.exchanges)[:-KEEP_EXCHANGES]:
            del self.exchanges[old]
        out = ex.start()
        for msg in self.held.pop(step, []):
            try:
                out += ex.on_message(msg, now)  # type: ignore[arg-type]
                self._learn(msg, now)
            except Refusal:
                self.group_stats["refused"] += 1
        return ex, out

    def finish_group(self, ex: GridAverage) -> float:
        """Adopt the exchange's average (through the merge bound); returns the weight behind it."""
        res = ex.result()
        self.node.adopt(res.values)
        self.group_stats["exchanges"] += 1
        self.group_stats["incomplete"] += int(not res.complete)
        self.group_stats["repaired_slices"] += res.repaired
        return res.weight

    def open_secure(self, step: int, num_examples: int, now: float) -> tuple[SecureGroup | None, list[SecureMessage]]:
        g, sa = self.g, self.cfg.secure_aggregation
        directory = self.node.membership.directory()
        members = grid_path(directory, self.id, step, g.group_size, 1, self.cfg.simulation.seed)[0]
        if len(members) < 2:
            self.secure_stats["alone"] += 1
            self.held.pop(step, None)
            return None, []
        sg = SecureGroup(
            self.id,
            members,
            step,
            self.node.params - self.init,
            num_examples,
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
        out = sg.start()
        for msg in self.held.pop(step, []):
            try:
                out += sg.on_message(msg, now)  # type: ignore[arg-type]
                self._learn(msg, now)
            except Refusal:
                pass
        return sg, out

    def finish_secure(self, sg: SecureGroup, step: int) -> None:
        res = sg.result()
        if res.mean is None:
            self.secure_stats["aborted"] += 1
            log.info("secure group of step %d: no average (%s)", step, res.reason or "out of time")
            return
        if self.node.adopt(self.init + res.mean.to(self.init.device), clip=False):  # masked: no per-member clip
            self.secure_stats["averaged"] += 1

    def tick_exchange(
        self, ex: GridAverage | SecureGroup, now: float
    ) -> tuple[list[SliceMessage] | list[SecureMessage], float | None]:
        """An open group exchange at ``now``: what to send, and when it next needs a tick."""
        return ex.tick(now), ex.next_deadline()

    def on_member_failed(
        self, ex: GridAverage | SecureGroup, target: str, error: Exception | None, now: float
    ) -> list[SliceMessage] | list[SecureMessage]:
        """A group message to ``target`` did not arrive: ``error`` None (we may not contact it
        now), a Refused (alive, but it will not take it) or a transport failure (a failure in the
        membership). Either way ``target`` is gone for this exchange; what to send now."""
        if isinstance(error, Refused):
            self.node.membership.seen(target, now)
        elif error is not None and self.on_contact_failure(target, now):
            log.info("%s: removed %s after repeated failures", self.id, target)
        return ex.on_unreachable(target, now)

    def on_mix_failed(self, st: DpsgdStep, target: str, error: Exception | None, now: float) -> None:
        """A D-PSGD partner did not answer: no edge this step; a transport failure (not a refusal)
        counts against it in the membership."""
        if error is not None and not isinstance(error, Refused):
            self.on_contact_failure(target, now)
        st.on_unreachable(target, now)

    # --- D-PSGD -------------------------------------------------------------------------------------

    def encode_mix(self, msg: MixMessage, now: float) -> bytes:
        extra = {
            "age": self.node.age,
            "num_examples": self.node.num_examples,
            "sender": msg.sender,
            "step": msg.step,
            "seq": self.node.counter.next(self.wall(now)),
        }
        self._sent = bump(self._sent)
        seed = derive_seed(self.cfg.simulation.seed, zlib.crc32(self.id.encode()), self._sent)
        body = encode_gossip_model(msg.params, self.spec, self.node.version, extra, self.cfg.compression, seed)
        self.bytes_sent += len(body)
        return body

    def parse_mix_request(
        self, body: bytes | Parsed, wall_step: int, identity: frozenset[str] | None = None
    ) -> MixMessage:
        """A ``POST /dpsgd`` body, checked; the step must be open or about to open."""
        self._running("dpsgd")
        msg: MixMessage = self._take(body, "dpsgd", "a model", identity)
        self._not_self(msg.sender)
        m = self.g.exchanges_per_round
        if msg.step not in self.mixing and not wall_step <= msg.step <= wall_step + 2 * m:
            raise Rejected(409, "stale_round", f"step {msg.step} is not open here (now {wall_step})")
        return msg

    def on_mix_request(self, msg: MixMessage, now: float) -> bytes:
        st = self.mixing.get(msg.step)
        if st is None:
            raise Rejected(409, "stale_round", f"step {msg.step} did not open here in time")
        self._fresh(self.mix_fresh, msg.sender, msg.seq, now, "a D-PSGD model")
        try:
            answer = st.on_request(msg, now)
        except Refusal as e:
            self.dpsgd_stats["refused"] += 1
            raise Rejected(409, e.code, str(e)) from None
        self.mix_fresh.take(msg.sender, msg.seq)
        self.node.membership.seen(msg.sender, now)
        return self.encode_mix(answer, now)

    def open_mix(self, step: int, until: float, now: float) -> tuple[DpsgdStep, list[Outgoing]]:
        m = self.node.membership
        pool = [p for p in m.peers() if p not in m.suspected()] or m.peers()
        rng = derive_seed(self.cfg.simulation.seed, zlib.crc32(self.id.encode()), step)
        order = sorted(pool, key=lambda p: zlib.crc32(f"{rng}/{p}".encode()))
        st = DpsgdStep(self.id, step, self.node.params, order[: max(1, self.g.degree // 2)], self.g.degree, until)
        self.mixing[step] = st
        for old in sorted(self.mixing)[:-KEEP_EXCHANGES]:
            del self.mixing[old]
        return st, [Outgoing(msg.target + PATHS["dpsgd"], self.encode_mix(msg, now)) for msg in st.start()]

    def on_mix_reply(self, st: DpsgdStep, target: str, body: bytes, now: float) -> None:
        try:
            msg = parse_mix(body, self.limits, self.id, reply=True)
        except WireError as e:
            log.info("D-PSGD answer of %s refused: %s", target, e)
            st.on_unreachable(target, now)
            return
        if msg.sender != target:
            st.on_unreachable(target, now)
            return
        st.on_reply(msg, now)
        self.policy.on_success(target)
        self.node.membership.on_success(target, now)

    def finish_mix(self, st: DpsgdStep, now: float) -> None:
        st.tick(now)
        bound = self.node.merge_bound
        before = bound.clipped + bound.refused
        mixed = st.result(bound)  # each neighbour through the merge bound (self-centered clipping)
        self.node.bounded += bound.clipped + bound.refused - before
        self.node.adopt(mixed)
        self.dpsgd_stats["steps"] += 1
        self.dpsgd_stats["neighbours"] += len(st.neighbours)

    def may_contact(self, url: str, now: float) -> bool:
        return self.policy.may_contact(url, now)

    # --- what a peer reports --------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        n = self.node
        return {
            "id": n.id,
            "spec_hash": self.spec.hash,
            "age": n.age,
            "version": n.version,
            "merges": n.merges,
            "view": n.membership.peers(),
            "suspected": sorted(n.membership.suspected()),
            "bytes_sent": self.bytes_sent,
            "rejected": self.rejected,
            "bounded": n.bounded,
            "merge_bound": {
                "clipped": n.merge_bound.clipped,
                "refused": n.merge_bound.refused,
                "followed": n.merge_bound.followed,  # far models clipped toward: most live senders were that far
            },
            "addresses": {
                "refused": self.policy.refused,
                "deferred": self.policy.deferred,
                "verified": len(self.policy.verified),
            },
            "held": sum(map(len, self.held.values())),
            "algorithm": self.g.algorithm,
            "directory": len(n.membership.known),
            # how many peers the history samplers hold, not which (their winners are theirs to know)
            "history": len(n.membership.history.sample()),
            "sampler_resets": n.membership.history.resets,
            **({"group": dict(self.group_stats)} if self.g.algorithm == "group_average" else {}),
            **({"dpsgd": dict(self.dpsgd_stats)} if self.g.algorithm == "dpsgd" else {}),
            **({"secure": dict(self.secure_stats)} if self.g.algorithm == "secure_groups" else {}),
        }
