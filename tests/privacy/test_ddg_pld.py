"""PLD accounting of the distributed discrete Gaussian (privacy.accountant = "pld"): never below the
mechanism's true epsilon (computed from its exact probabilities), below the paper's RDP bound, and
the continuous Gaussian's in the limit of fine quantisation."""

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from shoal.accounting import epsilon
from shoal.accounting_ddg import ROUNDING_VAR, ddg_gaussian_equivalent
from shoal.accounting_rounds import DdgRoundAccountant, RoundAccountant
from shoal.accounting_server import ServerViewAccountant
from shoal.aggregation.discrete_gaussian import plan
from shoal.config import load_config

DELTA = 1e-5


def _discrete_gaussian(variance: float, half: int) -> np.ndarray:
    k = np.arange(-half, half + 1, dtype=np.float64)
    w = np.exp(-(k**2) / (2 * variance))
    return w / w.sum()


def _true_epsilon(variance: int, shares: int, shift: int, q: float, rounds: int) -> float:
    """epsilon of ``rounds`` Poisson-sampled rounds of the 1-d sum of ``shares`` discrete Gaussians
    shifted by ``shift``, from the exact probabilities (dp-accounting's optimistic PLD of the two
    mass functions, both directions): a lower bound on the mechanism's epsilon."""
    one = _discrete_gaussian(variance, 40 * math.isqrt(variance) + 40)
    total = one
    for _ in range(shares - 1):
        total = np.convolve(total, one)
    half = len(total) // 2
    base = np.concatenate([total, np.zeros(shift)])
    moved = np.concatenate([np.zeros(shift), total])
    mixed = q * moved + (1 - q) * base
    keep = base > 1e-300

    def log_pmf(p: np.ndarray) -> dict[int, float]:
        return {i - half: float(np.log(v)) for i, v in enumerate(p) if v > 0 and keep[i]}

    worst = 0.0
    for upper, lower in ((mixed, base), (base, mixed)):
        pld = pld_lib.from_two_probability_mass_functions(
            log_pmf(lower), log_pmf(upper), pessimistic_estimate=False, value_discretization_interval=1e-4
        )
        worst = max(worst, pld.self_compose(rounds).get_epsilon_for_delta(DELTA))
    return worst


def _ddg(variance: int, shares: int, shift: int, dim: int = 1, gamma: float = 1.0) -> dict:
    return {
        "dim": dim,
        "clip": 1.0,
        "gamma": gamma,
        "bits": 16,
        "beta": 0.5,
        "variance": variance,
        "shares": shares,
        "max_summands": shares,
        "sensitivity_sq": float(shift * gamma) ** 2,
    }


@pytest.mark.parametrize("q, rounds", [(1.0, 2), (0.3, 4)])
def test_pld_is_never_below_the_exact_epsilon_of_a_small_case(q, rounds):
    """1-d, two shares of variance 50, sensitivity 3: the reported figure is at least the epsilon of
    the exact mass functions (dp-accounting's optimistic PLD of them), within 5% of it, and below
    the paper's RDP bound."""
    ddg = _ddg(50, 2, 3)
    truth = _true_epsilon(50, 2, 3, q, rounds)
    pld = DdgRoundAccountant(q, ddg, DELTA, kind="pld").epsilon_after(rounds)
    rdp = DdgRoundAccountant(q, ddg, DELTA, kind="rdp").epsilon_after(rounds)
    assert truth <= pld <= 1.05 * truth
    assert pld < rdp
    z, slack = ddg_gaussian_equivalent(50, 2, 1, 9.0, 1.0)
    assert z == pytest.approx(math.sqrt(100 - ROUNDING_VAR) / 3) and 0 <= slack < 1e-30


def test_fine_quantisation_gives_the_continuous_gaussian_and_beats_the_rdp_bound():
    """A 2NN-sized round at 16 bits: the PLD figure is at least the continuous Gaussian's at the same
    z (the rounding only adds sensitivity), within 1% of it, and under the RDP bound; against the
    server (no sampling) too. A ledger that mixes both Gaussians is composed by PLD as well."""
    p = plan(199_210, 1.0, 1.0, 10, 10, 16)
    ddg = {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}
    cont = epsilon(0.1, 1.0, 20, DELTA, "pld")
    pld = DdgRoundAccountant(0.1, ddg, DELTA, kind="pld").epsilon_after(20)
    rdp = DdgRoundAccountant(0.1, ddg, DELTA, kind="rdp").epsilon_after(20)
    assert cont <= pld <= 1.01 * cont and pld < 0.9 * rdp

    server = {k: ServerViewAccountant(DELTA, k) for k in ("pld", "rdp")}
    for acc in server.values():
        acc.set_mechanism(ddg=ddg)
        for _ in range(5):
            acc.record_round(["a"])
    assert epsilon(1.0, 1.0 / math.sqrt(5), 1, DELTA, "pld") <= server["pld"].epsilon < server["rdp"].epsilon

    mixed = DdgRoundAccountant(0.1, ddg, DELTA, kind="pld")
    mixed.load_state_dict(
        {"ledger": [{**RoundAccountant(0.1, 1.0, DELTA, clip=1.0)._current(), "rounds": 10}], "kind": "pld"}
    )
    both = mixed.epsilon_after(10)
    assert epsilon(0.1, 1.0, 20, DELTA, "pld") <= both <= pld + 1e-9 and "by PLD" in mixed.describe()


def test_config_accepts_pld_for_the_discrete_gaussian():
    cfg = load_config(
        None,
        [
            'privacy.mode="distributed"',
            'privacy.mechanism="discrete_gaussian"',
            'privacy.accountant="pld"',
            "secure_aggregation.enabled=true",
        ],
    )
    assert cfg.privacy.accountant == "pld"
