"""Privacy accounting with Google's ``dp-accounting`` (RDP or PLD); no accountant of our own.

Each mechanism is accounted for the sampling the rounds actually do (docs/privacy.md):

* central / distributed DP (user-level), ``privacy.sampling = "poisson"`` (the default): every
  client joins a round independently with probability q = K/N (McMahan et al. 2018,
  Algorithm 1); one ``PoissonSampledDpEvent(q, Gaussian(z))`` per round, add/remove-one client.
* central / distributed DP, ``privacy.sampling = "fixed"``: exactly K of N clients per round,
  uniformly without replacement; one ``SampledWithoutReplacementDpEvent(N, K, Gaussian(z/2))``
  per round under the replace-one relation (Wang, Balle, Kasiviswanathan 2019, Thm. 27). Replacing
  one client's update moves the clipped sum by up to 2C, so the noise multiplier relative to that
  sensitivity is z/2. RDP only: dp-accounting's PLD accountant has no such event.
* local DP-SGD (example-level, per client): one Poisson event per local step, rate q = B/n_k,
  composed over the steps of every round the client took part in (add/remove-one example).
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol

# dp-accounting is imported where it is used: it pulls in scipy (about 0.8 s), which a run or a
# process without differential privacy (a peer, a node, a server) never needs at start-up.
if TYPE_CHECKING:
    import dp_accounting

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")


def make_accountant(kind: str, replace_one: bool = False) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant of ``kind``; ValueError for PLD with replace-one (no such event)."""
    import dp_accounting
    from dp_accounting import pld, rdp

    if replace_one:
        if kind != "rdp":
            raise ValueError(
                "fixed-size (without replacement) sampling is accounted with RDP only; "
                "dp-accounting's PLD accountant has no SampledWithoutReplacementDpEvent"
            )
        return rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    if kind == "rdp":
        return rdp.RdpAccountant()
    if kind == "pld":
        return pld.PLDAccountant()
    raise ValueError(f"accountant {kind!r} is not one of {ACCOUNTANTS}")


def subsampled_gaussian(q: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """``steps`` compositions of the Gaussian mechanism with Poisson sampling rate ``q``."""
    import dp_accounting

    if steps <= 0:
        return dp_accounting.NoOpDpEvent()
    if q >= 1.0:
        return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), steps)
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise_multiplier)), steps
    )


def fixed_size_gaussian(
    num_clients: int, sample_size: int, noise_multiplier: float, steps: int
) -> dp_accounting.DpEvent:
    """``steps`` rounds of K-of-N sampling without replacement, then a Gaussian of std z*C on a
    sum whose replace-one sensitivity is 2C: a Gaussian of multiplier z/2 for the accountant."""
    import dp_accounting

    if steps <= 0:
        return dp_accounting.NoOpDpEvent()
    inner = dp_accounting.GaussianDpEvent(noise_multiplier / 2)
    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(num_clients, sample_size, inner), steps
    )


def _epsilon_of(event: dp_accounting.DpEvent, delta: float, kind: str, replace_one: bool = False) -> float:
    # For small z the RDP series of some fractional orders does not converge; dp-accounting
    # then drops those orders (the bound stays valid, maybe looser) and warns once per order.
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        if kind == "rdp":
            return _rdp_epsilon(event, delta, replace_one)
        acc = make_accountant(kind, replace_one)
        acc.compose(event)
        return float(acc.get_epsilon(delta))
    finally:
        absl_log.setLevel(level)


def _rdp_epsilon(event: dp_accounting.DpEvent, delta: float, replace_one: bool) -> float:
    """What dp-accounting's RDP accountant answers for ``event``, with each distinct mechanism's
    RDP curve computed once per process: RDP composes by adding curves, so ``count`` rounds of one
    mechanism are ``count x`` its curve. An accountant asked after every round (the simulator, the
    server, the ledger audit) otherwise recomputes the same curve each time (0.2-0.5 s)."""
    import numpy as np
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    total: np.ndarray | None = None
    orders: np.ndarray | None = None
    for base, count in _flatten(event, 1):
        orders, curve = _rdp_curve(base, replace_one)
        total = count * curve if total is None else total + count * curve
    if total is None or orders is None:
        return 0.0
    return float(compute_epsilon(orders, total, delta)[0])


def _flatten(event: dp_accounting.DpEvent, count: int) -> list[tuple[dp_accounting.DpEvent, int]]:
    """(mechanism, times composed) pairs of a tree of Composed / SelfComposed events."""
    import dp_accounting

    if isinstance(event, dp_accounting.NoOpDpEvent):
        return []
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _flatten(event.event, count * event.count) if event.count > 0 else []
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return [pair for e in event.events for pair in _flatten(e, count)]
    return [(event, count)]


@lru_cache(maxsize=256)
def _rdp_curve(event: dp_accounting.DpEvent, replace_one: bool) -> tuple:
    """(orders, RDP at each order) of one ``event``, as dp-accounting's RDP accountant computes it
    (its default orders). The accountant has no getter for its curve: read from its fields, and a
    version that renamed them fails loudly here, not with a wrong figure."""
    acc = make_accountant("rdp", replace_one)
    acc.compose(event)
    orders, rdp = getattr(acc, "_orders"), getattr(acc, "_rdp")  # noqa: B009 (no public getter)
    return orders.copy(), rdp.copy()


@lru_cache(maxsize=4096)
def epsilon(q: float, noise_multiplier: float, steps: int, delta: float, kind: str = "rdp") -> float:
    """epsilon at ``delta`` after ``steps`` Poisson-subsampled Gaussian steps (inf without noise)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    return _epsilon_of(subsampled_gaussian(q, noise_multiplier, steps), delta, kind)


@lru_cache(maxsize=4096)
def gaussian_epsilon(noise_multiplier: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of one (unsampled) Gaussian mechanism of sensitivity 1 and
    noise std ``noise_multiplier``, from its privacy profile (Balle and Wang 2018, Theorem 8):
    delta(eps) = Phi(1/(2z) - eps z) - e^eps Phi(-1/(2z) - eps z), solved for eps by bisection.
    k Gaussians of multipliers z_i compose to one of multiplier (sum 1/z_i^2)^-1/2. dp-accounting's
    PLD of the same mechanism is an upper bound on this figure (its discretisation), and takes
    seconds where this takes microseconds."""
    if noise_multiplier <= 0:
        return math.inf
    z = noise_multiplier

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2.0))

    def delta_of(eps: float) -> float:
        tail = phi(-1 / (2 * z) - eps * z)
        return phi(1 / (2 * z) - eps * z) - (math.exp(eps + math.log(tail)) if tail > 0 else 0.0)

    if delta_of(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        lo, hi = hi, 2 * hi
        if hi > 1e6:
            return math.inf
    for _ in range(200):
        mid = (lo + hi) / 2
        if delta_of(mid) > delta:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return hi  # delta(hi) <= delta: never below the true epsilon


@lru_cache(maxsize=4096)
def epsilon_fixed_size(num_clients: int, sample_size: int, noise_multiplier: float, steps: int, delta: float) -> float:
    """epsilon (replace-one, RDP) after ``steps`` rounds that each take exactly ``sample_size``
    of ``num_clients`` clients without replacement (see :func:`fixed_size_gaussian`)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    if not 1 <= sample_size <= num_clients:
        raise ValueError(f"sample_size = {sample_size} must be in [1, num_clients = {num_clients}]")
    return _epsilon_of(
        fixed_size_gaussian(num_clients, sample_size, noise_multiplier, steps), delta, "rdp", replace_one=True
    )


def check_delta_against(delta: float, n: int, unit: str) -> None:
    """Refuse delta >= 1/N (ValueError naming the numbers), N the count the guarantee is about
    (clients for user-level DP, examples for DP-SGD). A mechanism that publishes one of N
    records in the clear meets (0, 1/N)-DP, so such a delta promises nothing; warn above
    1/(10 N), where the usual advice (delta well below 1/N) is not met."""
    if n <= 0:
        return
    if delta >= 1.0 / n:
        raise ValueError(
            f"privacy.delta = {delta:g} is at least 1/N = {1.0 / n:.3g} (N = {n} {unit}): an epsilon at that "
            f"delta allows publishing a record in the clear; set privacy.delta below {0.1 / n:.3g}"
        )
    if delta > 0.1 / n:
        log.warning(
            "privacy.delta = %g is above 1/(10 N) = %.3g (N = %d %s): delta should be well below 1/N",
            delta,
            0.1 / n,
            n,
            unit,
        )


def budget_allows(accountant, target: float, delta: float) -> bool:
    """Whether one more round keeps epsilon within ``target`` (0 = no limit); logs why not.
    ``accountant``: anything with ``epsilon`` and ``next_epsilon()`` (every accountant here)."""
    if not target:
        return True
    nxt = accountant.next_epsilon()
    if nxt <= target:
        return True
    log.warning(
        "stopping: privacy budget reached (epsilon = %.4g now, %.4g after one more round > "
        "privacy.target_epsilon = %g at delta = %g)",
        accountant.epsilon,
        nxt,
        target,
        delta,
    )
    return False


@lru_cache(maxsize=1024)
def epsilon_of_segments(segments: tuple[tuple, ...], delta: float, kind: str) -> float:
    """epsilon at ``delta`` of rounds run with different parameters, composed as they ran:
    ``segments`` are (sampling, q, z, num_clients, sample_size, rounds) tuples."""
    if any(z <= 0 for _, _, z, _, _, r in segments if r > 0):
        return float("inf")
    fixed = any(s == "fixed" for s, *_ in segments)
    if fixed and any(s != "fixed" for s, *_ in segments):
        raise ValueError("a ledger mixes fixed-size and Poisson rounds: their neighbouring relations differ")
    events = [
        fixed_size_gaussian(n, k, z, r) if s == "fixed" else subsampled_gaussian(min(q, 1.0), z, r)
        for s, q, z, n, k, r in segments
        if r > 0
    ]
    if not events:
        return 0.0
    import dp_accounting

    return _epsilon_of(dp_accounting.ComposedDpEvent(events), delta, kind if not fixed else "rdp", replace_one=fixed)


class Accountant(Protocol):
    """What every accountant here offers (RoundAccountant, LocalDpSgdAccountant), so the
    simulator, the server, nodes and peers use them alike; ``state_dict`` / ``load_state_dict``
    keep and restore what was charged (as Opacus' accountants do), never by writing internals."""

    @property
    def epsilon(self) -> float: ...

    def next_epsilon(self) -> float: ...

    def record_round(self, participants: list[str]) -> None: ...

    def describe(self) -> str: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# RDP at integer orders: what the discrete Gaussian's curve (shoal.accounting_ddg) is evaluated at, and
# where a ledger that mixes it with the continuous Gaussian is composed (shoal.accounting_rounds).
LEDGER_ORDERS = tuple(range(2, 257))


def rdp_to_epsilon(orders, rdps, delta: float) -> float:
    """(epsilon, delta) from an RDP curve: min over orders of rdp + log((a-1)/a) - (log delta + log a)/(a-1)
    (Canonne, Kamath, Steinke 2020, Prop. 12; the conversion dp-accounting's RDP accountant uses)."""
    best = math.inf
    for a, r in zip(orders, rdps, strict=True):
        if math.isfinite(r):
            best = min(best, r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return max(best, 0.0)
