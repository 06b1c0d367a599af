"""SCAFFOLD's server control variate (Karimireddy et al. 2020, Algorithm 1, line 17).

The model step is the usual strategy's ``x <- x + eta_g mean(Delta y)`` (strategy.name =
"fedavg", eta_g = strategy.server_lr); this object keeps ``c`` and applies
``c <- c + (1/N) sum_{i in S} Delta c_i`` over the clients whose updates the round accepted
(N: all clients), so ``c`` stays the mean of the clients' ``c_i``.
"""

from __future__ import annotations

import torch


class ScaffoldControl:
    """The server control variate ``c``: broadcast with the model, moved once per round."""

    def __init__(self, numel: int, num_clients: int, device: torch.device | str = "cpu"):
        if num_clients <= 0:
            raise ValueError(f"num_clients = {num_clients} must be > 0")
        self.num_clients = num_clients
        self.c = torch.zeros(numel, device=device)
        self._sum = torch.zeros(numel, device=device, dtype=torch.float64)
        self.count = 0

    def broadcast(self) -> dict[str, torch.Tensor]:
        return {"scaffold/c": self.c}

    def add(self, to_server: dict[str, torch.Tensor]) -> None:
        """One accepted client's ``Delta c_i``."""
        self._sum.add_(to_server["scaffold/dc"].to(self._sum.device))
        self.count += 1

    def step(self) -> None:
        """Close the round: ``c <- c + (1/N) sum Delta c_i``; a round with none leaves c."""
        if self.count:
            self.c = (self.c.double() + self._sum / self.num_clients).float()
        self._sum.zero_()
        self.count = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"c": self.c.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.c = state["c"].to(self.c.device, torch.float32).clone()
