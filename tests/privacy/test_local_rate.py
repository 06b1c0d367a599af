"""privacy.local_sampling_rate in the simulator: every client's DP-SGD runs the run's schedule, so
every client that took part the same number of times has the same epsilon, whatever its size."""

import pytest

from shoal.accounting import epsilon
from shoal.config import load_config
from shoal.simulations.inprocess import InProcessSimulation


def test_clients_of_any_size_are_accounted_on_the_runs_schedule():
    cfg = load_config(
        None,
        [
            "simulation.rounds=1",
            "simulation.num_clients=6",
            "simulation.clients_per_round=6",
            'data.partition="dirichlet"',
            'privacy.mode="local"',
            "privacy.noise_multiplier=1.0",
            "privacy.delta=1e-4",
            "privacy.local_sampling_rate=0.05",
            "train.batch_size=10",
            "train.epochs=1",
            "privacy.reproducible=true",
        ],
    )
    sim = InProcessSimulation.from_config(cfg)
    sim.run_round()
    acc = sim.privacy.accountant
    assert len(set(acc.participations)) == 6 and set(acc.participations.values()) == {1}
    assert acc.state_dict()["schedules"] and {tuple(v) for v in acc.state_dict()["schedules"].values()} == {(0.05, 20)}
    assert sim.privacy.epsilon == pytest.approx(epsilon(0.05, 1.0, 20, 1e-4))
