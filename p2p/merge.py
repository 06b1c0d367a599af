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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RULES = ("average", "examples", "age")


@dataclass(frozen=True)
class ModelInfo:
    """What a merge needs to know about a model besides its parameters."""

    age: int            # local updates folded in
    num_examples: int   # training examples behind the model (the owner's shard size)


@dataclass(frozen=True)
class MergeRule:
    rule: str = "age"
    staleness_exponent: float = 0.0  # 0: no staleness discount
    max_age_gap: int = 0             # 0: no limit

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"merge rule {self.rule!r} is not one of {RULES}")

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

    def merge(self, own: torch.Tensor, own_info: ModelInfo, other: torch.Tensor, other_info: ModelInfo) -> tuple[float, ModelInfo]:
        """Merge ``other`` into ``own`` in place; returns (lam, info of the merged model)."""
        lam = self.weight(own_info, other_info)
        if lam <= 0.0:
            return lam, own_info
        if lam >= 1.0:
            own.copy_(other)
            return lam, ModelInfo(other_info.age, own_info.num_examples)
        own.lerp_(other.to(own.device, own.dtype), lam)
        return lam, ModelInfo(max(own_info.age, other_info.age), own_info.num_examples)
