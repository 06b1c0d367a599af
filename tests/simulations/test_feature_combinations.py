"""Features from different issues composed in one simulated run."""

import math

import torch

from shoal.config import load_config
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation

BASE = [
    "simulation.rounds=2",
    "simulation.num_clients=12",
    "simulation.clients_per_round=6",
    "output.plots=false",
    "simulation.progress=false",
]


def test_secure_aggregation_with_distributed_dp_counts_epsilon(tmp_path):
    cfg = load_config(
        None,
        BASE
        + [
            "secure_aggregation.enabled=true",
            'privacy.mode="distributed"',
            "privacy.noise_multiplier=1.0",
            "privacy.clip_norm=0.5",
            "secure_aggregation.clip=2.5",
        ],
    )  # C + 8 share stds (the range check)
    summary = run_simulation(cfg, tmp_path, progress=False)
    assert summary["epsilon"] > 0 and math.isfinite(summary["final_test_accuracy"])


def test_nan_attackers_are_rejected_before_masking():
    cfg = load_config(None, BASE + ["secure_aggregation.enabled=true", 'attack.kind="nan"', "attack.fraction=0.5"])
    sim = InProcessSimulation.from_config(cfg)
    summary = sim.run_round()
    assert summary.rejected.get("non_finite", 0) >= 1
    assert 0 < summary.num_results < 6
    assert torch.isfinite(sim.global_params).all()


def test_local_dp_trains_clients_one_by_one_even_when_batching_is_asked():
    cfg = load_config(
        None, BASE + ['privacy.mode="local"', "simulation.batch_clients=6", "privacy.noise_multiplier=1.0"]
    )
    sim = InProcessSimulation.from_config(cfg)
    assert sim.batched is None
    assert sim.run_round().num_results == 6


def test_batched_training_with_label_flip_attackers_runs():
    cfg = load_config(None, BASE + ["simulation.batch_clients=6", 'attack.kind="label_flip"', "attack.fraction=0.3"])
    sim = InProcessSimulation.from_config(cfg)
    assert sim.batched is not None
    assert sim.run_round().num_results == 6
