"""Helpers for a task's data: split one dataset into clients with shoal's partitioners.

``partition_dataset(ds, num_clients, "dirichlet", seed=..., labels=...)`` gives one
client dataset per client: for a tensor pair (or TensorDataset) a :class:`Partitioned`
view whose clients are tensor pairs (the simulator's fast path), for any other torch
Dataset a list of ``torch.utils.data.Subset``. ``"natural"`` groups samples by a key
function (a writer, a speaker, a hospital), as LEAF does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from . import partition
from .errors import DataError
from .task import ClientData, as_tensors

SCHEMES = ("iid", "dirichlet", "shards", "natural")


class Partitioned(Sequence):
    """Clients as index sets into one (x, y) tensor pair; ``self[i]`` is client i's pair.

    The simulator recognises it and gathers every client's rows into one device tensor
    with a single index operation, instead of copying client by client.
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor, parts: Sequence[np.ndarray]):
        self.x, self.y = x, y
        self.parts = [np.asarray(p, dtype=np.int64) for p in parts]

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Partitioned(self.x, self.y, self.parts[i])
        idx = torch.from_numpy(self.parts[i])
        return self.x[idx], self.y[idx]

    def size(self, i: int) -> int:
        return len(self.parts[i])


def _labels_of(data: Any, labels: Sequence[int] | np.ndarray | torch.Tensor | None) -> np.ndarray:
    if labels is not None:
        return np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels, dtype=np.int64)
    pair = as_tensors(data)
    if pair is not None:
        return pair[1].cpu().numpy().astype(np.int64)
    for attr in ("targets", "labels"):
        if hasattr(data, attr):
            t = getattr(data, attr)
            return np.asarray(t.cpu() if isinstance(t, torch.Tensor) else t, dtype=np.int64)
    return np.asarray([int(data[i][1]) for i in range(len(data))], dtype=np.int64)


def partition_dataset(
    data: ClientData,
    num_clients: int,
    scheme: str = "iid",
    seed: int = 0,
    *,
    labels: Sequence[int] | np.ndarray | torch.Tensor | None = None,
    alpha: float = 0.5,
    shards_per_client: int = 2,
    shard_size: int | None = None,
    key: Callable[[int], Hashable] | None = None,
) -> Sequence[ClientData]:
    """Split ``data`` into clients with one of shoal's partitioners.

    ``iid``: uniform; ``dirichlet``: label skew with concentration ``alpha`` (Hsu et al.
    2019); ``shards``: McMahan et al.'s sort-by-label shards; ``natural``: one client per
    value of ``key(i)`` (sample index -> group), in order of first appearance. Labels for
    the label-based schemes come from ``labels``, the pair's y, or the dataset's
    ``targets``. Same arguments and seed, same split.
    """
    if scheme not in SCHEMES:
        raise DataError(f"partition scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    n = len(data[1]) if isinstance(data, tuple) else len(data)  # type: ignore[arg-type]
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    if scheme == "natural":
        if key is None:
            raise DataError("partition scheme 'natural' needs key=, a function from a sample index to its group")
        groups: dict[Hashable, list[int]] = {}
        for i in range(n):
            groups.setdefault(key(i), []).append(i)
        parts = [np.asarray(v, dtype=np.int64) for v in groups.values()]
    elif scheme == "iid":
        parts = partition.iid(n, num_clients, rng)
    elif scheme == "dirichlet":
        parts = partition.dirichlet(_labels_of(data, labels), num_clients, alpha, rng)
    else:
        size = shard_size or max(1, n // (num_clients * shards_per_client))
        parts = partition.shards(_labels_of(data, labels), num_clients, shards_per_client, size, rng)
    pair = as_tensors(data)
    if pair is not None:
        return Partitioned(pair[0], pair[1], parts)
    if not isinstance(data, Dataset):
        raise DataError(f"cannot partition a {type(data).__name__}: give an (x, y) tensor pair or a torch Dataset")
    return [Subset(data, p.tolist()) for p in parts]
