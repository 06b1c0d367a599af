"""Merge rules of gossip learning: how a peer folds a received model into its own.

A merge is ``own <- (1 - lam) * own + lam * other`` on the flat parameter vectors; the
rules differ in ``lam``:

- ``average``: lam = 1/2 (Ormandi, Hegedus and Jelasity 2013, "MU" merge);
- ``examples``: lam = n_other / (n_own + n_other), the two-model case of FedAvg's
  example weighting;
- ``age``: lam = a_other / (a_own + a_other), where the age is the number of local
  updates folded into a model (Hegedus, Danner and Jelasity 2019, "Gossip learning as a
  decentralized alternative to federated learning", the age-weighted merge).

A received model that is behind ours (a smaller age) is staler: its weight is multiplied
by ``(1 + gap) ** -staleness_exponent`` (the polynomial staleness function of FedAsync,
Xie et al. 2019), and a model more than ``max_age_gap`` behind is not merged at all. A
model more than ``max_age_gap`` *ahead* of ours replaces ours: that is how a peer that
restarted from scratch catches up in one exchange. The merged age is the larger of the
two (Ormandi et al.).

Robust merge. With ``norm_bound`` > 0 a received model farther than ``norm_bound`` (L2)
from ours is either

- ``clip``ped: ``own <- own + lam * clip(other - own, norm_bound)``, where clip scales a
  vector down to that norm. This is self-centered clipping (He, Karimireddy and Jaggi
  2022, "Byzantine-robust decentralized learning via self-centered clipping",
  arXiv:2202.01545) applied to one push-pull pair; or
- ``reject``ed: not merged at all (a distance screen, the parameter-space analogue of
  ``max_age_gap``).

Either way a hostile model moves ours by at most ``lam * norm_bound`` per merge,
whatever it contains and whatever age it claims (adopting a model far ahead is bounded
the same way). Clipping still lets every merge pull that far in the attacker's
direction, so attackers that merge often add up; rejection ignores the blatant ones
entirely (measured in docs/results.md). The bound should sit above the honest peers'
distances (the consensus distance metric shows them), or honest merges are cut too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RULES = ("average", "examples", "age")
BOUND_MODES = ("clip", "reject")


@dataclass(frozen=True)
class ModelInfo:
    """What a merge needs to know about a model besides its parameters."""

    age: int  # local updates folded in
    num_examples: int  # training examples behind the model (the owner's shard size)


@dataclass(frozen=True)
class MergeRule:
    rule: str = "age"
    staleness_exponent: float = 0.0  # 0: no staleness discount
    max_age_gap: int = 0  # 0: no limit
    norm_bound: float = 0.0  # > 0: bound ||other - own|| (L2) ...
    bound_mode: str = "clip"  # ... by clipping it, or by rejecting the model

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"merge rule {self.rule!r} is not one of {RULES}")
        if not self.norm_bound >= 0:
            raise ValueError(f"merge norm bound {self.norm_bound!r} must be >= 0")
        if self.bound_mode not in BOUND_MODES:
            raise ValueError(f"merge bound mode {self.bound_mode!r} is not one of {BOUND_MODES}")

    def bound(self, own: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(``other`` as the merge uses it, whether the bound acted): clipped so that
        ||other - own|| <= norm_bound, or None when the bound rejects it."""
        other = other.to(own.device, own.dtype)
        if self.norm_bound <= 0:
            return other, False
        diff = other - own
        norm = float(torch.linalg.vector_norm(diff))
        if norm <= self.norm_bound:
            return other, False
        if self.bound_mode == "reject":
            return None, True
        return own + diff * (self.norm_bound / norm), True

    def weight(self, own: ModelInfo, other: ModelInfo) -> float:
        """lam in [0, 1]: the share of the other model in the merge (1 = adopt it)."""
        gap = own.age - other.age
        if self.max_age_gap > 0:
            if gap > self.max_age_gap:
                return 0.0
            if -gap > self.max_age_gap:
                return 1.0
        if self.rule == "average":
            lam = 0.5
        elif self.rule == "examples":
            total = own.num_examples + other.num_examples
            lam = other.num_examples / total if total > 0 else 0.5
        else:
            total = own.age + other.age
            lam = other.age / total if total > 0 else 0.5
        if gap > 0 and self.staleness_exponent > 0:
            lam *= (1.0 + gap) ** -self.staleness_exponent
        return float(lam)

    def merge(
        self, own: torch.Tensor, own_info: ModelInfo, other: torch.Tensor, other_info: ModelInfo
    ) -> tuple[float, ModelInfo]:
        """Merge ``other`` into ``own`` in place; returns (lam, info of the merged model)."""
        lam = self.weight(own_info, other_info)
        if lam <= 0.0:
            return lam, own_info
        bounded, _ = self.bound(own, other)
        if bounded is None:
            return 0.0, own_info
        if lam >= 1.0:
            own.copy_(bounded)
            return lam, ModelInfo(other_info.age, own_info.num_examples)
        own.lerp_(bounded, lam)
        return lam, ModelInfo(max(own_info.age, other_info.age), own_info.num_examples)


# --- the safe-merge bound every algorithm applies by default ------------------------------------

RECENT_MERGES = 16  # accepted merge distances remembered for the bound's scale
SCALE_FLOOR = 1.0  # the bound's scale never drops below this L2 norm (a model near zero still merges)


class MergeBound:
    """How far one received model (or one exchange's result) may move a peer's model.

    Always on unless set to 0 (``gossip.merge_bound``, ``gossip.max_abs``), whatever
    ``robust.norm_bound`` says, because one hostile message must never poison a peer:

    - a model with any value beyond ``max_abs`` in absolute value is refused outright (no
      honest model holds 1e30; merging it would overflow ours);
    - a model farther (L2) than ``relative x scale`` from ours is clipped to that distance
      (``bound_mode = "clip"``) or refused (``"reject"``), where the scale is the largest of
      our own model's norm, the median distance of our last RECENT_MERGES accepted merges
      and SCALE_FLOOR. Only merges that needed no clipping enter the median, so a stream of
      hostile models cannot raise the bound faster than honest merges already did.

    A peer that keeps merging with an attacker is still pulled (at most ``lam x bound`` per
    merge); the bound makes each step small and finite, and honest merges pull it back.
    Stateful (the recent distances), one per peer; sans-I/O.
    """

    def __init__(self, relative: float = 1.0, max_abs: float = 1e4, mode: str = "clip"):
        if not relative >= 0 or not max_abs >= 0:
            raise ValueError(f"merge bound {relative!r} and max_abs {max_abs!r} must be >= 0")
        if mode not in BOUND_MODES:
            raise ValueError(f"merge bound mode {mode!r} is not one of {BOUND_MODES}")
        self.relative, self.max_abs, self.mode = float(relative), float(max_abs), mode
        self.recent: list[float] = []
        self.clipped = 0
        self.refused = 0

    @property
    def active(self) -> bool:
        return self.relative > 0 or self.max_abs > 0

    def within_max_abs(self, other: torch.Tensor) -> bool:
        """True when every value of ``other`` is finite and within ``max_abs`` (0: finite only)."""
        if not bool(torch.isfinite(other).all()):
            return False
        return self.max_abs <= 0 or other.numel() == 0 or float(other.abs().max()) <= self.max_abs

    def limit(self, own: torch.Tensor) -> float:
        """The largest distance a received model may have from ``own`` (inf when off)."""
        if self.relative <= 0:
            return float("inf")
        recent = sorted(self.recent)
        median = recent[len(recent) // 2] if recent else 0.0
        scale = max(float(torch.linalg.vector_norm(own.float())), median, SCALE_FLOOR)
        return self.relative * scale

    def apply(self, own: torch.Tensor, other: torch.Tensor) -> torch.Tensor | None:
        """``other`` as it may be merged into ``own``: unchanged, clipped to the bound, or
        None when refused (beyond ``max_abs``, or beyond the bound in reject mode). Counts
        what it did (``clipped``, ``refused``)."""
        other = other.to(own.device, own.dtype)
        if not self.within_max_abs(other):
            self.refused += 1
            return None
        if self.relative <= 0:
            return other
        limit = self.limit(own)
        diff = other - own
        dist = float(torch.linalg.vector_norm(diff))
        if dist <= limit:
            self.recent = [*self.recent[-(RECENT_MERGES - 1) :], dist]
            return other
        if self.mode == "reject":
            self.refused += 1
            return None
        self.clipped += 1
        return own + diff * (limit / dist)
