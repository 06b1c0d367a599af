"""Two epsilons: against the model's recipients (amplified by Poisson sampling) and against the
server, which chose and saw each round's sample, so no amplification holds against it. Checked
against dp-accounting computed here directly, never through shoal's accounting functions."""

from __future__ import annotations

import json

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp

from shoal.privacy_plan import PrivacyPlan

DELTA = 1e-5


def _unamplified(z: float, rounds: int) -> float:
    acc = pld.PLDAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(z), rounds))
    return float(acc.get_epsilon(DELTA))


def _amplified(q: float, z: float, rounds: int) -> float:
    acc = rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return float(acc.get_epsilon(DELTA))


def test_against_the_server_n100_q01_z1_100_rounds_is_the_unamplified_figure():
    """N = 100, q = 0.1, z = 1, 100 rounds of distributed DP under secure aggregation: the epsilon
    against the server is that of the Gaussian composed over the most-selected node's rounds, with
    no amplification; against the recipients it stays the amplified one."""
    plan = PrivacyPlan(mode="distributed", noise_multiplier=1.0, delta=DELTA, secure=True)
    server = plan.server_view_accountant()
    recipients = plan.round_accountant(0.1)
    assert server is not None
    rng = np.random.default_rng(0)
    nodes = [f"n{i}" for i in range(100)]
    taken = dict.fromkeys(nodes, 0)
    for _ in range(100):
        selected = [n for n in nodes if rng.random() < 0.1]
        for n in selected:
            taken[n] += 1
        server.record_round(selected)
        recipients.record_round(selected)
    worst = max(taken.values())
    assert server.worst_rounds() == worst
    assert server.epsilon == pytest.approx(_unamplified(1.0, worst), rel=1e-3)
    assert recipients.epsilon == pytest.approx(_amplified(0.1, 1.0, 100), rel=1e-9)
    assert server.epsilon > 1.5 * recipients.epsilon  # the two differ, by much
    assert server.next_epsilon() == pytest.approx(_unamplified(1.0, worst + 1), rel=1e-3)
    fields = plan.server_view_fields(server)
    assert fields["epsilon_server"] == server.epsilon and "no amplification" in fields["server_accountant"]
    # a restart keeps every node's rounds
    again = plan.server_view_accountant()
    assert again is not None
    again.load_state_dict(json.loads(json.dumps(server.state_dict())))
    assert again.epsilon == server.epsilon


def test_nothing_protects_against_the_server_without_secure_aggregation():
    for plan in (
        PrivacyPlan(mode="central", noise_multiplier=1.0),
        PrivacyPlan(mode="distributed", noise_multiplier=1.0, secure=False),
    ):
        assert plan.server_view_accountant() is None
        fields = plan.server_view_fields(None)
        assert fields["epsilon_server"] is None and fields["server_accountant"].startswith("none:")
    assert PrivacyPlan(mode="local", noise_multiplier=1.0).server_view_fields(None) == {}


def test_fixed_size_sampling_charges_the_replace_one_sensitivity():
    plan = PrivacyPlan(mode="distributed", noise_multiplier=2.0, delta=DELTA, secure=True, sampling="fixed")
    server = plan.server_view_accountant()
    assert server is not None
    for _ in range(3):
        server.record_round(["a", "b"])
    assert server.epsilon == pytest.approx(_unamplified(1.0, 3), rel=1e-3)  # z / 2 for sensitivity 2C


def test_a_simulation_writes_both_epsilons_in_every_record_and_the_summary(tmp_path):
    from shoal.aggregation.dp import share_std
    from shoal.aggregation.secagg.encoding import noise_range
    from shoal.config import load_config
    from shoal.metrics import read_jsonl
    from shoal.simulations.experiment import run_simulation

    cfg = load_config(
        None,
        [
            "simulation.num_clients=10",
            "simulation.clients_per_round=5",
            # N = 10, K = 5, t = 3: aborted rounds are released as empty ones, each round priced as a
            # mixture (shoal.accounting_aborts)
            "simulation.rounds=2",
            'model.name="logreg"',
            "train.epochs=1",
            "output.plots=false",
            "simulation.progress=false",
            'privacy.mode="distributed"',
            "privacy.noise_multiplier=2.0",
            "secure_aggregation.enabled=true",
            "secure_aggregation.bits=20",
            # fixed draws: with OS-random sampling the worst node may have taken part in fewer rounds
            # than the run has had, and its exact unamplified figure can then sit under the
            # recipients' (looser) RDP bound of all the rounds
            "privacy.reproducible=true",
            f"secure_aggregation.clip={noise_range(1.0, share_std(1.0, 2.0, 3))}",
        ],
    )
    run_simulation(cfg, tmp_path)
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "epsilon" in r]
    assert len(records) == 2
    for r in records:  # the aborts' boundary (a sum of t = 3 against noise, P = 0.07) costs the amplified
        # epsilon more than the server's unamplified view of a node's own rounds, which already knows who took part
        assert 0 < r["epsilon_server"] < r["epsilon"] and "no amplification" in r["server_accountant"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epsilon_server"] == records[-1]["epsilon_server"]
    assert "abort_delta" not in summary and "abort_delta" not in records[-1]  # the mixture adds nothing to delta
    # no node took part in more than the 2 rounds: at most two unamplified Gaussians of z = 2
    assert records[-1]["epsilon_server"] <= _unamplified(2.0, 2) * (1 + 1e-3)


def test_the_server_reports_and_keeps_the_epsilon_against_itself(tmp_path):
    from shoal.server.privacy import ServerPrivacy
    from shoal.server.store import open_service

    from ..server.live import small_config

    sections = {
        "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0},
        "secure_aggregation": {"enabled": True, "clip": 20.0},
    }
    cfg = small_config(tmp_path, sections, clients_per_round=3)
    svc = open_service(cfg, registered=5)
    p = svc.privacy
    for selected in (["n0", "n1"], ["n0", "n2"], ["n0"]):
        p.round_started(selected)
    status = p.status()
    assert status["epsilon_server"] == pytest.approx(_unamplified(1.0, 3), rel=1e-3)
    # against everyone else the rounds are amplified by sampling, but without privacy.abort_bound each is
    # charged as a node deciding its abort at sensitivity K_max C: here that costs more than no amplification
    assert status["epsilon"] > status["epsilon_server"]
    assert any(line.startswith("shoal_privacy_epsilon_server ") for line in p.prometheus())
    restarted = ServerPrivacy(cfg, svc.spec.numel, torch.device("cpu"))
    restarted.load_state_dict(json.loads(json.dumps(p.state_dict())))
    restarted.bind(5, svc.rounds)
    assert restarted.record()["epsilon_server"] == status["epsilon_server"]


@pytest.mark.parametrize("z", [1.0, 3.0])
def test_one_gaussian_is_priced_by_its_exact_privacy_profile(z):
    """The server's view prices unsampled Gaussian rounds with the Gaussian's exact epsilon (its
    privacy profile, solved for epsilon): never above dp-accounting's PLD of the same mechanism
    (an upper bound), and within its discretisation of it."""
    from shoal.accounting import gaussian_epsilon

    acc = pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z))
    theirs = float(acc.get_epsilon(DELTA))
    ours = gaussian_epsilon(z, DELTA)
    assert ours <= theirs and ours == pytest.approx(theirs, rel=1e-6)
    assert gaussian_epsilon(z / 2**0.5, DELTA) == pytest.approx(_unamplified(z, 2), rel=1e-6)  # two rounds compose
