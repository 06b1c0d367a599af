"""A gossip-learning peer as a protocol object (sans-I/O).

The loop of Ormandi et al. (2013) and Hegedus et al. (2019), with push-pull: after a
local training step a peer draws a peer from its membership view and pushes its model;
the receiver answers with its own model as it was *before* merging, then merges the
pushed one; the initiator merges the answer. Both transports, the simulator's virtual
network and the aiohttp peer, drive this same object: they call ``start_exchange``,
deliver the returned message, and hand back answers or failures.

A model carries an ``age`` (local updates folded in, the merge rules' weight) and a
``version`` (bumped on every change of the parameters, so a reader can tell them apart).
Both stop at MAX_COUNT (a received one above it is refused by p2p/messages.py), so no
count can outgrow what the wire accepts, however long a network runs or whatever a peer
claims. Every received model passes the peer's MergeBound (p2p/merge.py) before it is merged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from .freshness import Counter, Freshness
from .membership import Membership
from .merge import MergeBound, MergeRule, ModelInfo

log = logging.getLogger(__name__)

MAX_COUNT = 2**53  # ages, versions and counters saturate here (exact as a float, far below the wire's int64)


def bump(count: int) -> int:
    """``count + 1``, saturating at MAX_COUNT: overflow impossible by construction."""
    return min(count + 1, MAX_COUNT)


@dataclass(frozen=True)
class ModelMessage:
    """A model on its way to ``target``; ``reply`` marks the answer of a push-pull."""

    sender: str
    target: str
    params: torch.Tensor
    age: int
    version: int
    num_examples: int
    reply: bool = False
    seq: int = 0  # the sender's message counter (p2p/freshness.py): pushes are taken in increasing order only

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.age, self.num_examples)


class GossipNode:
    """One peer's model, its age and version, and the push-pull exchange around them."""

    def __init__(
        self,
        membership: Membership,
        params: torch.Tensor,
        num_examples: int,
        rule: MergeRule | None = None,
        timeout: float = 5.0,
        bound: MergeBound | None = None,
    ):
        self.membership = membership
        self.params = params
        self.num_examples = int(num_examples)
        self.rule = rule or MergeRule()
        self.timeout = timeout
        self.merge_bound = bound if bound is not None else MergeBound()
        self.merge_bound.start(params)
        self.age = 0
        self.version = 0
        self.merges = 0
        self.skipped = 0
        self.bounded = 0  # received models clipped or rejected by rule.norm_bound
        self._pending: dict[str, float] = {}  # peer -> deadline of our unanswered push
        self.wall_offset = 0.0  # wall clock minus ``now``: message counters are wall-clock microseconds
        self.counter = Counter()
        self.freshness = Freshness()  # the pushes taken: a replayed, older or expired one moves nothing

    @property
    def id(self) -> str:
        return self.membership.self_id

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(self.age, self.num_examples)

    def local_update(self, new_params: torch.Tensor) -> None:
        """Adopt the result of one round of local training on our own data: its length sets the
        floor of the merge radius and restarts the drift budget (p2p/merge.py MergeBound)."""
        new = new_params.to(self.params.device, self.params.dtype)
        self.merge_bound.local_step(float(torch.linalg.vector_norm((new - self.params).double())), new)
        self.params.copy_(new_params)
        self.age = bump(self.age)
        self.version = bump(self.version)

    def restart(self, params: torch.Tensor) -> None:
        """Forget the model (a crash or a fresh start): back to ``params`` at age 0."""
        self.params.copy_(params)
        self.age = 0
        self.version = bump(self.version)
        self._pending.clear()
        self.merge_bound.reset()
        self.merge_bound.start(params)

    def adopt(self, values: torch.Tensor, clip: bool = True) -> bool:
        """Take an exchange's result (a group average, a D-PSGD mix, a secure group's mean) as
        our model, through the merge bound: clipped to its radius and within the drift budget
        (``clip = False``, for a secure group's mean, where no member's part can be seen and
        secure_aggregation.clip bounds each one: only ``max_abs``); False (model kept) when
        the bound refuses it."""
        b = self.merge_bound
        before = b.clipped + b.refused + b.capped
        if not clip:
            if not b.within_max_abs(values):
                b.refused += 1
                self.bounded += 1
                self.skipped += 1
                return False
            self.params.copy_(values.to(self.params.device, self.params.dtype))
            self.version = bump(self.version)
            self.merges = bump(self.merges)
            return True
        bounded = b.apply(self.params, values)
        if bounded is None or b.move(self.params, bounded, 1.0) <= 0.0:
            self.bounded += b.clipped + b.refused + b.capped - before
            self.skipped += 1
            return False
        self.bounded += b.clipped + b.refused + b.capped - before
        self.version = bump(self.version)
        self.merges = bump(self.merges)
        return True

    def _message(self, target: str, reply: bool, now: float) -> ModelMessage:
        seq = self.counter.next(now + self.wall_offset)
        params = self.params.detach().clone()
        return ModelMessage(self.id, target, params, self.age, self.version, self.num_examples, reply, seq)

    def start_exchange(self, now: float) -> ModelMessage | None:
        """Push our model to a peer drawn from the view (None when the view is empty)."""
        self.membership.rejoin(now)
        peer = self.membership.sample()
        if peer is None:
            return None
        self._pending[peer] = now + self.timeout
        return self._message(peer, reply=False, now=now)

    def on_push(self, msg: ModelMessage, now: float) -> ModelMessage:
        """Answer with our pre-merge model, then merge the pushed one. A push that is not fresh
        (p2p/freshness.py: replayed, older than one taken, expired) raises Stale and moves nothing."""
        self.freshness.check(msg.sender, msg.seq, now + self.wall_offset)
        self.freshness.take(msg.sender, msg.seq)
        answer = self._message(msg.sender, reply=True, now=now)
        self._merge(msg)
        self.membership.heard_from(msg.sender, now)
        return answer

    def on_reply(self, msg: ModelMessage, now: float) -> None:
        self._pending.pop(msg.sender, None)
        self._merge(msg)
        self.membership.on_success(msg.sender, now)

    def on_failure(self, peer: str, now: float) -> None:
        """The transport could not reach ``peer`` (error, refusal or timeout)."""
        self._pending.pop(peer, None)
        if self.membership.on_failure(peer, now):
            log.info("%s: removed %s from its view after repeated failures", self.id, peer)

    def cancel(self, peer: str) -> None:
        """Our push to ``peer`` was never sent (the transport would not contact it): no answer to wait for."""
        self._pending.pop(peer, None)

    def expire(self, now: float) -> list[str]:
        """Pushes unanswered past their deadline count as failures; returns those peers."""
        late = [p for p, d in self._pending.items() if d <= now]
        for p in late:
            self.on_failure(p, now)
        return late

    def _outlier(self, msg: ModelMessage) -> bool:
        """A model too far behind ours in age to merge still takes its sender's slot of the merge
        bound's window (its distance and its vote); True when it lies beyond the far limit and most
        live senders are that far (MergeBound.outvoted): then it is our model, not theirs, that
        is off (a group that trained apart, or ran ahead in age, meeting a larger one), and the
        age gap must not keep us from following them."""
        b = self.merge_bound
        if math.isinf(b.radius()) or not b.within_max_abs(msg.params):
            return False
        own = self.params
        diff = msg.params.to(own.device, own.dtype) - own
        dist = float(torch.linalg.vector_norm(diff.double()))
        b.observe(msg.sender, dist, b.reach(own, diff, dist))
        return msg.sender in b.beyond and b.outvoted()

    def _merge(self, msg: ModelMessage) -> None:
        b = self.merge_bound
        rule = self.rule
        if rule.weight(self.info, msg.info) <= 0.0 and not self._outlier(msg):
            self.skipped += 1  # too stale: not merged, not counted against the bound
            return
        if rule.weight(self.info, msg.info) <= 0.0:  # we are the outlier: its age does not make it stale
            rule = MergeRule(rule.rule, rule.staleness_exponent, 0, rule.norm_bound, rule.bound_mode)
        before = b.clipped + b.refused + b.capped
        other = b.apply(self.params, msg.params, msg.sender)  # self-centered clipping, per sender
        if other is not None and rule.norm_bound > 0:
            other, acted = rule.bound(self.params, other)
            self.bounded += int(acted)
        lam = rule.weight(self.info, msg.info)
        if other is not None:
            lam = b.move(self.params, other, lam)  # within the drift budget
        self.bounded += b.clipped + b.refused + b.capped - before
        if other is None or lam <= 0.0:
            self.skipped += 1
            return
        adopted = rule.weight(self.info, msg.info) >= 1.0
        self.age = min(msg.age if adopted else max(self.age, msg.age), MAX_COUNT)
        self.version = bump(self.version)
        self.merges = bump(self.merges)
