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


# --- PLD: the round as a continuous Gaussian up to a pointwise factor --------------------------
#
# Why this holds (docs/privacy.md, "PLD for the discrete Gaussian"). Write theta(w) for an upper
# bound on 2 sum_{j>=1} exp(-2 pi^2 w j^2); by Poisson summation, sum_k exp(-(k-c)^2/2w) lies within
# sqrt(2 pi w) (1 +- theta(w)) for every real c. Then, per coordinate:
# (1) the sum of t shares N_Z(0, v) has, at every integer m, a probability within
#     [(1+theta(v))^-t prod_{k<t} (1-theta(kv/(k+1))), prod_{k<t} (1+theta(kv/(k+1)))] times the
#     Gaussian density phi_{tv}(m) (induction over the shares, one convolution at a time: adding a
#     share to k of them sums exp(-(j-c)^2/2w) over j with w = kv/(k+1); the upper factor has no
#     (1-theta(v))^-t because N_Z(0, v)'s normaliser, the sum at c = 0, is at least sqrt(2 pi v));
# (2) rounding a continuous Y ~ N(x, tv - r^2) to the integer k with probability proportional to
#     exp(-(k-Y)^2/2r^2) gives k with probability within [1/(1+theta(r^2)), 1/(1-theta(r^2))] times
#     phi_{tv}(k - x), and commutes with integer shifts x.
# So the round's output, for every neighbouring input, is within a factor e^{+-b} (b summed over the
# coordinates) of a post-processing of the continuous Gaussian mechanism of std sqrt(tv - r^2) and
# L2 sensitivity Delta_2/gamma. Pointwise factors survive Poisson sampling (mixtures), adaptive
# composition (they multiply: B = sum of the rounds' b) and post-processing, and turn a hockey-stick
# divergence H_{e^eps} of the Gaussian pair into one of at most e^B H_{e^(eps-2B)}: so the rounds'
# epsilon at delta is at most the continuous Gaussian's epsilon at delta e^-B, plus 2B, and the
# Gaussian's is priced by dp-accounting's PLD (Poisson subsampling exact, pessimistic rounding).
# tests/privacy/test_ddg_bound_exact.py checks (1), (1)+(2) against e^{+-b}, and the reported epsilon
# against the exact one, numerically at integer variance 1-2 a share (where b is largest).
# More shares than t, the server's top-up and the modular reduction are post-processing: the top-up
# adds integer shares (DdgCodec.top_up), so every released sum carries exactly K_max of them whatever
# the count (a continuous top-up would not be: it leaves a sum of all K_max on the lattice alone).

ROUNDING_VAR = 4.0  # r^2 of step (2): theta(4) < 1e-34, and 4 of the sum's integer variance is lost


def theta(w: float) -> float:
    """An upper bound on 2 sum_{j>=1} exp(-2 pi^2 w j^2) (j^2 >= 1 + 3(j - 1): a geometric series)."""
    if w <= 0:
        return math.inf
    c = 2.0 * math.pi**2 * w
    return 2.0 * math.exp(-c) / -math.expm1(-3.0 * c)


@lru_cache(maxsize=1024)
def ddg_gaussian_equivalent(
    variance: int, shares: int, dim: int, sensitivity_sq: float, gamma: float
) -> tuple[float, float]:
    """(z, b) of one unsampled round of the distributed discrete Gaussian: it is a post-processing of
    the continuous Gaussian mechanism of noise multiplier z, up to a pointwise factor e^{+-b} on its
    output probabilities (see above). (0, inf) when the shares' noise is too small for the bound."""
    total = shares * variance - ROUNDING_VAR
    sens = math.sqrt(sensitivity_sq) / gamma  # Delta_2 in steps of gamma
    terms = [theta(variance * k / (k + 1)) for k in range(1, shares)]
    worst = max([theta(variance), theta(ROUNDING_VAR), *terms])
    if total <= 0 or sens <= 0 or worst >= 1:
        return 0.0, math.inf
    per_coordinate = (
        shares * math.log1p(theta(variance)) - sum(math.log1p(-t) for t in terms) - math.log1p(-theta(ROUNDING_VAR))
    )
    return math.sqrt(total) / sens, dim * per_coordinate


def ddg_round_gaussian(e: dict) -> tuple[float, float]:
    """(z, b) of one unsampled round recorded as ledger entry ``e``, its noised round figures
    (``release_z``: two Gaussians of that multiplier on the same sample) composed in: Gaussians of
    multipliers z_i compose to one of multiplier (sum z_i^-2)^-1/2."""
    z, b = ddg_gaussian_equivalent(
        int(e["variance"]), int(e["shares"]), int(e["dim"]), float(e["sensitivity_sq"]), float(e["gamma"])
    )
    release_z = float(e.get("release_z", 0.0))
    if z > 0 and release_z > 0:
        z = (z**-2 + 2 * release_z**-2) ** -0.5
    return z, b
