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
from functools import lru_cache

import dp_accounting
from dp_accounting import pld, rdp

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")


def _accountant(kind: str, replace_one: bool = False) -> dp_accounting.PrivacyAccountant:
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
        acc = _accountant(kind, replace_one)
        acc.compose(event)
        return float(acc.get_epsilon(delta))
    finally:
        absl_log.setLevel(level)


@lru_cache(maxsize=4096)
def epsilon(q: float, noise_multiplier: float, steps: int, delta: float, kind: str = "rdp") -> float:
    """epsilon at ``delta`` after ``steps`` Poisson-subsampled Gaussian steps (inf without noise)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    return _epsilon_of(subsampled_gaussian(q, noise_multiplier, steps), delta, kind)


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


class RoundAccountant:
    """User-level accounting for central and distributed DP: one subsampled Gaussian per round.

    ``sampling="poisson"``: rate ``q``, add/remove-one client. ``sampling="fixed"``: exactly
    ``sample_size`` of ``num_clients`` per round, replace-one client (RDP only). Every round
    that starts is charged, whether or not anyone took part and whether or not it completed:
    what it releases (or that it released nothing) depends only on the sampling."""

    def __init__(
        self,
        q: float,
        noise_multiplier: float,
        delta: float,
        kind: str = "rdp",
        *,
        sampling: str = "poisson",
        num_clients: int | None = None,
        sample_size: int | None = None,
    ):
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling = {sampling!r} is not one of {SAMPLINGS}")
        if sampling == "fixed" and (num_clients is None or sample_size is None):
            raise ValueError("fixed-size sampling needs num_clients and sample_size")
        self.q, self.z, self.delta, self.kind = min(q, 1.0), noise_multiplier, delta, kind
        self.sampling, self.num_clients, self.sample_size = sampling, num_clients, sample_size
        if sampling == "fixed":
            _accountant(kind, replace_one=True)  # refuses PLD up front
        self.rounds = 0

    def epsilon_after(self, rounds: int) -> float:
        if self.sampling == "fixed":
            return epsilon_fixed_size(self.num_clients, self.sample_size, self.z, rounds, self.delta)
        return epsilon(self.q, self.z, rounds, self.delta, self.kind)

    def describe(self) -> str:
        """The analysis behind the reported epsilon, for summaries and logs."""
        if self.sampling == "fixed":
            return (
                f"fixed-size sampling of {self.sample_size} of {self.num_clients} clients without replacement, "
                f"replace-one client (sensitivity 2C, so multiplier z/2 = {self.z / 2:g}), "
                "RDP of the sampled-without-replacement Gaussian (Wang, Balle, Kasiviswanathan 2019)"
            )
        return (
            f"Poisson sampling of clients (q = {self.q:.4g}), add/remove-one client, "
            f"{self.kind.upper()} of the Poisson-subsampled Gaussian (z = {self.z:g})"
        )

    @property
    def epsilon(self) -> float:
        return self.epsilon_after(self.rounds)

    def next_epsilon(self) -> float:
        """epsilon if one more round runs: what a budget check must look at."""
        return self.epsilon_after(self.rounds + 1)

    def record_round(self, participants: list[str]) -> None:
        self.rounds += 1


class LocalDpSgdAccountant:
    """Example-level accounting for local DP-SGD, per client, over its realised participation.

    Client selection does not look at the data, so conditioning on which rounds a client
    took part in is sound; the reported epsilon is the worst over all clients. Each
    participation is ``steps_k = epochs * round(n_k / B)`` steps with rate ``B / n_k``.
    """

    def __init__(
        self, schedules: dict[str, tuple[float, int]], noise_multiplier: float, delta: float, kind: str = "rdp"
    ):
        """``schedules``: client id -> (sampling rate, steps per participation), see dp_sgd_schedule."""
        self.z, self.delta, self.kind = noise_multiplier, delta, kind
        self._rate_steps = dict(schedules)
        self.participations: dict[str, int] = {}

    def _eps(self, counts: dict[str, int]) -> float:
        keys = {(self._rate_steps[c], k) for c, k in counts.items() if k > 0}
        return max((epsilon(q, self.z, s * k, self.delta, self.kind) for (q, s), k in keys), default=0.0)

    @property
    def epsilon(self) -> float:
        return self._eps(self.participations)

    def next_epsilon(self) -> float:
        """Worst case of one more round: any client (also one not yet seen) may be picked."""
        by_schedule: dict[tuple[float, int], int] = {}
        for c, rs in self._rate_steps.items():
            by_schedule[rs] = max(by_schedule.get(rs, 0), self.participations.get(c, 0) + 1)
        return max((epsilon(q, self.z, s * k, self.delta, self.kind) for (q, s), k in by_schedule.items()), default=0.0)

    def describe(self) -> str:
        return (
            f"example-level DP-SGD per client: Poisson sampling of examples (rate B/n_k) and "
            f"{self.kind.upper()} composition over each client's realised participations, add/remove-one "
            f"example; the worst client is reported (z = {self.z:g})"
        )

    def record_round(self, participants: list[str]) -> None:
        for c in participants:
            self.participations[c] = self.participations.get(c, 0) + 1


def dp_sgd_schedule(n: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(sampling rate, steps per participation) of DP-SGD on ``n`` examples with expected batch B:
    rate B / n, ``epochs * round(n / B)`` steps (Opacus' Poisson loader makes the same count)."""
    b = min(batch_size, n)
    return b / n, epochs * max(1, round(n / b))
