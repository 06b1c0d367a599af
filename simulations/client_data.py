"""The simulated clients' data, from the task: checked once, then held for every round.

Clients whose data are tensors are gathered into one device-resident tensor pair with a
slice per client (the batched trainer and every in-memory path read it without copies);
clients whose data are torch Datasets stay Datasets and train through a DataLoader.

A task's :class:`~shoal.task.Population` is not held: :class:`PopulationShards` keeps each
client's id and example count and loads a client's data when a round trains it, so memory
follows the round's cohort, not the population (docs/tasks.md, "Populations").
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from shoal.config import Config
from shoal.datasets import FederatedData
from shoal.errors import ConfigError
from shoal.task import (
    ClientData,
    Population,
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
    if type(task).simulation_data is Task.simulation_data and type(task).population is not Task.population:
        raise ConfigError(
            f"task {task_name(task)} gives its clients as a population() (loaded one client at a time), "
            "but this job needs every client's data at once through simulation_data() (gossip, the Flower "
            "engine, privacy-sweep, data split, peer --data client:i); implement simulation_data() in the "
            "task, or use `shoal simulate` with the in-process engine (sync or async)"
        )
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


def load_population(task: Task, cfg: Config) -> Population | None:
    """``task.population(num_clients, seed)``, checked; None when the task gives none."""
    sim = cfg.simulation
    pop = call_part(task, "population(num_clients, seed)", task.population, sim.num_clients, sim.seed)
    return None if pop is None else check_population(task, pop)


def check_population(task: Task, pop: object) -> Population:
    missing = [m for m in ("__len__", "num_examples", "train_data") if not callable(getattr(pop, m, None))]
    if missing:
        raise TaskError(
            f"task {task_name(task)}: population() returned a {type(pop).__name__} without "
            f"{', '.join(missing)}; return a shoal.Population subclass"
        )
    n = call_part(task, "len(population)", len, pop)
    if n <= 0:
        raise TaskError(f"task {task_name(task)}: population() has no clients (len = {n})")
    return pop  # type: ignore[return-value]


def _each(task: Task, part: str, fn, n: int) -> list:
    """``fn(i)`` for every client; an exception names the part and the client."""
    out = []
    i = 0
    try:
        for i in range(n):
            out.append(fn(i))
    except NotImplementedError:
        raise TaskError(f"task {task_name(task)}: {part} is not implemented") from None
    except Exception as e:
        raise TaskError(f"task {task_name(task)}: {part} failed for client {i}: {type(e).__name__}: {e}") from None
    return out


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

    def max_size(self) -> int:
        return int(np.diff(self.bounds).max(initial=0))

    def total_examples(self) -> int:
        return int(self.bounds[-1])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's input shape (in-memory data)."""
        return tuple(self.x.shape[1:])

    @property
    def example(self) -> torch.Tensor:
        """A batch of one input, with the data's dtype (what the batched path probes the model with)."""
        return self.x[:1]

    def gather(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Clients ``idx`` as ``(x, y, starts, sizes)``: here the held tensors, no copy."""
        return self.x, self.y, [int(self.bounds[i]) for i in idx], [self.size(i) for i in idx]

    def flip_labels(self, idx: list[int], num_classes: int) -> None:
        """Label ``c`` becomes ``num_classes - 1 - c`` for clients ``idx`` (the label-flip attack)."""
        for i in idx:
            _, y = self.get(i)
            y.copy_(num_classes - 1 - y)


class PopulationShards:
    """A :class:`~shoal.task.Population` as the engine reads clients: ids and example counts
    held (cheap, O(population) integers), data loaded when asked for and not kept, except the
    last client loaded (so the load check and a first training do not read it twice)."""

    def __init__(self, task: Task, population: Population, device: torch.device):
        self.task, self.population, self.device = task, population, device
        n = len(population)
        self.client_ids = [str(c) for c in _each(task, "population.client_id(i)", population.client_id, n)]
        if len(set(self.client_ids)) != n:
            raise TaskError(f"task {task_name(task)}: population.client_id(i) must give {n} distinct names")
        sizes = _each(task, "population.num_examples(i)", population.num_examples, n)
        if not all(isinstance(s, (int, np.integer)) and s >= 0 for s in sizes):
            raise TaskError(f"task {task_name(task)}: population.num_examples(i) must be integers >= 0")
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.has_test = type(population).test_data is not Population.test_data
        self._flipped: set[int] = set()
        self._num_classes = 0
        self._last: tuple[int, ClientData] | None = None
        first = as_tensors(self.data(0))
        self._pair = first is not None
        self._input_shape = tuple(first[0].shape[1:]) if first is not None else ()
        self._example = first[0][:1].clone() if first is not None else torch.zeros(1)

    @property
    def in_memory(self) -> bool:
        """True when clients' data are tensors (gathered per round for the batched trainer)."""
        return self._pair

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example's input shape (client 0's; tensor data)."""
        return self._input_shape

    @property
    def example(self) -> torch.Tensor:
        """A batch of one input (client 0's first), with the data's dtype."""
        return self._example

    def __len__(self) -> int:
        return len(self.sizes)

    def size(self, i: int) -> int:
        return int(self.sizes[i])

    def max_size(self) -> int:
        return int(self.sizes.max(initial=0))

    def total_examples(self) -> int:
        return int(self.sizes.sum())

    def data(self, i: int) -> ClientData:
        """Client i's training data, loaded now (checked, on the device, labels flipped if it attacks)."""
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        task = self.task
        what = f"population.train_data({i})"
        raw = call_part(task, what, self.population.train_data, i)
        data = check_data(task, raw, what)
        assert data is not None
        if num_examples(data) != self.sizes[i]:
            raise TaskError(
                f"task {task_name(task)}: {what} has {num_examples(data)} examples but "
                f"population.num_examples({i}) said {int(self.sizes[i])}; they must agree"
            )
        data = on_device(data, self.device)
        assert data is not None
        if i in self._flipped:
            pair = as_tensors(data)
            if pair is None:
                raise TaskError(
                    f"task {task_name(task)}: {what} is a torch Dataset, whose labels the label-flip "
                    "attack cannot change; give (x, y) tensors to use attack.kind = 'label_flip'"
                )
            data = (pair[0], self._num_classes - 1 - pair[1])
        self._last = (i, data)
        return data

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = as_tensors(self.data(i))
        if pair is None:
            raise TaskError(
                f"task {task_name(self.task)}: population.train_data({i}) is a torch Dataset, not tensors; "
                "this path needs (x, y) tensors from every client"
            )
        return pair

    def gather(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Clients ``idx`` loaded and concatenated into one tensor pair (the round's cohort only)."""
        sizes = [self.size(i) for i in idx]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64).tolist() if idx else []
        x = y = None
        for i, a, n in zip(idx, starts, sizes):  # copied into place as loaded: one client held besides
            xi, yi = self.get(i)
            if x is None or y is None:
                x = xi.new_empty((sum(sizes), *xi.shape[1:]))
                y = yi.new_empty((sum(sizes), *yi.shape[1:]))
            if xi.shape[1:] != x.shape[1:] or xi.dtype != x.dtype or yi.dtype != y.dtype:
                raise TaskError(
                    f"task {task_name(self.task)}: population.train_data({i}) gives {xi.dtype} inputs of shape "
                    f"{tuple(xi.shape[1:])} (labels {yi.dtype}), unlike client {idx[0]}'s {x.dtype} "
                    f"{tuple(x.shape[1:])} (labels {y.dtype}); every client's tensors must match"
                )
            x[a : a + n], y[a : a + n] = xi, yi
        if x is None or y is None:
            return torch.zeros(0, device=self.device), torch.zeros(0, device=self.device), [], []
        return x, y, starts, sizes

    def test_data(self, i: int) -> ClientData | None:
        what = f"population.test_data({i})"
        raw = call_part(self.task, what, self.population.test_data, i)
        return on_device(check_data(self.task, raw, what, allow_none=True), self.device)

    def flip_labels(self, idx: list[int], num_classes: int) -> None:
        """Clients ``idx`` train on labels ``num_classes - 1 - y``, flipped as each is loaded."""
        self._flipped.update(idx)
        self._num_classes = num_classes
        self._last = None


def on_device(data: ClientData | None, device: torch.device) -> ClientData | None:
    """Tensor data moved to ``device`` once; Datasets as they are."""
    pair = as_tensors(data) if data is not None else None
    return (pair[0].to(device), pair[1].to(device)) if pair is not None else data
