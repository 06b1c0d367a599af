"""shoal's built-in models and datasets, as tasks through the same API as a user's.

With no ``[task] app``, every job uses :class:`BuiltinTask` made from ``[model] name``
and ``[data]`` (synthetic, mnist, fashion-mnist, femnist): the model of shoal.models,
the split of shoal.datasets, cross-entropy and accuracy. It can also be named
explicitly, ``--task shoal.tasks:BuiltinTask`` with ``[task.args]`` such as
``dataset = "mnist"``, ``dir = "..."``, ``model = "2nn"``.

:class:`SyntheticPopulationTask` (``--task shoal.tasks:SyntheticPopulationTask``) is
Synthetic(alpha, beta) as a lazily loaded population: 100,000 clients cost their ids and
sizes, and a round loads only the clients it selects.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import DataConfig
from .datasets import load_federated, model_io
from .errors import ConfigError
from .models import build_model
from .shards import Shard, load_shard
from .synthetic import DIMENSION, NUM_CLASSES, SyntheticPopulation
from .task import LocalData, SimulationData, Task
from .task_data import Partitioned


class BuiltinTask(Task):
    """A model of shoal.models on a dataset of shoal.datasets (cross-entropy, accuracy)."""

    def __init__(
        self,
        model: str = "logreg",
        data: DataConfig | None = None,
        num_clients: int = 30,
        seed: int = 0,
        **data_keys: Any,
    ):
        if data is None:
            known = {f.name for f in dataclasses.fields(DataConfig)}
            unknown = sorted(set(data_keys) - known)
            if unknown:
                raise ConfigError(
                    f"BuiltinTask: unknown [task.args] {', '.join(unknown)} (known: model, {', '.join(sorted(known))})"
                )
            data = DataConfig(**data_keys)
            data.validate()
        self.data_cfg = data
        self.model_name = model
        self.num_clients, self.seed = num_clients, seed  # the split central_test_data() reads (synthetic)
        self.input_shape, self.num_classes = model_io(data)

    def model(self) -> nn.Module:
        return build_model(self.model_name, self.input_shape, self.num_classes)

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        fed = load_federated(self.data_cfg, num_clients, seed)
        return SimulationData(
            train=Partitioned(fed.train.x, fed.train.y, fed.client_indices),
            test=(fed.test.x, fed.test.y),
        )

    def local_data(self, path: Path) -> LocalData:
        """A shard file written by ``shoal data split`` (or a folder holding one)."""
        shard = load_shard(path)
        return LocalData(train=(shard.x, shard.y))

    def central_test_data(self):
        """The dataset's held-out test set (what ``shoal server`` evaluated before tasks existed)."""
        fed = load_federated(self.data_cfg, self.num_clients, self.seed)
        return fed.test.x, fed.test.y

    def describe(self) -> str:
        return f"{self.data_cfg.dataset} / {self.model_name}"


class SyntheticPopulationTask(Task):
    """Logistic regression on Synthetic(alpha, beta) clients generated one at a time from
    ``(data_seed, client index)`` (shoal.synthetic.SyntheticPopulation): no download, any size.

    The population is the same for every ``simulation.seed`` (that seed still picks the model's
    start and the clients of each round). Its central test set is the test data of the first
    ``test_clients`` clients (of the population, at most all of them); each client's own test
    data serve federated evaluation. Every client has its own W_k, so a global model reaches a
    modest accuracy on clients a run has rarely or never sampled: this task measures scale
    (memory, time), not accuracy.
    """

    num_classes = NUM_CLASSES

    def __init__(
        self, alpha: float = 1.0, beta: float = 1.0, iid: bool = False, data_seed: int = 0, test_clients: int = 100
    ):
        self.alpha, self.beta, self.iid, self.data_seed, self.test_clients = alpha, beta, iid, data_seed, test_clients
        self.num_clients = test_clients  # set by population() / simulation_data()

    def model(self) -> nn.Module:
        return build_model("logreg", (DIMENSION,), NUM_CLASSES)

    def population(self, num_clients: int, seed: int) -> SyntheticPopulation:
        return self._population(num_clients)

    def _population(self, num_clients: int) -> SyntheticPopulation:
        self.num_clients = num_clients
        return SyntheticPopulation(num_clients, self.alpha, self.beta, self.iid, self.data_seed)

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        """The same clients held in memory at once (for engines that need every client's data)."""
        pop = self._population(num_clients)
        return SimulationData(
            train=[pop.train_data(i) for i in range(num_clients)],
            test=self.central_test_data(),
            client_test=[pop.test_data(i) for i in range(num_clients)],
        )

    def central_test_data(self):
        n = min(self.test_clients, self.num_clients)
        pop = SyntheticPopulation(n, self.alpha, self.beta, self.iid, self.data_seed)
        parts = [pop.test_data(i) for i in range(n)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

    def describe(self) -> str:
        return f"synthetic population ({self.alpha:g}, {self.beta:g}) / logreg"


def builtin_local_data(task: BuiltinTask, shard: Shard) -> LocalData:
    """A shard of `shoal data split` for the built-in task: the model takes the shard's
    input shape and classes (as nodes did before tasks existed); the shard's own test data
    (``test_x`` / ``test_y``), when it has some, is the node's local test set."""
    task.input_shape = shard.input_shape
    task.num_classes = shard.num_classes or task.num_classes
    test = None if shard.test_x is None or shard.test_y is None else (shard.test_x, shard.test_y)
    return LocalData(train=(shard.x, shard.y), test=test)
