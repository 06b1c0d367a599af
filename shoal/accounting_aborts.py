"""What aborted secure rounds cost under Poisson sampling: a failure probability added to delta (the
union bound, for aborts that release nothing) or, where an abort is released as an empty round (the
simulator and `shoal server` under distributed DP), a mixture of sensitivities (the last section).

Distributed DP with secure aggregation aborts a round whose survivors number fewer than t (nothing
is unmasked; the model stays) or whose selection exceeds K_max (the encoding's headroom). Whether a
round aborts depends on who was sampled, so it is a release the Gaussian accountant does not price:
with client x sampled and exactly t - 1 others the round releases the sum of t updates, without x
it aborts, and the release moves by up to t C, not C.

**The bound (per round, add/remove of client x, D' = D + {x}).** Condition on the others' outcome O
(who of D is sampled, m of them, and their updates), whose distribution is the same under D and D'
(Poisson sampling draws each client alone). Both releases are mixtures over O with the same
weights, so revealing O gives a dominating pair (hockey-stick divergences are jointly convex).
Given O, D releases the others' result and D' releases it with probability 1 - q (x not sampled)
and with x's participation with probability q. With no dropouts (section below) that is exactly
the subsampled Gaussian the accountant charges (sensitivity C, shifted by the others' sum), unless

* m = t_eff - 1 (with x the round releases a sum of t_eff updates, without x it aborts),
* m = 0 (without x an empty round releases its noise; with x alone the round aborts when t_eff >= 2),
* m >= K_max (with x the round passes K_max and aborts; without x it released up to K_max updates).

For those O reveal also whether x was sampled (a coin of probability q under both, so again a
dominating pair): not sampled, the releases are equal; sampled, bound the pair by one with disjoint
supports (infinite privacy loss). Each round is then dominated by "with probability phi an infinite
loss, otherwise the charged subsampled Gaussian" (a zero loss is dominated by it too), with
phi = q (P[m = t_eff - 1] + P[m = 0] + P[m >= K_max]), m ~ Binomial(N - 1, q), and T rounds compose
to delta_T(eps) = 1 - (1 - phi)^T (1 - delta_gauss(eps)) <= delta_gauss(eps) + T phi: the run's
epsilon holds at the accountant's delta plus the summed phi of its rounds (a ledger entry's
``abort_delta``, which ledgers written before aborts were released as empty rounds carry). With
dropouts the same argument with every O in the second list gives phi = q. :func:`abort_delta` is
kept to compare (bench/abort_accounting.py).

**The dropout model.** Without injected dropouts every sampled client's masked input reaches the
sum, the protocol's own thresholds (floor(f m) + 1 of m) never bind, and a round aborts exactly
when it selected m clients with 1 <= m < t_eff = max(t, secure_aggregation.min_inputs), or more than
K_max: phi is exact for that. With injected dropouts the protocol aborts at several stages against
thresholds that grow with m (so x's presence moves them), and a lost edge or the SecAgg+ graph
drops clients together; shoal does not bound those events, so phi takes its worst value q (the
probability x is sampled at all). Fixed-size sampling (replace-one) has no such event: the
sample's size does not depend on the data, so neither does an abort.
"""

from __future__ import annotations

from shoal.accounting_mixture import Branches, normalize
from shoal.config import Config


def _others(population: int, q: float):
    """m ~ Binomial(N - 1, q), the other clients a round samples (scipy.stats, imported here and not
    at the top: it takes ~2 s, every role's assembly imports this module, and only secure
    distributed DP calls it)."""
    from scipy.stats import binom

    return binom(population - 1, q)


def abort_delta(population: int, q: float, t: int, k_max: int) -> float:
    """phi of one Poisson round without dropouts (module doc): ``population`` N clients sampled at rate
    ``q``; a round of m selected uses its sum when t <= m <= K_max, aborts when 1 <= m < t or m > K_max."""
    if population < 1 or not 0 <= q <= 1 or t < 1 or k_max < t:
        raise ValueError(f"abort_delta: N = {population}, q = {q}, t = {t}, K_max = {k_max}")
    m = _others(population, q)
    boundary, nobody, too_many = float(m.pmf(t - 1)), float(m.pmf(0)), float(m.sf(k_max - 1))
    return min(q, q * (boundary + nobody + too_many))


# --- aborts released as empty rounds: a mixture, not a failure probability ---------------------
#
# When an aborted round releases exactly what a round that selected nobody releases (K_max noise
# shares, a new version, the same record), an abort is no event of its own: the round's release is
# f(S) = (sum of S's updates + noise) when t <= |S| <= K_max, else noise alone. With O revealed as
# above, given m the pair is the Poisson-subsampled Gaussian of sensitivity s(m) C: s = t at
# m = t - 1 (without x noise, with x a sum of t), s = K_max at m = K_max (without x a sum of K_max,
# with x the round passes K_max: noise), s = 0 for m <= t - 2 or m > K_max (noise either way, m = 0
# among them: x alone aborts, which now looks like nobody), s = 1 otherwise. Revealing m as well gives
# the dominating pair whose loss is the m-weighted mixture (shoal.accounting_mixture): at most the
# union bound's, since the tC and K_max C branches are dominated by the infinite loss it charges
# them and m = 0 costs nothing here.


def abort_branches(population: int, q: float, t: int, k_max: int) -> Branches:
    """The branches (s, P[m in the branch]) of one Poisson round without dropouts whose aborts release
    an empty round's noise (above), m ~ Binomial(N - 1, q)."""
    if population < 1 or not 0 <= q <= 1 or t < 1 or k_max < t:
        raise ValueError(f"abort_branches: N = {population}, q = {q}, t = {t}, K_max = {k_max}")
    m = _others(population, q)
    boundary, full = float(m.pmf(t - 1)), float(m.pmf(k_max))
    silent = (float(m.cdf(t - 2)) if t >= 2 else 0.0) + float(m.sf(k_max))
    plain = max(0.0, 1.0 - boundary - full - silent)
    return normalize([(0.0, silent), (1.0, plain), (float(t), boundary), (float(k_max), full)])


def flip_probability(population: int, q: float, t: int, k_max: int) -> float:
    """P[m = t - 1] + P[m = K_max]: the chance, without dropouts, that x's presence decides whether the
    round aborts; a declared bound (privacy.abort_bound) below it is refused."""
    m = _others(population, q)
    return float(m.pmf(t - 1)) + float(m.pmf(k_max))


def bounded_branches(bound: float, k_max: int) -> Branches:
    """The branches of a round whose dropouts nobody bounds but a declaration: with probability ``bound``
    (given x sampled) x's presence decides whether the round aborts, and then the release moves by at
    most K_max C (one side is noise alone, the other a sum of at most K_max updates: also where x's
    presence raised a stage threshold of the protocol, or passed K_max); otherwise by C."""
    if not 0 <= bound <= 1:
        raise ValueError(f"abort bound {bound} is not a probability")
    return normalize([(1.0, 1.0 - bound), (float(k_max), bound)])


def simulated_branches(cfg: Config, population: int, q: float, t: int, k_max: int) -> Branches | None:
    """The abort branches of a simulated secure round of distributed DP whose aborts release an empty
    round's noise: exact without injected dropouts, the worst case (K_max C whenever x is sampled)
    with them; None under fixed-size sampling (a sample's size does not depend on the data)."""
    sa = cfg.secure_aggregation
    if cfg.privacy.sampling == "fixed":
        return None
    t_eff = max(t, sa.min_inputs)
    if any(getattr(sa, f"dropout_{s}") > 0 for s in ("advertise", "share", "masked", "unmask")):
        return bounded_branches(1.0, max(k_max, t_eff))
    if cfg.hierarchy.edge_failure > 0:
        return bounded_branches(1.0, max(k_max, t_eff))
    return abort_branches(population, q, t_eff, max(k_max, t_eff))
