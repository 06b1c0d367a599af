"""Split a pooled training set into client shards (IID and the standard non-IID splits).

Every function takes the caller's ``np.random.Generator`` (so a seed fixes the split)
and returns one int64 index array per client, sorted within the client. ``iid`` and
``dirichlet`` place every sample in exactly one client; ``shards`` places each sample
in at most one (McMahan's split leaves samples over when the shards do not cover them).
"""

from __future__ import annotations

import numpy as np

from .errors import DataError

_DIRICHLET_TRIES = 100


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def _check_clients(num_clients: int) -> None:
    if num_clients < 1:
        raise DataError(f"cannot partition into {num_clients} clients: need at least 1")


def iid(n: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A uniformly random split; client sizes differ by at most 1."""
    _check_clients(num_clients)
    if num_clients > n:
        raise DataError(f"iid partition: {n} samples cannot fill {num_clients} clients; use fewer clients")
    return _finish(np.array_split(rng.permutation(n), num_clients))


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
) -> list[np.ndarray]:
    """Label-skewed split: each class is spread over clients by proportions ~ Dir(alpha).

    This is the split of Hsu et al. 2019 as implemented by Yurochkin et al. 2019 and
    NIID-Bench (Li et al. 2022): a client that already holds its fair share (n / clients)
    gets no more of the later classes, which keeps sizes from running away, and the whole
    draw is repeated until every client has ``min_size`` samples. Small alpha: each client
    sees few classes; large alpha: close to IID.
    """
    _check_clients(num_clients)
    if alpha <= 0:
        raise DataError(f"dirichlet partition: alpha = {alpha} must be > 0 (data.dirichlet_alpha)")
    labels = np.asarray(labels)
    n = len(labels)
    if num_clients * min_size > n:
        raise DataError(
            f"dirichlet partition: {n} samples cannot give {num_clients} clients {min_size} each; use fewer clients"
        )
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    fair_share = n / num_clients
    for _ in range(_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            capped = p * (sizes < fair_share)
            if capped.sum() > 0:
                p = capped / capped.sum()
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
                sizes[k] += len(chunk)
        if sizes.min() >= min_size:
            return _finish([np.concatenate(p) for p in parts])
    raise DataError(
        f"dirichlet partition: no draw in {_DIRICHLET_TRIES} tries gave each of {num_clients} clients "
        f"at least {min_size} of {n} samples with alpha = {alpha}; raise data.dirichlet_alpha or use fewer clients"
    )


def shards(
    labels: np.ndarray,
    num_clients: int,
    shards_per_client: int,
    shard_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """McMahan et al. 2017's pathological non-IID split.

    Sort by label, cut into shards of ``shard_size`` consecutive samples and give each
    client ``shards_per_client`` shards drawn at random without replacement, so a client
    sees at most that many labels (a shard straddling a label boundary adds one). MNIST
    in the paper: 200 shards of 300, 2 per client, 100 clients. Samples in no drawn shard
    belong to no client.
    """
    _check_clients(num_clients)
    if shards_per_client < 1 or shard_size < 1:
        raise DataError(
            f"shards partition: shards_per_client = {shards_per_client} and shard_size = {shard_size} must be >= 1"
        )
    labels = np.asarray(labels)
    n = len(labels)
    needed = num_clients * shards_per_client
    if needed * shard_size > n:
        raise DataError(
            f"shards partition: {num_clients} clients x {shards_per_client} shards x {shard_size} samples "
            f"= {needed * shard_size} > {n} samples; lower data.shard_size, data.shards_per_client or the clients"
        )
    order = np.argsort(labels, kind="stable")
    chosen = rng.permutation(n // shard_size)[:needed].reshape(num_clients, shards_per_client)
    return _finish([np.concatenate([order[s * shard_size : (s + 1) * shard_size] for s in row]) for row in chosen])
