"""Server-side aggregation: pure math over updates, no I/O (DESIGN.md).

A :class:`Strategy` streams a round's updates into an :class:`Aggregator` (memory
O(model)) and turns their mean into new global parameters with a
:class:`ServerOptimizer` (FedAvg, FedAvgM, FedAdagrad, FedAdam, FedYogi).
"""

from shoal.aggregation.fedasync import FedAsync
from shoal.aggregation.fedbuff import FedBuff
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
from shoal.aggregation.staleness import make_staleness_weight, staleness_weight
from shoal.aggregation.strategy import Aggregator, Strategy, make_strategy

__all__ = [
    "Aggregator",
    "EmptyAggregate",
    "FedAdagrad",
    "FedAdam",
    "FedAvgM",
    "FedBuff",
    "FedAsync",
    "FedAvgOpt",
    "FedYogi",
    "ServerOptimizer",
    "Strategy",
    "WeightedMean",
    "make_server_optimizer",
    "make_staleness_weight",
    "make_strategy",
    "staleness_weight",
]
