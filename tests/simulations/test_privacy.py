"""Privacy in the simulator: epsilon in metrics.jsonl every round, the target_epsilon stop."""

import pytest

from shoal.accounting import epsilon
from shoal.config import Config, PrivacyConfig, SimulationConfig, TrainConfig
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.simulations.experiment import run_simulation


def _cfg(mode: str, **privacy) -> Config:
    cfg = Config(
        simulation=SimulationConfig(rounds=10, num_clients=10, clients_per_round=2, progress=False),
        train=TrainConfig(epochs=1, batch_size=10, lr=0.05),
        privacy=PrivacyConfig(mode=mode, noise_multiplier=1.0, clip_norm=1.0, **privacy),
    )
    cfg.output.plots = False
    return cfg.validate()


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_training_stops_before_target_epsilon(tmp_path, mode):
    target = (epsilon(0.2, 1.0, 3, 1e-5) + epsilon(0.2, 1.0, 4, 1e-5)) / 2  # room for 3 rounds, not 4
    summary = run_simulation(_cfg(mode, target_epsilon=target), tmp_path)
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in recs] == [1, 2, 3]
    assert [r["epsilon"] for r in recs] == pytest.approx([epsilon(0.2, 1.0, k, 1e-5) for k in (1, 2, 3)])
    assert summary["rounds"] == 3 and summary["epsilon"] <= target


def test_local_dp_sgd_reports_epsilon_and_repeats(tmp_path):
    cfg = _cfg("local")
    cfg.simulation.rounds = 2
    a = run_simulation(cfg, tmp_path / "a")
    b = run_simulation(cfg, tmp_path / "b")
    assert a["final_test_accuracy"] == b["final_test_accuracy"]
    recs = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    assert all(r["epsilon"] > 0 for r in recs) and recs[-1]["epsilon"] >= recs[0]["epsilon"]


def test_target_below_one_round_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="target_epsilon"):
        run_simulation(_cfg("central", target_epsilon=1e-3), tmp_path)
