"""Secure groups between real peers: one group's secure average as a protocol object (sans-I/O).

The group (a group of the virtual grid, p2p/group_average.py) averages its members' models
by secure aggregation (Bonawitz et al. 2017, the :class:`SecAggClient` /
:class:`SecAggServer` state machines of shoal.aggregation.secagg): every member runs the
client side, and one member, the relay (the group's first member), also runs the server
side over the network. The relay sees only public keys, encrypted shares and masked
vectors; like every member it learns the group's example-weighted average and nothing
else. What is masked is the model's offset from the shared seeded initial model, clipped
to ``clip`` per entry, in fixed point (``bits``), beside the member's weight (its
examples over the group's largest, which the members tell the relay in the clear, as
FedAvg clients tell a server).

Messages: a member sends ``keys`` (with its example count), ``shares``, ``masked`` and
``unmask`` to the relay; the relay answers each stage with ``directory`` (with the largest
example count), ``delivery``, ``request``, and in the end ``mean`` (the average offset) to
the members whose input is in it, or ``abort``. The relay closes a stage when every member
not known gone has answered, or ``timeout`` after the stage opened; members that miss a
stage drop out as the protocol defines, and a group left below the threshold aborts: its
members keep their models. The keys stage waits ``2 timeout`` (members start when their
local work is done). A member gives up ``6 timeout`` after its start (a silent relay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from shoal.aggregation.secagg import (
    EncryptedShares,
    KeyDirectory,
    MaskedInput,
    PublicKeys,
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    SecAggRefused,
    SecAggServer,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
)
from shoal.aggregation.secagg.encoding import FixedPoint, encode_weighted, weighted_mean
from shoal.aggregation.secagg.memory import client_randomness

from .group_average import Refusal, group_id

TO_RELAY = ("keys", "shares", "masked", "unmask")
TO_MEMBER = ("directory", "delivery", "request", "mean", "abort")
_PAYLOAD = {
    "keys": PublicKeys,
    "shares": EncryptedShares,
    "masked": MaskedInput,
    "unmask": UnmaskShares,
    "directory": KeyDirectory,
    "delivery": ShareDelivery,
    "request": UnmaskRequest,
}


@dataclass(frozen=True)
class SecureMessage:
    """One message of a secure group: ``payload`` is the secagg message of ``kind``, the mean
    offset (float32 tensor) for ``mean``, None for ``abort``; ``meta``: example counts."""

    sender: str
    target: str
    round: int
    group: str
    members: tuple[str, ...]
    kind: str
    payload: Any
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SecureResult:
    mean: torch.Tensor | None  # the group's weighted average offset (None: aborted or relay gone)
    included: int  # members whose input is in it
    reason: str = ""  # why there is none


class SecureGroup:
    """One member's side (and the relay's, for the first member) of a secure group average."""

    def __init__(
        self,
        me: str,
        members: Sequence[str],
        round_: int,
        offset: torch.Tensor,
        num_examples: int,
        now: float,
        timeout: float,
        clip: float = 1.0,
        bits: int = 16,
        threshold: float = 0.5,
        seed: int | None = None,
    ):
        self.members = tuple(members)
        if me not in self.members or len(set(self.members)) != len(self.members) or len(self.members) < 2:
            raise ValueError("a secure group has >= 2 distinct members, this member among them")
        if num_examples < 1:
            raise ValueError("num_examples must be >= 1")
        self.me, self.round, self.timeout, self.t0 = me, int(round_), float(timeout), float(now)
        self.relay = self.members[0]
        self.group = group_id(self.round, self.members, level=0x5EC)
        self.offset = offset.detach().double().cpu().numpy()
        self.num_examples = int(num_examples)
        k = len(self.members)
        self.values, self.weights = FixedPoint(clip, bits, k), FixedPoint(1.0, bits, k)
        self.params = SecAggParams(
            f"shoal-peer/{self.group}".encode(), self.offset.size + 1, "full", threshold_fraction=threshold
        )
        self.client = SecAggClient(me, self.params, client_randomness(seed, f"{self.group}/{me}"))
        self._noise = np.random.default_rng(None if seed is None else [seed, self.round])
        self.gone: set[str] = set()
        self.done = False
        self._result = SecureResult(None, 0, "not finished")
        self._max_weight = 0.0
        # the relay's side
        self.server = SecAggServer(self.params, list(self.members)) if me == self.relay else None
        self._stage = 0  # index into TO_RELAY of the stage the relay collects
        self._stage_at = self.t0
        self._got: set[str] = set()
        self._weights: dict[str, int] = {}

    def _msg(self, target: str, kind: str, payload: Any, meta: dict[str, Any] | None = None) -> SecureMessage:
        return SecureMessage(self.me, target, self.round, self.group, self.members, kind, payload, meta or {})

    def _finish(self, mean: torch.Tensor | None, included: int, reason: str = "") -> None:
        self.done = True
        self._result = SecureResult(mean, included, reason)

    def result(self) -> SecureResult:
        return self._result

    # --- member side ------------------------------------------------------------------------

    def start(self) -> list[SecureMessage]:
        keys = self.client.advertise_keys()
        return self._to_relay("keys", keys, {"num_examples": self.num_examples}, self.t0)

    def _to_relay(self, kind: str, payload: Any, meta: dict[str, Any] | None, now: float) -> list[SecureMessage]:
        msg = self._msg(self.relay, kind, payload, meta)
        if self.server is not None:
            return self._relay_receive(msg, now)
        return [msg]

    def _as_member(self, msg: SecureMessage, now: float) -> list[SecureMessage]:
        try:
            if msg.kind == "directory":
                self._max_weight = float(msg.meta.get("max_weight", 0))
                if not self._max_weight >= self.num_examples:
                    raise SecAggRefused(f"max_weight {self._max_weight} below this member's {self.num_examples}")
                return self._to_relay("shares", self.client.share_keys(msg.payload), None, now)
            if msg.kind == "delivery":
                w = self.num_examples / self._max_weight
                encoded = encode_weighted(self.offset, w, self.values, self.weights, self._noise)
                return self._to_relay("masked", self.client.masked_input(msg.payload, encoded), None, now)
            if msg.kind == "request":
                return self._to_relay("unmask", self.client.unmask(msg.payload), None, now)
        except SecAggAborted as e:
            self._finish(None, 0, str(e))
            return []
        if msg.kind == "mean":
            self._finish(msg.payload, int(msg.meta.get("included", 0)))
        elif msg.kind == "abort":
            self._finish(None, 0, str(msg.meta.get("reason", "aborted by the relay")))
        return []

    # --- relay side ---------------------------------------------------------------------------

    def _relay_receive(self, msg: SecureMessage, now: float) -> list[SecureMessage]:
        assert self.server is not None
        kind = TO_RELAY[self._stage] if self._stage < len(TO_RELAY) else None
        if msg.kind != kind or msg.sender in self._got:
            raise Refusal("closed", f"relay {self.me} collects {kind!r}, not a {msg.kind!r} from {msg.sender}")
        try:
            if kind == "keys":
                n = msg.meta.get("num_examples")
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise Refusal("malformed", "keys must carry num_examples >= 1")
                self.server.receive_keys(msg.payload)
                self._weights[msg.sender] = n
            elif kind == "shares":
                self.server.receive_shares(msg.payload)
            elif kind == "masked":
                self.server.receive_masked(msg.payload)
            else:
                self.server.receive_unmask(msg.payload)
        except SecAggProtocolError as e:
            raise Refusal("malformed", str(e)) from None
        self._got.add(msg.sender)
        return self._relay_progress(now)

    def _relay_progress(self, now: float) -> list[SecureMessage]:
        out: list[SecureMessage] = []
        while self.server is not None and not self.done and self._stage < len(TO_RELAY):
            waiting = [m for m in self.members if m not in self._got and m not in self.gone]
            if waiting and now < self._stage_deadline():
                break
            out += self._close_stage(now)
        return out

    def _close_stage(self, now: float) -> list[SecureMessage]:
        assert self.server is not None
        kind = TO_RELAY[self._stage]
        self._stage += 1
        self._stage_at, self._got = now, set()
        try:
            if kind == "keys":
                replies = self.server.close_advertise()
                meta = {"max_weight": max(self._weights[m] for m in replies)}
                return self._deliver("directory", replies, meta, now)
            if kind == "shares":
                return self._deliver("delivery", self.server.close_share(), {}, now)
            if kind == "masked":
                return self._deliver("request", self.server.close_masked(), {}, now)
            res = self.server.finish()
        except SecAggAborted as e:
            self._finish(None, 0, str(e))
            return [
                self._msg(m, "abort", None, {"reason": str(e)[:300]})
                for m in self.members
                if m != self.me and m not in self.gone
            ]
        mean, _ = weighted_mean(res.total, len(res.included), self.values, self.weights)
        vec = torch.from_numpy(mean).float()
        self._finish(vec if self.me in res.included else None, len(res.included))
        return [self._msg(m, "mean", vec, {"included": len(res.included)}) for m in res.included if m != self.me]

    def _deliver(self, kind: str, replies: dict[str, Any], meta: dict[str, Any], now: float) -> list[SecureMessage]:
        out: list[SecureMessage] = []
        mine = replies.pop(self.me, None)
        out += [self._msg(m, kind, payload, meta) for m, payload in replies.items() if m not in self.gone]
        if mine is not None:  # the relay is a member too
            out += self._as_member(self._msg(self.me, kind, mine, meta), now)
        return out

    # --- both -----------------------------------------------------------------------------------

    def check(self, msg: SecureMessage) -> None:
        if msg.round != self.round or msg.group != self.group or tuple(msg.members) != self.members:
            raise Refusal("not_in_group", f"{self.me} is in secure group {self.group} of round {self.round}")
        if msg.sender not in self.members or msg.sender == self.me or msg.target != self.me:
            raise Refusal("malformed", f"sender {msg.sender!r} / target {msg.target!r} do not fit the group")
        allowed = TO_RELAY if self.me == self.relay else TO_MEMBER
        if msg.kind not in allowed or (self.me != self.relay and msg.sender != self.relay):
            raise Refusal("malformed", f"a {msg.kind!r} from {msg.sender} to {self.me} (relay {self.relay})")
        want = _PAYLOAD.get(msg.kind)
        if want is not None and not isinstance(msg.payload, want):
            raise Refusal("malformed", f"a {msg.kind!r} message must carry a {want.__name__}")
        if msg.kind == "mean" and not (
            isinstance(msg.payload, torch.Tensor) and tuple(msg.payload.shape) == (self.offset.size,)
        ):
            raise Refusal("malformed", f"a mean must be a vector of {self.offset.size} values")

    def on_message(self, msg: SecureMessage, now: float) -> list[SecureMessage]:
        self.check(msg)
        if self.done:
            return []
        if self.me == self.relay:
            return self._relay_receive(msg, now)
        try:
            return self._as_member(msg, now)
        except (SecAggRefused, SecAggProtocolError, ValueError) as e:
            raise Refusal("refused", str(e)) from None

    def on_unreachable(self, peer: str, now: float) -> list[SecureMessage]:
        if self.done or peer not in self.members or peer == self.me:
            return []
        self.gone.add(peer)
        if peer == self.relay:
            self._finish(None, 0, f"relay {peer} unreachable")
            return []
        return self._relay_progress(now)

    def tick(self, now: float) -> list[SecureMessage]:
        if self.done:
            return []
        if self.server is None and now >= self.t0 + 6 * self.timeout:
            self._finish(None, 0, f"no answer from relay {self.relay}")
            return []
        return self._relay_progress(now)

    def next_deadline(self) -> float | None:
        if self.done:
            return None
        if self.server is None:
            return self.t0 + 6 * self.timeout
        return self._stage_deadline()

    def _stage_deadline(self) -> float:
        """The keys wait twice as long (members start when their local work is done), the later
        stages once (they only answer the relay)."""
        return self._stage_at + (2 if self._stage == 0 else 1) * self.timeout
