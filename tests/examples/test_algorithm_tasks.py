"""The example tasks behind docs/results.md's client-state tables: NIID-Bench's "#C=k" split
and the two-classes-per-client task (on MNIST when the shared copy is here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ..conftest import REPO

TASKS = REPO / "examples" / "tasks"
MNIST = REPO.parent / "shared" / "datasets" / "mnist-reconstructed"


def module(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", TASKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_niid_label_split_gives_each_client_k_labels_and_every_example_once():
    y = np.repeat(np.arange(10), 50)
    parts = module("niid_bench").label_split(y, 10, 2, np.random.default_rng(0))
    assert [len(set(y[p])) for p in parts] == [2] * 10
    assert all(i % 10 in set(y[p]) for i, p in enumerate(parts))
    used = np.concatenate(parts)
    assert len(used) == len(set(used.tolist()))  # no example in two clients


@pytest.mark.skipif(not Path(MNIST).exists(), reason="the shared MNIST copy is absent")
def test_personal_mnist_clients_are_tested_on_their_own_labels():
    task = module("personal_mnist").PersonalMnist(str(MNIST), train_per_client=50)
    data = task.simulation_data(12, 0)
    for i, ((_, y), (_, yt)) in enumerate(zip(data.train, data.client_test)):
        assert set(y.tolist()) == set(yt.tolist()) == task.labels(i) and len(y) == 50
