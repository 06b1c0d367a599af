"""Partitioners: every sample has one owner, a seed fixes the split, the skew is the one asked for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal import partition
from shoal.errors import DataError


def _check_disjoint(parts: list[np.ndarray], n: int, exact: bool = True) -> None:
    for p in parts:
        assert p.dtype == np.int64
        assert np.all(np.diff(p) > 0), "indices are sorted and unique within a client"
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "no sample in two clients"
    assert allidx.min(initial=0) >= 0 and allidx.max(initial=-1) < n
    if exact:
        assert len(allidx) == n, "every sample in a client"


def _label_entropy(parts: list[np.ndarray], labels: np.ndarray, num_classes: int) -> float:
    """Mean over clients of the entropy (bits) of the client's label histogram."""
    ent = []
    for p in parts:
        q = np.bincount(labels[p], minlength=num_classes) / len(p)
        q = q[q > 0]
        ent.append(-(q * np.log2(q)).sum())
    return float(np.mean(ent))


def _mnist_like_labels(rng: np.random.Generator, n: int = 6000) -> np.ndarray:
    return rng.integers(0, 10, n)


# --- iid ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 2000), k=st.integers(1, 200), seed=st.integers(0, 2**32 - 1))
def test_iid_every_sample_once_and_balanced(n: int, k: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if k > n:
        with pytest.raises(DataError, match="clients"):
            partition.iid(n, k, rng)
        return
    parts = partition.iid(n, k, rng)
    assert len(parts) == k
    _check_disjoint(parts, n)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_iid_deterministic_per_seed() -> None:
    a = partition.iid(1000, 7, np.random.default_rng(3))
    b = partition.iid(1000, 7, np.random.default_rng(3))
    c = partition.iid(1000, 7, np.random.default_rng(4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


# --- dirichlet -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 1500),
    k=st.integers(1, 60),
    classes=st.integers(1, 12),
    alpha=st.floats(0.01, 1000.0),
    min_size=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
)
def test_dirichlet_every_sample_once(n: int, k: int, classes: int, alpha: float, min_size: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n)
    try:
        parts = partition.dirichlet(labels, k, alpha, rng, min_size=min_size)
    except DataError as e:
        # Allowed only as a clear refusal: too few samples, or no draw met min_size.
        assert "clients" in str(e)
        return
    assert len(parts) == k
    _check_disjoint(parts, n)
    assert min(len(p) for p in parts) >= min_size


def test_dirichlet_deterministic_per_seed() -> None:
    labels = _mnist_like_labels(np.random.default_rng(0))
    a = partition.dirichlet(labels, 20, 0.5, np.random.default_rng(11))
    b = partition.dirichlet(labels, 20, 0.5, np.random.default_rng(11))
    c = partition.dirichlet(labels, 20, 0.5, np.random.default_rng(12))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_small_alpha_skews_labels() -> None:
    labels = _mnist_like_labels(np.random.default_rng(0))
    skewed = partition.dirichlet(labels, 50, 0.1, np.random.default_rng(1), min_size=10)
    near_iid = partition.dirichlet(labels, 50, 100.0, np.random.default_rng(1), min_size=10)
    h_skewed, h_iid = _label_entropy(skewed, labels, 10), _label_entropy(near_iid, labels, 10)
    # log2(10) = 3.32 bits is a perfectly mixed client.
    assert h_iid > 3.1
    assert h_skewed < 2.0
    assert h_iid - h_skewed > 1.5


def test_dirichlet_refuses_impossible_min_size() -> None:
    with pytest.raises(DataError, match="clients"):
        partition.dirichlet(np.zeros(10, dtype=np.int64), 5, 1.0, np.random.default_rng(0), min_size=3)
    with pytest.raises(DataError, match="dirichlet_alpha"):
        partition.dirichlet(np.zeros(10, dtype=np.int64), 2, 0.0, np.random.default_rng(0))


def test_dirichlet_bounded_retries_then_error() -> None:
    # One class, tiny alpha: one client takes nearly everything, so no draw splits 10 as 5 + 5.
    with pytest.raises(DataError, match="tries"):
        partition.dirichlet(np.zeros(10, dtype=np.int64), 2, 0.001, np.random.default_rng(0), min_size=5)


# --- shards ----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    classes=st.integers(1, 10),
    shards_per_class=st.integers(1, 6),
    shard_size=st.integers(1, 20),
    spc=st.integers(1, 4),
    k=st.integers(1, 30),
    seed=st.integers(0, 2**32 - 1),
)
def test_shards_labels_per_client(
    classes: int, shards_per_class: int, shard_size: int, spc: int, k: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    # Each class fills whole shards, so a shard holds one label; shuffle to make sorting matter.
    labels = rng.permutation(np.repeat(np.arange(classes), shards_per_class * shard_size))
    n = len(labels)
    if k * spc * shard_size > n:
        with pytest.raises(DataError, match="shard"):
            partition.shards(labels, k, spc, shard_size, rng)
        return
    parts = partition.shards(labels, k, spc, shard_size, rng)
    assert len(parts) == k
    _check_disjoint(parts, n, exact=k * spc * shard_size == n)
    for p in parts:
        assert len(p) == spc * shard_size
        assert len(np.unique(labels[p])) <= spc


def test_shards_mcmahan_mnist_layout() -> None:
    labels = np.repeat(np.arange(10), 6000)
    parts = partition.shards(labels, 100, 2, 300, np.random.default_rng(0))
    _check_disjoint(parts, 60000, exact=False)
    assert sum(len(p) for p in parts) == 60000
    distinct = [len(np.unique(labels[p])) for p in parts]
    assert max(distinct) <= 2
    assert np.mean(distinct) > 1.5  # most clients get two different digits


def test_shards_deterministic_per_seed() -> None:
    labels = np.repeat(np.arange(10), 600)
    a = partition.shards(labels, 10, 2, 300, np.random.default_rng(5))
    b = partition.shards(labels, 10, 2, 300, np.random.default_rng(5))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_shards_too_many_requested_is_an_error() -> None:
    with pytest.raises(DataError, match="shard_size"):
        partition.shards(np.zeros(1000, dtype=np.int64), 10, 2, 60, np.random.default_rng(0))
