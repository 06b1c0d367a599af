"""shoal's built-in models and datasets, as tasks through the same API as a user's.

With no ``[task] app``, every job uses :class:`BuiltinTask` made from ``[model] name``
and ``[data]`` (synthetic, mnist, fashion-mnist, femnist): the model of shoal.models,
the split of shoal.datasets, cross-entropy and accuracy. It can also be named
explicitly, ``--task shoal.tasks:BuiltinTask`` with ``[task.args]`` such as
``dataset = "mnist"``, ``dir = "..."``, ``model = "2nn"``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from torch import nn

from .config import DataConfig
from .datasets import load_federated, model_io
from .errors import ConfigError
from .models import build_model
from .shards import load_shard
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
