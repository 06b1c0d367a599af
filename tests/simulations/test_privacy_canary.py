"""The canary audit (issue 14, item 4): a one-shot empirical epsilon (Andrew et al. 2024) that stays
below the accounted epsilon in every DP mode and is large without DP."""

import math

import numpy as np
import pytest
import torch

from shoal.assembly import task_from_config
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.simulations.canary_audit import direction, estimate, gaussian_epsilon, run_canary_audit, with_canaries
from shoal.simulations.client_data import load_simulation_data

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("mu", [0.5, 1.0, 2.0, 4.0])
def test_two_gaussians_epsilon_is_the_gaussian_mechanisms(mu):
    """Equal variances: N(mu, 1) vs N(0, 1) is the Gaussian mechanism of multiplier 1/mu, whose epsilon
    dp-accounting's PLD accountant computes independently."""
    import dp_accounting
    from dp_accounting import pld

    acc = pld.PLDAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(1 / mu))
    assert gaussian_epsilon((mu, 1.0), (0.0, 1.0), 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=0.01)
    assert gaussian_epsilon((0.0, 1.0), (mu, 1.0), 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=0.01)
    assert gaussian_epsilon((0.0, 1.0), (0.0, 1.0), 1e-5) == 0.0


def test_estimate_of_a_known_mechanism_and_its_interval():
    """Cosines drawn from a Gaussian mechanism of mu = 2: the estimate lands near its epsilon and the
    bootstrap interval covers it."""
    gen = np.random.default_rng(0)
    truth = gaussian_epsilon((2.0, 1.0), (0.0, 1.0), 1e-5)
    est = estimate(2.0 + gen.standard_normal(2000), gen.standard_normal(2000), 1e-5)
    assert est.low <= truth <= est.high
    assert est.epsilon == pytest.approx(truth, rel=0.2)


def test_canary_directions_are_unit_random_and_reproducible():
    a, b = direction(50_000, 1), direction(50_000, 2)
    assert float(a.norm()) == pytest.approx(1.0) and torch.equal(a, direction(50_000, 1))
    assert abs(float(a @ b)) < 5 / math.sqrt(50_000)


def test_canaries_join_the_data_as_extra_clients():
    cfg = load_config(None, ["simulation.num_clients=6"])
    task = task_from_config(cfg)
    data = load_simulation_data(task, cfg)
    more, ids = with_canaries(data, 3)
    assert len(more.train) == 9 and ids == ["canary-0000", "canary-0001", "canary-0002"]
    assert list(more.client_ids)[-3:] == ids and len(set(more.client_ids)) == 9
    with pytest.raises(ConfigError, match="privacy.canaries = 1"):
        load_config(None, ["privacy.canaries=1"])


# q = 1/20 per round, 20 rounds, z = 0.7: the accountant charges 5.7 at delta 1e-5; the final model
# alone gives away far less (about 2.3 for a canary, computed from its participation mixture).
AUDIT = [
    "simulation.num_clients=20",
    "simulation.clients_per_round=1",
    "simulation.rounds=20",
    'model.name="2nn"',
    "train.epochs=1",
    "train.batch_size=10",
    "train.lr=0.05",
    "output.plots=false",
    "simulation.progress=false",
    "privacy.canaries=500",
    "privacy.canaries_unseen=1000",
    "privacy.noise_multiplier=0.7",
    "privacy.reproducible=true",  # the verdicts are checked on fixed draws
]

MODES = {
    "central": ['privacy.mode="central"'],
    "distributed": ['privacy.mode="distributed"'],
    # no injected dropouts: with them whether a Poisson round aborts is not bounded, and its abort delta
    # would be q a round (refused; shoal.accounting_aborts); without, t = 15 of K = 28 over the N = 560
    # clients and canaries costs 6.3e-5 a round, delta 0.00126 after 20 rounds
    "distributed+secagg": [
        'privacy.mode="distributed"',
        "secure_aggregation.enabled=true",
        "secure_aggregation.bits=20",
        "secure_aggregation.clip=4",
        # q = K/N = 1/20 as in the others, with K = 3 (no config unmasks a sum of fewer than 3)
        "simulation.num_clients=60",
        "simulation.clients_per_round=3",
    ],
    # one DP-SGD step a round: a canary client's update (B examples, q = 1) is one Gaussian release
    "local": ['privacy.mode="local"', "privacy.local_steps=1"],
}


def audit(tmp_path, sets):
    cfg = load_config(None, [*AUDIT, *sets])
    task = task_from_config(cfg)
    return run_canary_audit(cfg, load_simulation_data(task, cfg), task, tmp_path)


@pytest.mark.parametrize("mode", list(MODES))
def test_empirical_epsilon_stays_below_the_accounted_one(tmp_path, mode):
    out = audit(tmp_path, MODES[mode])
    est = out["estimate"]
    assert out["canaries_selected"] > 250
    if mode != "local":
        assert est.inserted == 500 and est.unseen == 1000
    assert math.isfinite(out["canary_accounted_epsilon"])
    if mode != "local":  # the final model of 20 sampled rounds shows far less than the accountant charges
        assert out["canary_epsilon"] < out["canary_accounted_epsilon"], (
            mode,
            out["canary_epsilon"],
            out["canary_accounted_epsilon"],
        )
    else:  # one canary update is one Gaussian step at rate 1: the audit is tight, the point estimate near it
        assert est.inserted == out["canaries_selected"] and out["canary_release"] == "each canary client's first update"
        assert est.epsilon < 1.5 * out["canary_accounted_epsilon"]
    assert est.low <= est.epsilon <= est.high
    assert not out["canary_flagged"], (mode, est.low, out["canary_accounted_epsilon"])


def test_empirical_epsilon_is_large_without_dp(tmp_path):
    out = audit(tmp_path, ['privacy.mode="none"'])
    assert out["canary_epsilon"] > 100 and math.isinf(out["canary_accounted_epsilon"])
    assert out["canary_epsilon_low"] > 50  # not an accident of the fit: the whole interval is large


# The bugs of central DP are planted in a run the audit sees tightly: one round that samples every
# client (q = 1), so the final model is the one release the accountant charges (epsilon of one
# Gaussian step at z = 0.7: about 6.7 by RDP at delta 1e-5).
TIGHT = ["simulation.clients_per_round=20", "simulation.rounds=1"]


def _halve_the_noise(cfg):
    def plant(sim):
        sim.rounds.strategy.aggregator.sum_noise_multiplier = cfg.privacy.noise_multiplier / 2

    return plant


def _clip_at_4c(cfg):
    def plant(sim):  # clipping at 4C while the noise stays z C: the sensitivity is 4 times what is noised
        agg = sim.rounds.strategy.aggregator
        agg.clip_norm = 4 * cfg.privacy.clip_norm
        agg.sum_noise_multiplier = cfg.privacy.noise_multiplier / 4

    return plant


def _no_local_noise(cfg):
    def plant(sim):
        sim.trainer._dp_opt.noise_multiplier = 0.0

    return plant


def test_a_tight_central_audit_of_a_sound_run_is_not_flagged(tmp_path):
    out = audit(tmp_path, [*MODES["central"], *TIGHT])
    assert not out["canary_flagged"], (out["canary_epsilon_low"], out["canary_accounted_epsilon"])
    assert out["canary_epsilon"] > 0.3 * out["canary_accounted_epsilon"]  # tight: the estimate is near it


# Canaries (inserted, unseen) per planted bug, sized by the margin of the interval's lower end over
# the accounted 7.16 (measured, simulation.seed 0, 1, 2): halved noise 9.2 to 11.4 with 200 canaries,
# so it keeps 500 (11.8 at seed 0); clipping at 4C 28.3 to 29.2 and DP-SGD without noise 330 to 1124
# with 200, many times the spread across seeds, so 200 do (each canary costs a direction of numel).
@pytest.mark.parametrize(
    "mode,bug,canaries",
    [
        ("central", _halve_the_noise, (500, 1000)),
        ("central", _clip_at_4c, (200, 400)),
        ("local", _no_local_noise, (200, 400)),
    ],
    ids=["noise-halved", "clip-at-4C", "local-noise-removed"],
)
def test_the_audit_flags_each_planted_bug(tmp_path, mode, bug, canaries):
    """Plant a bug the accountant cannot see: the sum carries half the accounted noise; clipping at
    4C with noise for C (caught because canaries send 4C); DP-SGD without its noise (caught because
    local canaries go through the real trainer). Even the interval's lower end exceeds the
    accounted epsilon."""
    k, m = canaries
    cfg = load_config(None, [*AUDIT, *MODES[mode], *(TIGHT if mode == "central" else [])])
    task = task_from_config(cfg)
    out = run_canary_audit(cfg, load_simulation_data(task, cfg), task, tmp_path, k, m, prepare=bug(cfg))
    assert out["canaries"] == k and out["canaries_unseen"] == (m if mode == "central" else out["canaries_selected"])
    assert out["canary_flagged"], (out["canary_epsilon_low"], out["canary_accounted_epsilon"])
    assert out["canary_epsilon_low"] > out["canary_accounted_epsilon"]
