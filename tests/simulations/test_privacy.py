"""Privacy in the simulator: epsilon in metrics.jsonl every round, the target_epsilon stop."""

import pytest
import torch

from shoal.accounting import epsilon
from shoal.config import Config, PrivacyConfig, SimulationConfig, TrainConfig
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.simulations.experiment import run_simulation


def _cfg(mode: str, **privacy) -> Config:
    cfg = Config(
        simulation=SimulationConfig(rounds=10, num_clients=10, clients_per_round=2, progress=False),
        train=TrainConfig(epochs=1, batch_size=10, lr=0.05),
        # reproducible: the tests compare runs and noise on fixed draws
        privacy=PrivacyConfig(mode=mode, noise_multiplier=1.0, clip_norm=1.0, **{"reproducible": True, **privacy}),
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


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_one_round_carries_noise_of_std_z_c_over_k(mode):
    """The simulator end to end: the noisy global model minus the noiseless one is the
    noise on the average, N(0, (zC/K)^2) per coordinate, whoever added it."""
    from shoal.simulations.inprocess import InProcessSimulation

    def one_round(m, z):
        cfg = _cfg(m)
        cfg.privacy.noise_multiplier = z
        sim = InProcessSimulation.from_config(cfg)
        sim.run_round()
        return sim.global_params.double()

    clean_central, clean = one_round("central", 0.0), one_round(mode, 0.0)
    assert torch.allclose(clean, clean_central, atol=1e-6)  # same clipping, same denominator K
    z, c, k = 3.0, 1.0, 2
    noise = one_round(mode, z) - clean
    assert float(noise.std()) == pytest.approx(z * c / k, rel=0.15)  # 610 coordinates
    assert abs(float(noise.mean())) < 0.3 * z * c / k


def test_adaptive_clipping_moves_the_clip_norm_in_a_run():
    from shoal.simulations.inprocess import InProcessSimulation

    cfg = _cfg("central", adaptive_clipping=True, target_quantile=0.5, clip_lr=0.5)
    cfg.privacy.noise_multiplier, cfg.privacy.clip_norm = 0.1, 100.0  # C far above every update norm
    sim = InProcessSimulation.from_config(cfg)
    agg = sim.rounds.strategy.aggregator
    assert agg.adaptive.count_stddev == pytest.approx(2 / 20)  # K / 20, Andrew et al.'s choice
    for _ in range(5):
        sim.run_round()
    assert agg.clip_norm < 100.0 * 0.9  # all unclipped: C shrinks toward the median norm
    assert sim.privacy.metrics()["clip_norm"] == agg.clip_norm  # reported in metrics.jsonl


@pytest.mark.parametrize("k,fraction,n", [(0, 0.1, 100), (0, 0.01, 30), (5, 0.1, 3), (7, 0.5, 100)])
def test_expected_clients_is_what_sync_rounds_selects(k, fraction, n):
    from shoal.privacy_state import expected_clients
    from shoal.rounds import SyncRounds

    cfg = _cfg("central")
    cfg.simulation.clients_per_round, cfg.simulation.fraction = k, fraction
    assert expected_clients(cfg, n) == SyncRounds(None, torch.zeros(1), k, fraction).sample_size(n)


def test_delta_at_or_above_one_over_n_is_refused_and_near_it_warned(caplog):
    import logging

    from shoal.privacy_state import check_delta

    clients = {f"c{i}": 50 for i in range(20)}
    with pytest.raises(ConfigError, match=r"privacy.delta = 0.05 is at least 1/N = 0.05 \(N = 20 clients\)"):
        check_delta(0.05, "central", clients)
    with pytest.raises(ConfigError, match=r"N = 8 examples of the smallest client"):
        check_delta(0.2, "local", {**clients, "small": 8})
    with caplog.at_level(logging.WARNING):
        check_delta(0.01, "distributed", clients)  # above 1/(10 N) = 0.005
        check_delta(1e-5, "central", clients)
    assert [r.getMessage()[:22] for r in caplog.records] == ["privacy.delta = 0.01 i"]
