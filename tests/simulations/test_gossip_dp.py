"""Local DP (DP-SGD) in gossip simulations: each peer's example-level epsilon over the trainings it ran."""

from __future__ import annotations

import pytest
import torch

from shoal.accounting import epsilon
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.simulations.experiment import run_simulation
from shoal.simulations.gossip import GossipSimulation
from shoal.simulations.privacy_sweep import run_privacy_sweep

torch.set_num_threads(1)

Z, DELTA, B = 1.0, 1e-5, 20


def cfg(*extra):
    return load_config(
        None,
        [
            'simulation.mode="gossip"',
            "simulation.num_clients=8",
            "simulation.seed=3",
            f"train.batch_size={B}",
            "gossip.view_size=3",
            "gossip.shuffle_length=2",
            'privacy.mode="local"',
            f"privacy.noise_multiplier={Z}",
            f"privacy.delta={DELTA}",
            "output.plots=false",
            *extra,
        ],
    )


def expected_epsilon(sim: GossipSimulation, trainings: list[int]) -> float:
    """The worst peer's epsilon, computed here from the default DP-SGD schedule (rate B/n, a fixed
    10 steps per training: one epoch's worth, whatever n) and how many times each peer trained."""
    worst = 0.0
    for i, k in enumerate(trainings):
        if k:
            n = sim.shards.size(i)
            worst = max(worst, epsilon(min(B, n) / n, Z, 10 * k, DELTA))
    return worst


def test_every_peer_training_every_round_gives_the_accountants_epsilon_growing_per_round():
    sim = GossipSimulation.from_config(cfg())
    seen = []
    for r in range(1, 4):
        sim.run_round()
        ev = sim.evaluate()
        assert sim.privacy is not None and sim.privacy.accountant.participations == {p: r for p in sim.ids}
        assert ev["epsilon"] == pytest.approx(expected_epsilon(sim, [r] * sim.n), rel=1e-9)
        assert ev["delta"] == DELTA and "DP-SGD" in ev["accountant"] and torch.isfinite(torch.tensor(ev["test_loss"]))
        seen.append(ev["epsilon"])
    assert 0 < seen[0] < seen[1] < seen[2]


def test_an_offline_peer_trains_and_is_charged_less():
    sim = GossipSimulation.from_config(cfg('gossip.algorithm="dpsgd"', "gossip.churn=0.4", "gossip.churn_period=2"))
    online = [0] * sim.n
    for _ in range(4):
        sim.run_round()  # D-PSGD trains the peers online after this round's churn; nobody leaves mid-round
        online = [k + int(on) for k, on in zip(online, sim.online)]
    counts = sim.privacy.accountant.participations if sim.privacy is not None else {}
    assert [counts.get(p, 0) for p in sim.ids] == online
    assert min(online) < 4 == max(online)
    assert sim.evaluate()["epsilon"] == pytest.approx(expected_epsilon(sim, online), rel=1e-9)


def test_target_epsilon_stops_before_the_round_that_would_pass_it(tmp_path):
    probe = GossipSimulation.from_config(cfg())
    after_two, after_three = (expected_epsilon(probe, [k] * probe.n) for k in (2, 3))
    target = (after_two + after_three) / 2
    summary = run_simulation(
        cfg("simulation.rounds=6", "simulation.eval_every=5", f"privacy.target_epsilon={target}"),
        tmp_path,
        progress=False,
    )
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["round"] for r in recs] == [2]  # the round that exhausted the budget is recorded
    assert recs[0]["epsilon"] == pytest.approx(after_two, rel=1e-9) and recs[0]["sampling"] == "online"
    assert summary["rounds"] == 2 and summary["epsilon"] == recs[0]["epsilon"] <= target
    assert summary["delta"] == DELTA and summary["accountant"] == recs[0]["accountant"]
    with pytest.raises(ConfigError, match="single round"):
        GossipSimulation.from_config(cfg(f"privacy.target_epsilon={expected_epsilon(probe, [1] * probe.n) / 2}"))


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_gossip_refuses_server_noise_and_names_local(mode):
    with pytest.raises(ConfigError, match="privacy.mode = 'local'"):
        cfg(f'privacy.mode="{mode}"')


def test_privacy_sweep_refuses_gossip_instead_of_auditing_the_wrong_run(tmp_path):
    with pytest.raises(ConfigError, match="simulation.mode = 'gossip' is not swept"):
        run_privacy_sweep(cfg('privacy.sweep_modes=["local"]'), tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("algorithm", ["gossip", "dpsgd", "group_average", "secure_groups"])
def test_every_algorithm_trains_with_noise(algorithm):
    def models(*extra):
        sim = GossipSimulation.from_config(cfg(f'gossip.algorithm="{algorithm}"', "gossip.group_size=3", *extra))
        for _ in range(2):
            sim.run_round()
        return sim, sim.models.clone()

    dp, noisy = models()
    _, clipped_only = models("privacy.noise_multiplier=0")
    _, plain = models('privacy.mode="none"')
    assert torch.isfinite(noisy).all() and torch.isfinite(clipped_only).all()
    assert not torch.equal(noisy, clipped_only)  # the Gaussian noise reached the models
    assert not torch.equal(clipped_only, plain)  # and so did DP-SGD's clipping and sampling
    assert dp.privacy is not None and set(dp.privacy.accountant.participations.values()) == {2}
    ev = dp.evaluate()
    assert ev["epsilon"] > 0 and 0 <= ev["test_accuracy"] <= 1
