"""FedDyn's server step (Acar et al. 2021, Algorithm 1, lines 8-9).

``h^t = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})`` and
``theta^t = mean_{k in P_t} theta_k^t - h^t / alpha``, m the number of all clients. In terms of
the clients' deltas: ``h <- h - alpha (|P_t| / m) mean(Delta)``, ``theta <- theta + mean(Delta) - h / alpha``
(the mean weighted as ``strategy.weighting`` says; the paper's is uniform).
"""

from __future__ import annotations

import torch

from shoal.aggregation.mean import WeightedMean
from shoal.aggregation.server_opt import FedAvgOpt
from shoal.aggregation.strategy import Strategy
from shoal.update import PartialSum


class FedDynStrategy(Strategy):
    """A strategy with FedDyn's server state ``h`` (kept in its state_dict)."""

    def __init__(self, numel: int, num_clients: int, alpha: float, device: torch.device | str, weighting: str):
        super().__init__(WeightedMean(numel, device), FedAvgOpt(1.0), weighting)
        self.alpha = float(alpha)
        self.num_clients = num_clients
        self.h = torch.zeros(numel, device=device)

    def bind_population(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def accumulate_sum(self, part: PartialSum) -> None:
        raise TypeError("FedDyn counts the round's clients; it takes each update")

    def finalize(self) -> torch.Tensor:
        if self._global is None:
            raise RuntimeError("finalize() before begin(): no round is open")
        count = self.aggregator.count
        mean = self.aggregator.mean()  # raises EmptyAggregate when nothing came
        self.h = self.h - self.alpha * (count / self.num_clients) * mean
        new_global = self._global + mean - self.h / self.alpha
        self.aggregator.reset()
        self._global = None
        return new_global

    def state_dict(self):
        return {"h": self.h.clone()}

    def load_state_dict(self, state) -> None:
        self.h = state["h"].to(self.h.device).clone()
