"""Server-side aggregation: pure math over updates, no I/O (DESIGN.md).

A :class:`Strategy` streams a round's updates into an :class:`Aggregator` (memory
O(model)) and turns their mean into new global parameters with a
:class:`ServerOptimizer` (FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi).
"""

from shoal.aggregation.mean import EmptyAggregate, WeightedMean
from shoal.aggregation.server_opt import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedAvgOpt,
    FedYogi,
    ServerOptimizer,
    make_server_optimizer,
)
from shoal.aggregation.strategy import Aggregator, Strategy, make_strategy

__all__ = [
    "Aggregator",
    "EmptyAggregate",
    "FedAdagrad",
    "FedAdam",
    "FedAvgM",
    "FedAvgOpt",
    "FedYogi",
    "ServerOptimizer",
    "Strategy",
    "WeightedMean",
    "make_server_optimizer",
    "make_strategy",
]
