"""FedAsync (Xie et al. 2019, "Asynchronous Federated Optimization", Algorithm 1).

Each update is mixed into the global model the moment it arrives:

    x <- (1 - alpha_t) x + alpha_t x_client,   alpha_t = alpha * s(t)

where t is the update's staleness and s a staleness weight (aggregation.staleness).
The client's model is x_client = x_base + delta, x_base being the global version it
trained from. When base == current x this is x <- x + alpha_t delta.

When base != current (a stale update) there are two choices, and shoal names which:

- ``mix="model"`` (the paper): the caller passes x_base; the result is
  x + alpha_t (x_base + delta - x). It pulls x back towards the old x_base by
  alpha_t (x_base - x) as well as applying the client's progress. The protocol object
  (shoal.async_rounds) keeps the last ``max_staleness`` global versions for this, so
  memory is O(max_staleness x model).
- ``mix="delta"``: x <- x + alpha_t delta, i.e. x_client is taken as x + delta (the
  client's progress is applied to the current model). Memory O(model). Identical to
  the paper for staleness 0.

Robustness: FedAsync applies one update at a time, so a median or Krum over it would
be that update; the only robust rule that fits is norm bounding (Sun et al. 2019):
with ``norm_bound > 0`` the delta is scaled to L2 norm <= norm_bound before mixing.
"""

from __future__ import annotations

import math

import torch

from shoal.aggregation.staleness import StalenessWeight
from shoal.update import Update

MIX_RULES = ("model", "delta")


class FedAsync:
    """The FedAsync server step; holds no state but its hyperparameters."""

    def __init__(self, alpha: float, weight: StalenessWeight, mix: str = "model", norm_bound: float = 0.0):
        if not 0 < alpha <= 1:
            raise ValueError(f"FedAsync alpha = {alpha} must be in (0, 1]")
        if mix not in MIX_RULES:
            raise ValueError(f"FedAsync mix = {mix!r} must be one of {', '.join(MIX_RULES)}")
        self.alpha = alpha
        self.weight = weight
        self.mix = mix
        if not (norm_bound >= 0 and math.isfinite(norm_bound)):
            raise ValueError(f"FedAsync norm_bound = {norm_bound!r} must be a finite number >= 0 (0 = off)")
        self.norm_bound = norm_bound
        self.clipped = 0  # updates scaled down by the norm bound so far

    def alpha_t(self, staleness: int) -> float:
        """alpha * s(t), the mixing weight of an update of staleness t."""
        return self.alpha * self.weight(staleness)

    def apply(self, x: torch.Tensor, update: Update, staleness: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """The new global model (a new tensor; ``x`` is not modified).

        ``base`` is the global model the client trained from; it is required under
        ``mix="model"`` when staleness > 0 and ignored under ``mix="delta"``.
        """
        a = self.alpha_t(staleness)
        delta = update.delta.to(device=x.device, dtype=torch.float32)
        if self.norm_bound > 0:
            norm = float(torch.linalg.vector_norm(delta))
            if norm > self.norm_bound:
                delta = delta * (self.norm_bound / norm)
                self.clipped += 1
        if self.mix == "delta" or staleness == 0:
            return torch.add(x, delta, alpha=a)
        if base is None:
            raise ValueError("FedAsync mix='model' needs the base model of a stale update")
        # (1 - a) x + a (base + delta), formed as x + a (base + delta - x).
        target = base.to(device=x.device, dtype=torch.float32) + delta
        return torch.lerp(x, target, a)
