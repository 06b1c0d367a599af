"""A synchronous round of server aggregation: a streaming mean of the round's deltas,
then one server-optimizer step (the FedOpt framework, Reddi et al. 2021, Algorithm 1).

The two parts are separate objects so later rules swap one without the other: a robust
rule (median, trimmed mean) or a DP mean replaces the :class:`Aggregator`; FedBuff and
FedAsync reuse both with their own weights (the ``weight`` factor of ``accumulate``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from shoal.aggregation.mean import EmptyAggregate, WeightedMean
from shoal.aggregation.server_opt import ServerOptimizer, StateDict, make_server_optimizer
from shoal.config import StrategyConfig
from shoal.update import PartialSum, Update


class Aggregator(Protocol):
    """What a strategy needs from its averaging rule (:class:`WeightedMean` is one)."""

    @property
    def count(self) -> int: ...

    def reset(self) -> None: ...

    def add(self, delta: torch.Tensor, weight: float) -> None: ...

    def mean(self) -> torch.Tensor: ...


class Strategy:
    """``begin(x)``, ``accumulate(update)`` for each arriving update, ``finalize() -> x'``.

    Holds the aggregator's state and the optimizer's, never the updates themselves, so
    memory is O(model) however many clients report.
    """

    def __init__(self, aggregator: Aggregator, optimizer: ServerOptimizer, weighting: str = "examples"):
        if weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting = {weighting!r} must be 'examples' or 'uniform'")
        self.aggregator = aggregator
        self.optimizer = optimizer
        self.weighting = weighting
        self._global: torch.Tensor | None = None

    def broadcast(self) -> dict[str, torch.Tensor] | None:
        """Tensors that travel to the clients beside the model (SCAFFOLD's control variate); none here."""
        return None

    def bind_population(self, num_clients: int) -> None:
        """The population N, for a step that divides by it (FedDyn's, SCAFFOLD's); nothing here."""

    def begin(self, global_flat: torch.Tensor) -> None:
        """Start a round from the global parameters the clients were sent (not modified)."""
        self.aggregator.reset()
        self._global = global_flat

    def accumulate(self, update: Update, weight: float = 1.0) -> None:
        """Add one update with weight ``base * weight``: ``base`` is its example count n_k
        under ``examples`` weighting (FedAvg's w <- sum_k n_k/n w_k, McMahan et al. 2017,
        Algorithm 1), else 1; ``weight`` is a further factor such as a staleness discount."""
        self.aggregator.add(update.delta, self._weight(update) * weight)

    def _weight(self, update: Update) -> float:
        if self._global is None:
            raise RuntimeError("accumulate() before begin(): start the round with the global parameters")
        if self.weighting == "examples" and update.num_examples <= 0:
            who = update.sender or "a client"
            raise ValueError(
                f"update from {who} has num_examples = {update.num_examples}; examples weighting needs > 0"
            )
        return update.num_examples if self.weighting == "examples" else 1

    def accumulate_blocks(self, update: Update, blocks: Iterable[torch.Tensor], weight: float = 1.0) -> None:
        """:meth:`accumulate` of an update whose delta comes as consecutive pieces instead of
        ``update.delta`` (a staged upload read back a block at a time, no model-sized copy). Only
        this class with a plain :class:`WeightedMean` takes them: a robust rule, a DP mean or a
        subclass's own rule looks at each update whole."""
        if type(self) is not Strategy or type(self.aggregator) is not WeightedMean:
            raise TypeError(f"{type(self).__name__} with {type(self.aggregator).__name__} needs each update whole")
        self.aggregator.add_blocks(blocks, self._weight(update) * weight)

    def accumulate_sum(self, part: PartialSum) -> None:
        """Add a partial sum of several updates (shoal.update.PartialSum), weighted as this strategy
        weighs them. Only a plain :class:`WeightedMean` can take one: a robust rule or a DP mean
        must see each update."""
        if self._global is None:
            raise RuntimeError("accumulate_sum() before begin(): start the round with the global parameters")
        if part.weighting != self.weighting:
            raise ValueError(f"a partial sum weighted by {part.weighting!r} reached a {self.weighting!r} strategy")
        agg = self.aggregator
        if not isinstance(agg, WeightedMean) or type(agg) is not WeightedMean:  # subclasses may look at each
            raise TypeError(f"{type(agg).__name__} needs each update, not a partial sum")
        agg.add_sum(part.weighted_sum, part.total_weight, len(part.senders))

    @property
    def num_accumulated(self) -> int:
        return self.aggregator.count

    def finalize(self) -> torch.Tensor:
        """The new global parameters (a new tensor); the round is closed."""
        if self._global is None:
            raise RuntimeError("finalize() before begin(): no round is open")
        if self.aggregator.count == 0:
            raise EmptyAggregate("finalize() with no accumulated update: keep the current global model instead")
        agg = self.aggregator
        if isinstance(agg, WeightedMean) and agg.dtype == torch.float32:
            # a float32 sum becomes the mean in place, and the new model in place of the mean (where
            # the optimizer can): at a round's end the server holds the old model and one buffer
            new_global = self.optimizer.step_into(self._global, agg.take_mean())
            self._global = None
            return new_global
        mean = agg.mean()
        # the sum is let go before the new model is made: at a round's end the server holds the old
        # model, the mean and the new one, not also a float64 sum (twice the model)
        getattr(agg, "release", agg.reset)()
        new_global = self.optimizer.step(self._global, mean)
        self._global = None
        return new_global

    def state_dict(self) -> StateDict:
        """What must survive a restart between rounds: the server optimizer's state.
        An open round is not included; checkpoint after :meth:`finalize`."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.optimizer.load_state_dict(state)


def make_strategy(
    cfg: StrategyConfig, numel: int, device: torch.device | str = "cpu", aggregator: Aggregator | None = None
) -> Strategy:
    """The strategy a ``[strategy]`` config table describes, for a model of ``numel`` parameters;
    ``aggregator`` replaces the weighted mean (e.g. a robust rule, aggregation/robust.py)."""
    return Strategy(
        WeightedMean(numel, device) if aggregator is None else aggregator, make_server_optimizer(cfg), cfg.weighting
    )
