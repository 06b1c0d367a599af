"""The built-in models and datasets, now tasks, give the numbers they gave before the task API.

The reference figures were measured with the code before the task API (commit 1e2dbe7) by
running two rounds of each case below and evaluating the global model; the task path must
reproduce the same global model (sum, norm), training loss and test metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.config import load_config
from shoal.simulations.inprocess import InProcessSimulation

SHARED = Path(__file__).resolve().parents[3] / "shared" / "datasets"
MNIST, FEMNIST = SHARED / "mnist-reconstructed", SHARED / "femnist-leaf"

CASES = {
    "synthetic_batched": (["simulation.rounds=3"], None),
    "synthetic_seq": (["simulation.rounds=3", "simulation.batch_clients=1", "train.momentum=0.5"], None),
    "mnist_2nn": (
        [
            'data.dataset="mnist"',
            f'data.dir="{MNIST}"',
            'data.partition="iid"',
            'model.name="2nn"',
            "simulation.num_clients=100",
            "simulation.clients_per_round=10",
            "train.lr=0.05",
        ],
        MNIST,
    ),
    "femnist_logreg_seq": (
        [
            'data.dataset="femnist"',
            f'data.dir="{FEMNIST}"',
            "data.max_clients=20",
            "simulation.batch_clients=1",
            "simulation.clients_per_round=5",
            "train.lr=0.01",
        ],
        FEMNIST,
    ),
}
REFERENCE = {
    "synthetic_batched": {
        "sum": -0.8384183736052364,
        "norm": 1.8884509276326347,
        "train_loss": 0.6963173340386641,
        "acc": 0.3190883190883191,
        "loss": 2.0519542378917377,
    },
    "synthetic_seq": {
        "sum": -0.8384181615547277,
        "norm": 1.904095688856586,
        "train_loss": 0.5883420691298106,
        "acc": 0.3190883190883191,
        "loss": 2.0190642528044873,
    },
    "mnist_2nn": {
        "sum": 204.02464931573533,
        "norm": 12.036290850080272,
        "train_loss": 1.8270455423990886,
        "acc": 0.7374,
        "loss": 1.3758081298828124,
    },
    "femnist_logreg_seq": {
        "sum": 1.8122149491846358,
        "norm": 4.545429131815072,
        "train_loss": 3.5908995006211413,
        "acc": 0.08552631578947369,
        "loss": 3.3945059525339225,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_builtin_task_reproduces_the_pre_task_api_numbers(name):
    args, needs = CASES[name]
    if needs is not None and not needs.is_dir():
        pytest.skip(f"{needs} is absent")
    sim = InProcessSimulation.from_config(load_config(None, args))
    for _ in range(2):
        summary = sim.run_round()
    ev = sim.evaluate()
    g = sim.global_params.double()
    want = REFERENCE[name]
    got = {
        "sum": float(g.sum()),
        "norm": float(g.norm()),
        "train_loss": summary.train_loss,
        "acc": ev["test_accuracy"],
        "loss": ev["test_loss"],
    }
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key  # float32 sums: thread count reorders them
