"""The mixture accountant of aborted rounds released as empty ones (shoal.accounting_mixture) against an
independent numpy computation of the branch-revealed pair: one round's hockey-stick divergence is the
branches' weighted sum of the Poisson-subsampled Gaussian's (both directions, integrated on a grid),
and its Rényi divergence of order a satisfies exp((a-1) D) = sum_i p_i exp((a-1) D_i)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shoal.accounting import LEDGER_ORDERS
from shoal.accounting_aborts import abort_branches, abort_delta
from shoal.accounting_mixture import mixture_pld_epsilon
from shoal.accounting_rounds import mixed_ledger_epsilon

Q, Z = 0.5, 1.0
BRANCHES = abort_branches(10, Q, 3, 10)  # N = 10, K = 5, t = 3: (0, .0195), (1, .910), (3, .0703)
X = np.linspace(-12.0, 15.0, 54_001)  # the Gaussians' mass beyond is below 1e-30


def _pdf(mu: float) -> np.ndarray:
    return np.exp(-((X - mu) ** 2) / (2 * Z * Z)) / math.sqrt(2 * math.pi * Z * Z)


def _delta(eps: float) -> float:
    """max over both directions of sum_i p_i H_{e^eps}(pair_i), H by the trapezoid rule."""
    base = _pdf(0.0)
    out = []
    for direction in (0, 1):
        total = 0.0
        for s, p in BRANCHES:
            mixed = (1 - Q) * base + Q * _pdf(s)
            a, b = (mixed, base) if direction == 0 else (base, mixed)
            total += p * float(np.trapezoid(np.maximum(a - math.exp(eps) * b, 0.0), X))
        out.append(total)
    return max(out)


def _epsilon(delta: float) -> float:
    lo, hi = 0.0, 20.0
    for _ in range(32):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _delta(mid) > delta else (lo, mid)
    return hi


def test_one_rounds_epsilon_is_the_branch_revealed_mixtures_within_the_discretisation():
    # m ~ Bin(9, 1/2): m <= 1 (x alone or with one other: noise either way) 10/512, m = 2 36/512
    assert [s for s, _ in BRANCHES] == [0.0, 1.0, 3.0]
    assert [p for _, p in BRANCHES] == pytest.approx([10 / 512, 466 / 512, 36 / 512])
    for delta in (1e-2, 1e-3):
        exact = _epsilon(delta)
        priced = mixture_pld_epsilon(((Q, Z, BRANCHES, 1),), delta)
        assert exact <= priced <= exact + 2e-3  # PLD's pessimistic rounding: an upper bound, close


def test_the_rdp_curve_is_the_mixture_of_the_branches_curves():
    entry = {"mechanism": "gaussian", "sampling": "poisson", "q": Q, "z": Z, "rounds": 1}
    entry["abort_branches"] = [list(b) for b in BRANCHES]
    from shoal.accounting_rounds import entry_rdp

    curve = entry_rdp(entry)
    x = np.linspace(-12.0, 30.0, 84_001)  # wide enough for order 4's integrand, peaking near a s = 12
    base = np.exp(-(x**2) / (2 * Z * Z)) / math.sqrt(2 * math.pi * Z * Z)
    for a in (2, 3, 4):
        i = LEDGER_ORDERS.index(a)
        acc = 0.0
        for s, p in BRANCHES:  # the add direction's Rényi divergence D_a(mixed || base), integrated
            ratio = (1 - Q) + Q * np.exp((s * x - s * s / 2) / (Z * Z))  # mixed / base
            d_a = math.log(float(np.trapezoid(base * ratio**a, x))) / (a - 1)
            acc += p * math.exp((a - 1) * d_a)
        assert curve[i] == pytest.approx(math.log(acc) / (a - 1), rel=1e-6)


def test_the_mixture_is_never_above_the_union_bound():
    """N = 1000, K = 100, t = 51: the union bound (phi a round added to delta) against the mixture at the
    same total delta; the mixture charges the same rare branch with its tail at worst."""
    from shoal.accounting import epsilon

    n, q, t, k_max, rounds, delta = 1000, 0.1, 51, 177, 50, 1e-5
    phi = abort_delta(n, q, t, k_max)
    entry = {"mechanism": "gaussian", "sampling": "poisson", "q": q, "z": 1.0, "rounds": rounds}
    entry["abort_branches"] = [list(b) for b in abort_branches(n, q, t, k_max)]
    union = epsilon(q, 1.0, rounds, delta - rounds * phi, "pld")
    assert mixed_ledger_epsilon([entry], delta, "pld") <= union + 1e-9
