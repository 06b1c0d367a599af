"""The distributed discrete Gaussian's privacy (Kairouz, Liu, Steinke 2021): its RDP curve from the
paper's bound, amplified by Poisson sampling with Zhu and Wang's general bound; the parameters a
ledger records for it (:data:`DDG_KEYS`). The round accountant that uses them is
shoal.accounting_rounds.DdgRoundAccountant."""

from __future__ import annotations

import math
from functools import cache, lru_cache

from shoal.accounting import LEDGER_ORDERS

# dp-accounting has no event for it, so its RDP curve is computed here from the paper's bound and
# amplified by Poisson sampling with Zhu and Wang's general bound; every order is an integer.


def ddg_tau(variance: int, summands: int) -> float:
    """The paper's tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 (sigma^2/gamma^2) k/(k+1)): how far the sum
    of n discrete Gaussians of integer variance sigma^2/gamma^2 is from one discrete Gaussian."""
    return 10.0 * sum(math.exp(-2.0 * math.pi**2 * variance * k / (k + 1)) for k in range(1, summands))


def ddg_rdp(
    order: float, sensitivity_sq: float, client_var: float, variance: int, dim: int, shares: int, summands: int
) -> float:
    """RDP of one unsampled round at ``order``: the paper's bound for the sum of n clients' discrete
    Gaussians (Theorem 1 in RDP form, its Eq. 17): min(a s^2/2 + tau d, a/2 (s + sqrt(d) tau)^2), with
    s^2 = Delta_2^2 / (n sigma^2). The sum holds at least ``shares`` = t and at most ``summands``
    shares; s is taken at t and tau at the most summands, both the worst case."""
    if client_var <= 0:
        return math.inf
    s = math.sqrt(sensitivity_sq / (shares * client_var))
    tau = ddg_tau(variance, summands)
    return min(order * s * s / 2 + tau * dim, order / 2 * (s + math.sqrt(dim) * tau) ** 2)


def poisson_subsampled_rdp(q: float, rdp, order: int) -> float:
    """Zhu and Wang 2019 (Theorem 6): RDP at integer ``order`` >= 2 of a mechanism with RDP curve
    ``rdp`` run on a Poisson sample of rate q (add/remove-one), never above the unsampled curve."""
    if q >= 1.0:
        return rdp(order)
    if q <= 0.0:
        return 0.0
    a = int(order)
    lq, l1q = math.log(q), math.log1p(-q)

    def log_comb(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    terms = [(a - 1) * l1q + math.log(a * q - q + 1), log_comb(a, 2) + 2 * lq + (a - 2) * l1q + rdp(2)]
    terms += [math.log(3) + log_comb(a, j) + j * lq + (a - j) * l1q + (j - 1) * rdp(j) for j in range(3, a + 1)]
    top = max(terms)
    bound = (top + math.log(sum(math.exp(t - top) for t in terms))) / (a - 1)
    return min(bound, rdp(a))


def released_figures_rdp(order: float, release_z: float) -> float:
    """RDP at ``order`` of ``privacy.release = "noised"``'s two figures, unsampled: the result count
    (sensitivity 1, noise std sigma) and the clipped loss sum (sensitivity L, std sigma L), each a
    Gaussian of multiplier sigma = ``release_z``: 2 x order / (2 sigma^2). 0 without the release."""
    return order / release_z**2 if release_z > 0 else 0.0


@lru_cache(maxsize=1024)
def ddg_round_rdp(
    q: float,
    sensitivity_sq: float,
    client_var: float,
    variance: int,
    dim: int,
    shares: int,
    summands: int,
    release_z: float = 0.0,
) -> tuple[float, ...]:
    """One round's RDP at each of LEDGER_ORDERS (Poisson-sampled at rate q). The noised figures of the
    round (``release_z`` > 0) are computed on the same sample as the model's sum, so the unsampled
    round is the composition of both (their RDP curves add at every order) and the sampling
    amplifies that whole curve."""

    @cache
    def curve(a: int) -> float:
        return ddg_rdp(a, sensitivity_sq, client_var, variance, dim, shares, summands) + released_figures_rdp(
            a, release_z
        )

    return tuple(poisson_subsampled_rdp(q, curve, a) for a in LEDGER_ORDERS)


DDG_KEYS = ("dim", "clip", "gamma", "bits", "beta", "variance", "shares", "max_summands", "sensitivity_sq")
