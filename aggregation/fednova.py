"""FedNova's normalised averaging (Wang et al. 2020, eq. 6 / Algorithm in Appendix).

Client i ran tau_i local steps and reports ``a_i = ||a_i||_1`` (client/algorithms.py). The
server averages normalised updates and rescales by the effective number of steps:
``x <- x + tau_eff sum_i p_i Delta_i / a_i`` with ``tau_eff = sum_i p_i a_i`` and p_i the
strategy's weights (n_i / n under examples weighting). With equal a_i this is FedAvg; with
unequal local steps, clients that ran more steps no longer pull the model towards their own
optimum by more (the objective inconsistency of the paper).
"""

from __future__ import annotations

import math

import torch

from shoal.aggregation.strategy import Strategy
from shoal.update import PartialSum, Update


class FedNovaStrategy(Strategy):
    """A strategy whose mean is FedNova's normalised one (the server optimizer then steps on it)."""

    def begin(self, global_flat: torch.Tensor) -> None:
        super().begin(global_flat)
        self._a_sum = 0.0
        self._w_sum = 0.0

    def accumulate(self, update: Update, weight: float = 1.0) -> None:
        a = float(update.metrics.get("fednova_a", 0.0))
        if not (a > 0 and math.isfinite(a)):
            raise ValueError(f"update from {update.sender or 'a client'} has no FedNova step weight (fednova_a)")
        w = (update.num_examples if self.weighting == "examples" else 1) * weight
        super().accumulate(Update(update.delta / a, update.num_examples, update.base_version, update.sender), weight)
        self._a_sum += w * a
        self._w_sum += w

    def accumulate_sum(self, part: PartialSum) -> None:
        raise TypeError("FedNova needs each update's step weight, not a partial sum")

    def finalize(self) -> torch.Tensor:
        tau_eff = self._a_sum / self._w_sum if self._w_sum > 0 else 1.0
        mean = self.aggregator.mean() * tau_eff if self.aggregator.count else None
        if mean is None:
            return super().finalize()  # raises EmptyAggregate
        assert self._global is not None
        new_global = self.optimizer.step(self._global, mean)
        self.aggregator.reset()
        self._global = None
        return new_global
