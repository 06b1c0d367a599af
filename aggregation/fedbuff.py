"""FedBuff (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous
Aggregation", AISTATS, Algorithm 1): buffered asynchronous aggregation.

Each arriving update is added to a buffer with its staleness weight; after K updates
the buffer's average is one server-optimizer step and the global version advances:

    buf += w_k s(t_k) delta_k          (w_k = n_k under "examples" weighting, else 1)
    after K updates:  Δ = buf / sum_k w_k,   x <- server_opt.step(x, Δ)

With uniform weights sum_k w_k = K, which is the paper's Δ̄ / K. The staleness weight
is deliberately *not* in the denominator: a stale update shrinks the step instead of
being renormalised away (so K updates of staleness t move the model s(t) times as far
as fresh ones), as in the paper. With staleness 0, examples weighting and a FedAvg
server optimizer at lr 1, one flush is exactly FedAvg over those K updates.

The buffer is one float64 model-sized sum (the same precision argument as
aggregation.mean), so memory is O(model) whatever K is.

Robust FedBuff. With a ``rule`` from aggregation/robust.py (coordinate median, trimmed
mean, Krum, norm bounding), the buffer keeps the K updates themselves, each discounted
by its staleness weight, and the flush combines them with that rule:

    after K updates:  Δ = rule({(s(t_k) delta_k, w_k)}),   x <- server_opt.step(x, Δ)

For ``rule = WeightedMean`` this is the formula above (sum_k w_k s_k delta_k / sum_k
w_k), so a stale update still shrinks the step; the median and trimmed mean ignore
w_k (robust.py says why). Memory: K float32 model copies, plus one while the rule
copies them at the flush. K is the natural bound: it is small (10 in the paper) and
fixed by the config, and the rule never sees more than K updates at once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from shoal.aggregation.server_opt import ServerOptimizer
from shoal.aggregation.staleness import StalenessWeight
from shoal.update import Update

if TYPE_CHECKING:
    from shoal.aggregation.strategy import Aggregator

# A checkpoint record: the optimizer's state under "opt.", counts, the buffer tensors and the
# held updates' weights (a list of floats), so not a server_opt.StateDict.
BufferState = dict[str, Any]


class FedBuff:
    """``accumulate(update, staleness)`` until ``full``; then ``flush(x) -> new x``."""

    def __init__(
        self,
        k: int,
        optimizer: ServerOptimizer,
        weight: StalenessWeight,
        weighting: str = "uniform",
        numel: int | None = None,
        device: torch.device | str = "cpu",
        rule: Aggregator | None = None,
    ):
        if k < 1:
            raise ValueError(f"FedBuff buffer size K = {k} must be >= 1")
        if weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting = {weighting!r} must be 'examples' or 'uniform'")
        self.k = k
        self.optimizer = optimizer
        self.weight = weight
        self.weighting = weighting
        self.device = torch.device(device)
        self.rule = rule  # a robust rule (see the module docstring), or None for the weighted sum
        self._sum: torch.Tensor | None = None
        if numel is not None and rule is None:
            self._sum = torch.zeros(numel, dtype=torch.float64, device=device)
        self.numel = numel
        self._held: list[tuple[torch.Tensor, float]] = []  # robust: (s_k delta_k, w_k) of the buffered updates
        self.count = 0
        self.base_total = 0.0

    @property
    def full(self) -> bool:
        return self.count >= self.k

    def accumulate(self, update: Update, staleness: int) -> None:
        """Add one update's weighted delta to the buffer."""
        if self.full:
            raise RuntimeError("FedBuff buffer is full: flush() before adding more")
        base = float(update.num_examples) if self.weighting == "examples" else 1.0
        if not (base > 0 and math.isfinite(base)):
            who = update.sender or "a client"
            raise ValueError(
                f"update from {who} has num_examples = {update.num_examples}; examples weighting needs > 0"
            )
        s = self.weight(staleness)
        delta = update.delta
        if self.rule is not None:
            if self.numel is None:
                self.numel = delta.numel()
            if delta.shape != (self.numel,):
                raise ValueError(f"delta has shape {tuple(delta.shape)}, expected ({self.numel},)")
            self._held.append((delta.to(self.device, torch.float32) * s, base))
            self.base_total += base
            self.count += 1
            return
        if self._sum is None:
            self._sum = torch.zeros(delta.numel(), dtype=torch.float64, device=self.device)
        if delta.shape != self._sum.shape:
            raise ValueError(f"delta has shape {tuple(delta.shape)}, expected {tuple(self._sum.shape)}")
        self._sum.add_(delta.to(self.device), alpha=base * s)
        self.base_total += base
        self.count += 1

    def accumulate_sum(self, weighted_sum: torch.Tensor, total_weight: float, count: int, staleness: int) -> None:
        """Add ``count`` updates already summed elsewhere (an edge aggregator's partial, all trained
        from one version): ``weighted_sum = sum_k w_k delta_k`` with this buffer's weighting, so the
        buffer gains ``s(t) sum_k w_k delta_k`` and ``sum_k w_k``, as ``count`` calls of
        :meth:`accumulate` with staleness ``t`` would add. The ``count`` updates all enter, even past
        K (a sum cannot be split): the flush then averages more than K. A robust rule needs each
        update and takes no sum."""
        if self.rule is not None:
            raise ValueError("a robust FedBuff combines single updates; it takes no sum of several")
        if count < 1 or not (total_weight > 0 and math.isfinite(total_weight)):
            raise ValueError(f"a sum of {count} updates of total weight {total_weight} adds nothing")
        if self._sum is None:
            self._sum = torch.zeros(weighted_sum.numel(), dtype=torch.float64, device=self.device)
        if weighted_sum.shape != self._sum.shape:
            raise ValueError(f"sum has shape {tuple(weighted_sum.shape)}, expected {tuple(self._sum.shape)}")
        self._sum.add_(weighted_sum.to(self.device, torch.float64), alpha=self.weight(staleness))
        self.base_total += total_weight
        self.count += count

    def flush(self, x: torch.Tensor) -> torch.Tensor:
        """One server-optimizer step with the buffer's average; empties the buffer."""
        if self.count == 0 or (self._sum is None and not self._held):
            raise RuntimeError("FedBuff.flush() with an empty buffer")
        if self.rule is not None:
            self.rule.reset()
            while self._held:  # hand each copy over and drop it: K + 1 copies at most
                d, w = self._held.pop(0)
                self.rule.add(d, w)
                del d
            mean = self.rule.mean().to(torch.float32)
            self.rule.reset()
        else:
            if self._sum is None:  # held updates restored from a robust FedBuff's state, and no rule
                raise RuntimeError("FedBuff.flush(): the buffer holds a robust rule's updates but no rule is set")
            mean = (self._sum / self.base_total).to(torch.float32)
            self._sum.zero_()
        new_x = self.optimizer.step(x, mean)
        self.count = 0
        self.base_total = 0.0
        return new_x

    def state_dict(self) -> BufferState:
        """The server optimizer's state plus the partly filled buffer (async servers
        have no quiet point between rounds, so the buffer is part of a checkpoint)."""
        state: BufferState = {f"opt.{k}": v for k, v in self.optimizer.state_dict().items()}
        state["count"] = self.count
        state["base_total"] = self.base_total
        if self._sum is not None:
            state["buffer"] = self._sum.detach().clone()
        if self._held:
            state["held"] = torch.stack([d for d, _ in self._held]).clone()
            state["held_weights"] = [w for _, w in self._held]
        return state

    def load_state_dict(self, state: BufferState) -> None:
        self.optimizer.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("opt.")})
        self.count = int(state["count"])
        self.base_total = float(state["base_total"])
        buf = state.get("buffer")
        self._sum = None if buf is None else torch.as_tensor(buf, dtype=torch.float64).to(self.device).clone()
        held = state.get("held")
        weights = state.get("held_weights", [])
        self._held = (
            []
            if held is None
            else [
                (torch.as_tensor(d, dtype=torch.float32).to(self.device).clone(), float(w))
                for d, w in zip(held, weights)
            ]
        )
