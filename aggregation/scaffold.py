"""SCAFFOLD's server control variate (Karimireddy et al. 2020, Algorithm 1, line 17).

The model step is the usual strategy's ``x <- x + eta_g mean(Delta y)`` (strategy.name =
"fedavg", eta_g = strategy.server_lr); this object keeps ``c`` and applies
``c <- c + (1/N) sum_{i in S} Delta c_i`` over the clients whose updates the round accepted
(N: all clients), so ``c`` stays the mean of the clients' ``c_i``.
"""

from __future__ import annotations

import torch

from shoal.aggregation.strategy import Strategy
from shoal.update import PartialSum, Update


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


class ScaffoldStrategy(Strategy):
    """SCAFFOLD's server half as one strategy, for a server whose updates carry their client's
    ``Delta c_i`` (``Update.to_server["scaffold/dc"]``, shoal/wire.py): the model steps as
    ``inner`` does (x <- x + eta_g mean(Delta y)) and ``c`` moves in the same :meth:`finalize`,
    so a round's model and control variate change together and ``c`` is checkpointed with the
    strategy's state. ``num_clients`` (N) is the population: the registered nodes."""

    def __init__(self, inner: Strategy, numel: int, num_clients: int, device: torch.device | str = "cpu"):
        super().__init__(inner.aggregator, inner.optimizer, inner.weighting)
        self.control = ScaffoldControl(numel, num_clients, device)

    def begin(self, global_flat: torch.Tensor) -> None:
        super().begin(global_flat)
        self.control._sum.zero_()  # a round that failed leaves nothing behind
        self.control.count = 0

    def check(self, update: Update) -> None:
        """ValueError unless the update carries its control-variate delta (nothing changes)."""
        dc = update.to_server.get("scaffold/dc")
        if dc is None or dc.shape != update.delta.shape:
            raise ValueError(
                f"update from {update.sender or 'a client'} has no 'scaffold/dc' of the model's size: "
                "SCAFFOLD's nodes send their control-variate delta beside the update"
            )

    def accumulate(self, update: Update, weight: float = 1.0) -> None:
        self.check(update)
        super().accumulate(update, weight)
        self.control.add(update.to_server)

    def accumulate_sum(self, part: PartialSum) -> None:
        raise TypeError("SCAFFOLD needs each update's control-variate delta, not a partial sum")

    def finalize(self) -> torch.Tensor:
        new_global = super().finalize()  # EmptyAggregate (c unchanged) when nothing came
        self.control.step()
        return new_global

    def broadcast(self) -> dict[str, torch.Tensor]:
        return self.control.broadcast()

    def bind_population(self, num_clients: int) -> None:
        self.control.num_clients = num_clients

    def state_dict(self):
        return {"optimizer": super().state_dict(), "c": self.control.c.clone()}

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state["optimizer"])
        self.control.load_state_dict({"c": state["c"]})
