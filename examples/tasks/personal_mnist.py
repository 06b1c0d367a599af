"""MNIST with a few classes per client, each client with its own test data: a task for
personalised federated learning (Ditto, FedPer, FedRep; docs/algorithms.md).

Client i holds ``classes_per_client`` labels (i, i+1, ... modulo 10); each label's training
and test images are dealt evenly among the clients that hold it, so a client's test data has
its own labels (``train_per_client`` > 0 keeps that many training images per client). The
model is an MLP body and a linear ``head``, which ``personal`` keeps on each client
under algorithm.name = "fedper" / "fedrep".

    shoal simulate --task examples/tasks/personal_mnist.py:PersonalMnist \\
        --set task.args.data_dir=/path/to/mnist --set algorithm.name=fedrep
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from shoal.config import DataConfig
from shoal.datasets import load_federated
from shoal.task import SimulationData, Task


class PersonalMnist(Task):
    personal = ("head",)
    num_classes = 10

    def __init__(self, data_dir: str, classes_per_client: int = 2, hidden: int = 200, train_per_client: int = 0):
        self.data_dir, self.k, self.hidden = data_dir, classes_per_client, hidden
        self.train_per_client = train_per_client  # > 0: keep only this many training images per client

    def model(self) -> nn.Module:
        body = nn.Sequential(nn.Flatten(), nn.Linear(784, self.hidden), nn.ReLU(), nn.Linear(self.hidden, self.hidden))
        return nn.Sequential(OrderedDict(body=body, act=nn.ReLU(), head=nn.Linear(self.hidden, 10)))

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        cfg = DataConfig(dataset="mnist", dir=self.data_dir, partition="iid")
        fed = load_federated(cfg, 1, seed)
        rng = np.random.default_rng(seed)
        holders = {c: [i for i in range(num_clients) if c in self.labels(i)] for c in range(10)}

        def deal(y: torch.Tensor) -> list[list[int]]:
            parts: list[list[int]] = [[] for _ in range(num_clients)]
            for c, who in holders.items():
                idx = rng.permutation(np.flatnonzero(y.numpy() == c))
                for j, chunk in enumerate(np.array_split(idx, len(who)) if who else []):
                    parts[who[j]].extend(chunk.tolist())
            return parts

        train, test = deal(fed.train.y), deal(fed.test.y)
        if self.train_per_client > 0:
            train = [rng.permutation(p)[: self.train_per_client].tolist() for p in train]

        def take(x: torch.Tensor, y: torch.Tensor, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            i = torch.as_tensor(sorted(idx), dtype=torch.long)
            return x[i], y[i]

        return SimulationData(
            train=[take(fed.train.x, fed.train.y, p) for p in train],
            test=(fed.test.x, fed.test.y),
            client_test=[take(fed.test.x, fed.test.y, p) for p in test],
        )

    def labels(self, i: int) -> set[int]:
        return {(i + j) % 10 for j in range(self.k)}

    def describe(self) -> str:
        return f"mnist, {self.k} classes per client / mlp + personal head"
