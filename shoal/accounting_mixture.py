"""Rounds whose sensitivity depends on the others' sample: a mixture of Poisson-subsampled Gaussians
with the branch revealed (the privacy loss of secure rounds whose aborts release what an empty round
releases: shoal.accounting_aborts says where the branches come from and why they dominate).

A round's **branches** are pairs (s, p), the p summing to 1: with probability p (over the others'
sample, the same with and without the client x) the round is the Poisson-subsampled Gaussian of
sensitivity s C (s = 0: the release does not depend on x). The dominating pair reveals the branch,
so its privacy loss distribution is the mixture of the branches' distributions (weights p), its
hockey-stick divergence the p-weighted sum of theirs, and its Rényi divergence of order a satisfies
exp((a-1) D_a) = sum_i p_i exp((a-1) D_a,i). Not dp-accounting's MixtureGaussianPrivacyLoss: that
is the pair with the branch hidden (one Gaussian against a mixture of shifts), smaller, and not a
dominating pair here, because the others' sum that the round releases beside x's update tells
about m, and so about the branch.
"""

from __future__ import annotations

import math
from functools import lru_cache

#: a round without aborts to price: sensitivity C always
PLAIN = ((1.0, 1.0),)

Branches = tuple[tuple[float, float], ...]


def normalize(branches) -> Branches:
    """``branches`` (a JSON list of [s, p] pairs, or a tuple) as a hashable tuple of floats, merged by
    s and without zero weights; ValueError unless every s >= 0, p >= 0 and the p sum to 1."""
    merged: dict[float, float] = {}
    try:
        for s, p in branches:
            s, p = float(s), float(p)
            if not (math.isfinite(s) and s >= 0 and 0 <= p <= 1):
                raise ValueError
            if p > 0:
                merged[s] = merged.get(s, 0.0) + p
    except (TypeError, ValueError):
        raise ValueError(
            f"abort branches must be [sensitivity >= 0, probability] pairs: {str(branches)[:200]}"
        ) from None
    if not math.isclose(sum(merged.values()), 1.0, abs_tol=1e-9):
        raise ValueError(f"abort branches' probabilities sum to {sum(merged.values())!r}, not 1")
    return tuple(sorted(merged.items()))


def as_json(branches: Branches) -> list[list[float]]:
    """What a ledger entry records (lists, so a restored entry compares equal)."""
    return [[float(s), float(p)] for s, p in branches]


def split_tail(branches: Branches, rarer_than: float = 1.0) -> tuple[Branches, float]:
    """(the rest, renormalised; the probability of the branches above sensitivity C that are at most
    ``rarer_than`` probable). Charging those as an infinite loss (their probability times q added to
    delta, the union bound of shoal.accounting_aborts) dominates them too, and is the tighter of the two
    where they are rare and large (an RDP curve cannot price a rare branch of sensitivity 51 C). A rest
    of sensitivities 0 and C alone is PLAIN (a zero loss is dominated by C's), so it is priced exactly
    as a round without aborts."""
    tail = sum(p for s, p in branches if s > 1 and p <= rarer_than)
    kept = [(s, p / (1.0 - tail)) for s, p in branches if not (s > 1 and p <= rarer_than)] if tail < 1 else []
    if all(s <= 1 for s, _ in kept):
        return PLAIN, tail
    return normalize(kept), tail


def mixture_rdp(curves: list[tuple[float, tuple[float, ...] | None]], orders: tuple[int, ...]) -> tuple[float, ...]:
    """RDP at ``orders`` of the branch-revealed mixture of mechanisms with RDP ``curves`` (weight, curve)
    (a curve of None: the branch releases nothing of x, RDP 0)."""
    out = []
    for i, a in enumerate(orders):
        terms = [(math.log(w) + (a - 1) * (0.0 if c is None else c[i])) for w, c in curves if w > 0]
        top = max(terms)
        out.append((top + math.log(sum(math.exp(t - top) for t in terms))) / (a - 1))
    return tuple(out)


#: a branch at most this probable is charged as an infinite loss (its weight times q added to delta):
#: that dominates it, and keeps a rare branch of large sensitivity from widening the discretisation
NEGLIGIBLE = 1e-10


def interval_for(z: float, branches: Branches) -> float:
    """The PLD's discretisation: 1e-4 (dp-accounting's default) unless the largest branch's losses span
    so wide a range that its pmf would pass ~2e5 points; coarser is still an upper bound (pessimistic)."""
    top = max((s for s, p in branches if p > NEGLIGIBLE), default=0.0) / z if z > 0 else math.inf
    span = top * top / 2 + 12 * top  # the privacy loss's range over the Gaussian's bulk
    return max(1e-4, span / 2e5)


@lru_cache(maxsize=256)
def round_pld(q: float, z: float, branches: Branches, interval: float):
    """dp-accounting's PLD of one round: the branches' Poisson-subsampled Gaussians (multiplier z for
    sensitivity 1, rate q) mixed with their weights."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    mix, weight = None, 0.0
    for s, p in branches:
        if s <= 0 or q <= 0:
            part = pld.identity(interval)
        elif p <= NEGLIGIBLE:  # with probability q an infinite loss, else none
            loss = {0: 1.0 - min(q, 1.0)}
            part = pld.PrivacyLossDistribution.create_from_rounded_probability(loss, min(q, 1.0), interval)
        else:
            part = pld.from_gaussian_mechanism(
                z / s, sensitivity=1.0, sampling_prob=min(q, 1.0), value_discretization_interval=interval
            )
        weight += p
        mix = part if mix is None else part.compute_mixture(mix, p / weight)
    return mix


@lru_cache(maxsize=256)
def mixture_pld_epsilon(segments: tuple[tuple[float, float, Branches, int], ...], delta: float) -> float:
    """epsilon at ``delta`` of rounds (q, z, branches, rounds), composed by dp-accounting's PLD."""
    live = [seg for seg in segments if seg[3] > 0]
    if not live:
        return 0.0
    if any(z <= 0 for _, z, br, _ in live if any(s > 0 for s, _ in br)):
        return math.inf
    interval = max(interval_for(z, br) for _, z, br, _ in live)
    total = None
    for q, z, br, rounds in live:
        step = round_pld(q, z, br, interval).self_compose(rounds)
        total = step if total is None else total.compose(step)
    assert total is not None
    return max(0.0, float(total.get_epsilon_for_delta(delta)))
