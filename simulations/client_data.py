"""The simulated clients' data, from the task: checked once, then held for every round.

Clients whose data are tensors are gathered into one device-resident tensor pair with a
slice per client (the batched trainer and every in-memory path read it without copies);
clients whose data are torch Datasets stay Datasets and train through a DataLoader.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from shoal.config import Config
from shoal.datasets import FederatedData
from shoal.task import (
    ClientData,
    SimulationData,
    Task,
    TaskError,
    as_tensors,
    call_part,
    check_data,
    num_examples,
    task_name,
)
from shoal.task_data import Partitioned

log = logging.getLogger(__name__)


def client_id(i: int) -> str:
    return f"client-{i:05d}"


def load_simulation_data(task: Task, cfg: Config) -> SimulationData:
    """``task.simulation_data(num_clients, seed)``, checked: one clear error per problem."""
    sim = cfg.simulation
    data = call_part(
        task,
        "simulation_data(num_clients, seed)",
        task.simulation_data,
        sim.num_clients,
        sim.seed,
        fix="implement simulation_data() to return shoal.SimulationData(train=[...per client...])",
    )
    return check_simulation_data(task, data)


def check_simulation_data(task: Task, data: object) -> SimulationData:
    if isinstance(data, FederatedData):  # shoal.datasets' split, as the built-in task gives it
        data = SimulationData(Partitioned(data.train.x, data.train.y, data.client_indices), (data.test.x, data.test.y))
    if not isinstance(data, SimulationData):
        raise TaskError(
            f"task {task_name(task)}: simulation_data() returned a {type(data).__name__}; "
            "return shoal.SimulationData(train=[one dataset per client], test=...)"
        )
    if len(data.train) == 0:
        raise TaskError(f"task {task_name(task)}: simulation_data() gave no clients (train is empty)")
    if not isinstance(data.train, Partitioned):
        for i, d in enumerate(data.train):
            check_data(task, d, f"simulation_data().train[{i}]")
    check_data(task, data.test, "simulation_data().test", allow_none=True)
    if data.client_test is not None:
        if len(data.client_test) != len(data.train):
            raise TaskError(
                f"task {task_name(task)}: client_test has {len(data.client_test)} entries for "
                f"{len(data.train)} clients; give one (or None) per client"
            )
        for i, ct in enumerate(data.client_test):
            check_data(task, ct, f"simulation_data().client_test[{i}]", allow_none=True)
    if data.client_ids is not None:
        ids = list(map(str, data.client_ids))
        if len(ids) != len(data.train) or len(set(ids)) != len(ids):
            raise TaskError(f"task {task_name(task)}: client_ids must be {len(data.train)} distinct names")
    return data


class ClientShards:
    """Every client's training data. Tensor clients: one tensor pair on the device, a slice each."""

    def __init__(self, clients: Sequence[ClientData], device: torch.device):
        self.device = device
        if isinstance(clients, Partitioned):
            parts = clients.parts
            order = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            idx = torch.as_tensor(order, dtype=torch.long)
            self.x, self.y = clients.x[idx].to(device), clients.y[idx].to(device)
            sizes = [len(p) for p in parts]
            self.datasets: list[ClientData] | None = None
        else:
            pairs = [as_tensors(c) for c in clients]
            if all(p is not None for p in pairs):
                self.x = torch.cat([p[0] for p in pairs]).to(device)  # type: ignore[index]
                self.y = torch.cat([p[1] for p in pairs]).to(device)  # type: ignore[index]
                sizes = [int(p[1].shape[0]) for p in pairs]  # type: ignore[index]
                self.datasets = None
            else:
                self.datasets = list(clients)
                sizes = [num_examples(c) for c in clients]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def in_memory(self) -> bool:
        """True when every client's data is a slice of one device tensor pair."""
        return self.datasets is None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client i's (x, y) slices (in-memory data only)."""
        if self.datasets is not None:
            raise TaskError(
                "this simulation's client data are torch Datasets, not tensors, so this feature "
                "cannot slice them; return (x, y) tensors from simulation_data() to use it"
            )
        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        return self.x[a:b], self.y[a:b]

    def data(self, i: int) -> ClientData:
        """Client i's data as the trainer takes it."""
        return self.get(i) if self.datasets is None else self.datasets[i]

    def size(self, i: int) -> int:
        return int(self.bounds[i + 1] - self.bounds[i])


def on_device(data: ClientData | None, device: torch.device) -> ClientData | None:
    """Tensor data moved to ``device`` once; Datasets as they are."""
    pair = as_tensors(data) if data is not None else None
    return (pair[0].to(device), pair[1].to(device)) if pair is not None else data
