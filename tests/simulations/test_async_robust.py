"""Attacks, wire validation and robust FedBuff in the asynchronous simulator."""

import json

import pytest
import torch

from shoal.config import load_config
from shoal.datasets import load_federated
from shoal.simulations.async_engine import AsyncEngine
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ASYNC = [
    'simulation.mode="async"',
    "heterogeneity.speed_sigma=1.0",
    "heterogeneity.network_delay_s=0.5",
    "output.plots=false",
]


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_nan_attackers_are_rejected_counted_and_bytes_recorded(tmp_path, algorithm):
    c = load_config(
        None,
        [
            *ASYNC,
            "simulation.num_clients=20",
            "simulation.rounds=6",
            "asynchronous.buffer_size=4",
            "asynchronous.concurrency=6",
            f'asynchronous.algorithm="{algorithm}"',
            'attack.kind="nan"',
            "attack.fraction=0.25",
        ],
    )
    summary = run_simulation(c, tmp_path)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rejected = summary["updates_rejected"].get("non_finite", 0)
    assert rejected > 0 and summary["updates_rejected_total"] == rejected
    assert recs[-1]["rejected"] == {"non_finite": rejected}
    assert summary["version"] == 6 and all(r["test_loss"] == r["test_loss"] for r in recs)  # finite model
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in recs[1:])
    assert recs[-1]["bytes_up_total"] == sum(r["bytes_up"] for r in recs) == summary["bytes_up_total"]
    assert recs[-1]["bytes_down_total"] == sum(r["bytes_down"] for r in recs) == summary["bytes_down_total"]
    # every upload is counted (rejected ones travelled too); every task downloaded the model
    n_up = summary["updates_accepted"] + rejected + summary["updates_rejected"].get("too_stale", 0)
    assert summary["bytes_up_total"] >= n_up * 4 * InProcessSimulation.from_config(c).spec.numel


@pytest.mark.slow
def test_robust_fedbuff_survives_sign_flip_attackers_on_mnist(mnist_dir):
    """20% of 20 IID MNIST clients send -10x their update. FedBuff (K = 10) with the
    mean diverges; with the median or trimmed mean it stays within 2 points of a clean run."""
    base = [
        f'data.dir="{mnist_dir}"',
        *ASYNC,
        "simulation.rounds=10",
        "simulation.seed=0",
        "asynchronous.buffer_size=10",
        "asynchronous.concurrency=10",
    ]
    attack = ['attack.kind="sign_flip"', "attack.fraction=0.2", "attack.scale=10.0"]
    c0 = load_config("examples/mnist_logreg_attack.toml", base)
    data = load_federated(c0.data, c0.simulation.num_clients, c0.simulation.seed)

    def final(*extra):
        c = load_config("examples/mnist_logreg_attack.toml", [*base, *extra])
        engine = AsyncEngine(c, InProcessSimulation.from_config(c, data))
        return list(engine.run())[-1]["test_accuracy"]

    clean = final()
    assert clean > 0.85
    assert final(*attack) < clean - 0.3
    assert final(*attack, 'robust.rule="median"') > clean - 0.02
    assert final(*attack, 'robust.rule="trimmed_mean"', "robust.trim_beta=0.3") > clean - 0.02
