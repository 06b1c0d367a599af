"""NIID-Bench's MNIST setting (Li et al. 2022, "Federated Learning on Non-IID Data Silos"):
its small CNN and its two label-skew splits, for comparing FedAvg, FedProx, SCAFFOLD and FedNova.

- ``split = "dirichlet"``: each class spread over the clients by Dir(``beta``) proportions
  (shoal.partition.dirichlet, the benchmark's "noniid-labeldir", at least 10 samples a client);
- ``split = "labels"``: client i holds ``labels`` distinct labels, label i mod 10 and others
  drawn at random; each label's images are cut evenly among the clients holding it (the
  benchmark's "#C=k"). A label nobody drew is left out.

The model is the benchmark's CNN for MNIST: conv 5x5 (6) - pool - conv 5x5 (16) - pool -
fc 120 - fc 84 - fc 10, ReLU. The central test set is MNIST's test set. The benchmark's settings
(10 clients, all in every round, 50 rounds, E = 10, B = 64, SGD lr 0.01, momentum 0.9):

    shoal simulate --task examples/tasks/niid_bench.py:NiidBench --set task.args.data_dir=PATH \\
        --set task.args.split=labels --set simulation.num_clients=10 --set simulation.clients_per_round=10 \\
        --set simulation.rounds=50 --set train.epochs=10 --set train.batch_size=64 --set train.lr=0.01 \\
        --set train.momentum=0.9 --set algorithm.name=scaffold
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shoal.config import DataConfig
from shoal.datasets import load_federated
from shoal.partition import dirichlet
from shoal.task import SimulationData, Task


class NiidCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 6, 5), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 4 * 4, 120), nn.Linear(120, 84), nn.Linear(84, 10)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.fc1(x.flatten(1)))
        return self.fc3(torch.relu(self.fc2(x)))


def label_split(y: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The "#C=k" split: client i holds label i mod 10 and k - 1 other distinct labels."""
    classes = 10
    holds = []
    for i in range(num_clients):
        mine = [i % classes]
        while len(mine) < k:
            c = int(rng.integers(classes))
            if c not in mine:
                mine.append(c)
        holds.append(mine)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(classes):
        who = [i for i in range(num_clients) if c in holds[i]]
        if not who:
            continue
        for i, chunk in zip(who, np.array_split(rng.permutation(np.flatnonzero(y == c)), len(who))):
            parts[i].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


class NiidBench(Task):
    num_classes = 10

    def __init__(self, data_dir: str, split: str = "dirichlet", beta: float = 0.5, labels: int = 2):
        if split not in ("dirichlet", "labels"):
            raise ValueError(f"split = {split!r}: expected 'dirichlet' or 'labels'")
        self.data_dir, self.split, self.beta, self.labels = data_dir, split, beta, labels

    def model(self) -> nn.Module:
        return NiidCnn()

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        fed = load_federated(DataConfig(dataset="mnist", dir=self.data_dir, partition="iid"), 1, seed)
        x, y = fed.train.x, fed.train.y
        rng = np.random.default_rng(seed)
        if self.split == "dirichlet":
            parts = dirichlet(y.numpy(), num_clients, self.beta, rng, min_size=10)
        else:
            parts = label_split(y.numpy(), num_clients, self.labels, rng)
        train = []
        for p in parts:
            idx = torch.as_tensor(p, dtype=torch.long)
            train.append((x[idx], y[idx]))
        return SimulationData(train=train, test=(fed.test.x, fed.test.y))

    def describe(self) -> str:
        what = f"Dir({self.beta})" if self.split == "dirichlet" else f"#C={self.labels}"
        return f"mnist {what} / NIID-Bench CNN"
