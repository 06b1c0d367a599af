"""The distributed discrete Gaussian's accounting against exact numbers, at coarse noise (integer
variance 1-2 a share, where the factor e^(+-b) of shoal.accounting_ddg is largest).

Independent of dp-accounting: the sum of t discrete Gaussians is convolved in numpy, the rounded
continuous Gaussian is integrated numerically, and the epsilon of composed rounds comes from the
hockey-stick divergence of the exact mass functions (every combination of outcomes enumerated)."""

import math

import numpy as np
import pytest

from shoal.accounting_ddg import ROUNDING_VAR, ddg_gaussian_equivalent, theta
from shoal.accounting_rounds import DdgRoundAccountant

DELTA = 1e-5


def share_sum(variance: float, shares: int, half: int = 60) -> np.ndarray:
    """Mass function of the sum of ``shares`` discrete Gaussians N_Z(0, variance) on
    [-shares*half, shares*half] (the mass cut off is below 1e-300 for the variances used)."""
    k = np.arange(-half, half + 1, dtype=np.float64)
    one = np.exp(-(k**2) / (2 * variance))
    one /= one.sum()
    total = one
    for _ in range(shares - 1):
        total = np.convolve(total, one)
    return total


def rounded_gaussian(var: float, ks: np.ndarray, r2: float = ROUNDING_VAR, h: float = 1 / 64) -> np.ndarray:
    """P(k) for Y ~ N(0, var) rounded to the integer k with probability proportional to
    exp(-(k - Y)^2 / 2 r2): the trapezoid rule in Y (spectrally accurate for this smooth integrand)."""
    y = np.arange(-12 * math.sqrt(var) - 12, 12 * math.sqrt(var) + 12, h)
    dens = np.exp(-(y**2) / (2 * var)) / math.sqrt(2 * math.pi * var)
    j = np.arange(-40, 41)
    norm = np.exp(-((j[None, :] - y[:, None]) ** 2) / (2 * r2)).sum(axis=1)
    return np.array([h * np.sum(dens * np.exp(-((k - y) ** 2) / (2 * r2)) / norm) for k in ks])


@pytest.mark.parametrize("variance, shares", [(1, 5), (1, 8), (2, 3)])
def test_every_output_is_within_the_factor_of_the_rounded_gaussian(variance, shares):
    """The derivation's claim, per coordinate: the sum of t shares N_Z(0, v) puts on every integer a
    probability within e^(+-b) of the continuous N(0, tv - 4) rounded as step (2) rounds it."""
    total = share_sum(variance, shares)
    centre = len(total) // 2
    sd = math.sqrt(shares * variance)
    ks = np.arange(-int(8 * sd), int(8 * sd) + 1)
    q = rounded_gaussian(shares * variance - ROUNDING_VAR, ks)
    log_ratio = np.log(total[centre + ks]) - np.log(q)
    _, b = ddg_gaussian_equivalent(variance, shares, 1, 1.0, 1.0)
    assert 1e-10 < b and np.abs(log_ratio).max() <= b


@pytest.mark.parametrize("variance, shares", [(0.2, 3), (0.3, 4), (0.5, 6)])
def test_the_sum_of_shares_is_within_the_stated_factors_of_the_gaussian_density(variance, shares):
    """Step (1) where theta is large (fractional variance, which the code never runs, so the bound is
    tested where it binds): the sum's mass at m over the N(0, tv) density lies within
    [(1+theta(v))^-t prod_k (1-theta(kv/(k+1))), prod_k (1+theta(kv/(k+1)))]."""
    total = share_sum(variance, shares)
    centre = len(total) // 2
    m = np.arange(-12, 13)
    density = np.exp(-(m**2) / (2 * shares * variance)) / math.sqrt(2 * math.pi * shares * variance)
    ratio = total[centre + m] / density
    inner = [theta(variance * k / (k + 1)) for k in range(1, shares)]
    low = math.prod(1 - x for x in inner) / (1 + theta(variance)) ** shares
    high = math.prod(1 + x for x in inner)
    assert low <= ratio.min() and ratio.max() <= high
    assert ratio.max() - ratio.min() > 1e-3  # the factor is not vacuous here


def exact_epsilon(variance: int, shares: int, shift: int, q: float, rounds: int) -> float:
    """epsilon at DELTA of ``rounds`` Poisson-sampled (rate q) rounds of the 1-d sum of ``shares``
    discrete Gaussians, one client moving it by ``shift``, both directions of add/remove: the
    hockey-stick divergence of the exact composed mass functions, solved for epsilon by bisection.
    A lower bound on the mechanism's epsilon (one pair of neighbouring inputs)."""
    total = share_sum(variance, shares)
    base = np.concatenate([total, np.zeros(shift)])
    mixed = (1 - q) * base + q * np.concatenate([np.zeros(shift), total])
    worst = 0.0
    for upper, lower in ((mixed, base), (base, mixed)):
        keep = upper > 1e-30
        with np.errstate(divide="ignore"):
            loss, prob = np.log(upper[keep]) - np.log(lower[keep]), upper[keep]
        losses, probs = loss, prob
        for _ in range(rounds - 1):  # the privacy loss of the composition: the sum of the rounds'
            losses = (losses[:, None] + loss[None, :]).ravel()
            probs = (probs[:, None] * prob[None, :]).ravel()

        def delta_of(eps: float, losses=losses, probs=probs) -> float:
            return float(np.sum(probs * np.clip(-np.expm1(np.minimum(eps - losses, 700.0)), 0.0, None)))

        lo, hi = 0.0, 1.0
        while delta_of(hi) > DELTA:
            lo, hi = hi, 2 * hi
        for _ in range(50):
            lo, hi = (lo, (lo + hi) / 2) if delta_of((lo + hi) / 2) <= DELTA else ((lo + hi) / 2, hi)
        worst = max(worst, lo if delta_of(0.0) > DELTA else 0.0)
    return worst


# (variance, t, shift, q, rounds) -> exact epsilon, as measured by exact_epsilon (a regression anchor)
CASES = {
    (1, 8, 1, 1.0, 2): 1.9889,
    (1, 8, 1, 0.3, 3): 0.8719,
    (1, 12, 2, 0.5, 2): 2.2363,
}


@pytest.mark.parametrize("case", list(CASES))
def test_reported_epsilon_is_never_below_the_exact_one(case):
    """Coarse noise, 1-d, sensitivity = the shift: both accountants report at least the exact epsilon."""
    variance, shares, shift, q, rounds = case
    truth = exact_epsilon(variance, shares, shift, q, rounds)
    assert truth == pytest.approx(CASES[case], abs=2e-3)
    ddg = {
        "dim": 1,
        "clip": 1.0,
        "gamma": 1.0,
        "bits": 16,
        "beta": 0.5,
        "variance": variance,
        "shares": shares,
        "max_summands": shares,
        "sensitivity_sq": float(shift) ** 2,
    }
    for kind in ("pld", "rdp"):
        reported = DdgRoundAccountant(q, ddg, DELTA, kind=kind).epsilon_after(rounds)
        assert truth <= reported, kind
