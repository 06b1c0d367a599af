"""The all-iterates canary audit against the run's own ledger: it sees every round's release and the
canaries' selections, and catches what the final model hides (a sampling rate above the charged one,
a round released but not charged) as well as missing noise or a wide clip."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.assembly import task_from_config
from shoal.config import load_config
from shoal.privacy_plan import PrivacyPlan
from shoal.simulations.canary_audit import audit_iterates, direction, run_canary_audit
from shoal.simulations.client_data import load_simulation_data

# 2NN (54,410 parameters), 20 clients + 200 canaries at q = 1/20, 10 rounds, z = 0.7
SETTING = [
    "simulation.num_clients=20",
    "simulation.clients_per_round=1",
    "simulation.rounds=10",
    'model.name="2nn"',
    "train.epochs=1",
    "train.batch_size=10",
    "train.lr=0.05",
    "output.plots=false",
    "simulation.progress=false",
    "privacy.canaries=200",
    "privacy.canaries_unseen=400",
    "privacy.noise_multiplier=0.7",
    'privacy.mode="central"',
    "privacy.reproducible=true",  # verdicts checked on fixed draws
]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def sample_twice_as_often(cfg):
    def plant(sim):  # the rounds select at 2q while the ledger charges q
        sim.rounds.poisson_rate = min(1.0, 2 * sim.privacy.accountant.q)

    return plant


def skip_one_charge(cfg):
    def plant(sim):  # the first round runs and releases, but is never charged
        record, skipped = sim.privacy.record_participants, []

        def charge(ids):
            if not skipped:
                skipped.append(ids)
                return
            record(ids)

        sim.privacy.record_participants = charge

    return plant


def run(tmp_path, bug=None):
    cfg = load_config(None, SETTING)
    task = task_from_config(cfg)
    return run_canary_audit(cfg, load_simulation_data(task, cfg), task, tmp_path, prepare=bug(cfg) if bug else None)


def test_a_sound_run_passes_and_each_planted_ledger_bug_is_caught(tmp_path):
    sound = run(tmp_path / "sound")
    audit = sound["canary_ledger_audit"]
    assert not sound["canary_flagged"] and not sound["canary_ledger_flagged"], audit
    assert audit["rounds_seen"] == audit["rounds_charged"] == 10
    assert audit["q_low"] <= audit["q_charged"] == pytest.approx(1 / 20)
    assert audit["z_high"] >= 0.7 and audit["epsilon_measured"] <= audit["epsilon_charged"]
    twice = run(tmp_path / "2q", sample_twice_as_often)
    assert twice["canary_ledger_flagged"] and any("selected at q" in f for f in twice["canary_ledger_audit"]["failed"])
    # the final-model estimate alone does not see it
    assert twice["canary_epsilon_low"] < twice["canary_accounted_epsilon"]
    uncharged = run(tmp_path / "uncharged", skip_one_charge)
    failed = uncharged["canary_ledger_audit"]["failed"]
    assert uncharged["canary_flagged"] and failed[0] == "10 rounds released, 9 charged", failed


def synthetic(rounds, q, sigma, contribution, seed=0, numel=20_000, k=200, m=400):
    """Releases of a Poisson-sampled Gaussian sum built directly: canary j adds ``contribution`` u_j
    in the rounds it is selected in, plus N(0, sigma^2) per coordinate."""
    gen = torch.Generator().manual_seed(seed)
    us = [direction(numel, 10_000 + j) for j in range(k)]
    vs = [direction(numel, 90_000 + i) for i in range(m)]
    canaries = [f"c{j}" for j in range(k)]
    iterates, selected = {}, {}
    for r in range(1, rounds + 1):
        picks = [j for j in range(k) if float(torch.rand(1, generator=gen)) < q]
        d = sigma * torch.randn(numel, generator=gen, dtype=torch.float64)
        for j in picks:
            d += contribution * us[j]
        iterates[r], selected[r] = d, [canaries[j] for j in picks]
    return iterates, selected, us, vs, canaries


@pytest.mark.parametrize(
    "sigma,contribution,flagged",
    [(0.7, 1.0, False), (0.35, 1.0, True), (0.7, 4.0, True)],
    ids=["sound", "noise-halved", "clip-at-4C"],
)
def test_the_noise_per_unit_of_sensitivity_is_held_to_the_ledger(sigma, contribution, flagged):
    """The ledger charges z = 0.7 at q = 0.1 for 10 rounds; releases with half the noise, or a clip
    that lets 4C through, measure z <= 0.35 or 0.175 and are flagged; the sound mechanism is not."""
    acc = PrivacyPlan(mode="central", noise_multiplier=0.7).round_accountant(0.1)
    for _ in range(10):
        acc.record_round([])
    out = audit_iterates(*synthetic(10, 0.1, sigma, contribution), acc, 1e-5)
    assert out.flagged == flagged, out.describe()
    assert out.sigma == pytest.approx(sigma, rel=0.05)
    assert out.c_hat == pytest.approx(contribution, rel=0.2)
    if flagged:
        assert any("noise per unit" in f for f in out.failed) and out.epsilon_measured > out.epsilon_charged
    else:
        assert math.isfinite(out.z_high) and out.z_high >= 0.7


@pytest.mark.parametrize("charged", [True, False], ids=["aborts-charged", "aborts-uncharged"])
def test_aborted_rounds_are_held_to_the_ledgers_abort_charge(charged):
    """Two of 10 Poisson rounds aborted (released nothing): whether a round aborts depends on the
    sample, so the ledger must charge its abort delta (shoal.accounting_aborts); without it the audit
    flags the run, with it the audit reports the charge."""
    acc = PrivacyPlan(mode="central", noise_multiplier=0.7).round_accountant(0.1)
    acc.abort_delta = 1e-8 if charged else 0.0
    for _ in range(10):
        acc.record_round([])
    iterates, selected, us, vs, canaries = synthetic(10, 0.1, 0.7, 1.0)
    for r in (3, 7):
        iterates[r] = torch.zeros_like(iterates[r])
    out = audit_iterates(iterates, selected, us, vs, canaries, acc, 1e-5)
    assert out.aborted_seen == 2 and out.abort_delta_charged == pytest.approx(1e-7 if charged else 0.0)
    assert out.flagged != charged, out.describe()
    assert charged or "2 rounds aborted under Poisson sampling" in out.failed[-1]
    assert acc.composed_delta() == pytest.approx(1e-5 + out.abort_delta_charged)
