"""Privacy accounting with Google's ``dp-accounting`` (RDP or PLD); no accountant of our own.

Every mechanism shoal runs is a Poisson-subsampled Gaussian (Abadi et al. 2016), composed:

* central / distributed DP (user-level): one event per round, sampling rate
  q = clients_per_round / num_clients, noise multiplier z (McMahan et al. 2018).
* local DP-SGD (example-level, per client): one event per local step, sampling rate
  q = batch / n_k, composed over the steps of every round the client took part in.

Assumptions (docs/privacy.md): the accountant treats client (and example) sampling as
Poisson with rate q, the analysis of McMahan et al. 2018 and Abadi et al. 2016; the
simulator draws exactly K clients per round, which the accounting approximates by
Poisson(q = K/N). The add/remove-one neighbouring relation is used.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import dp_accounting
from dp_accounting import pld, rdp

ACCOUNTANTS = ("rdp", "pld")


def _accountant(kind: str) -> dp_accounting.PrivacyAccountant:
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


@lru_cache(maxsize=4096)
def epsilon(q: float, noise_multiplier: float, steps: int, delta: float, kind: str = "rdp") -> float:
    """epsilon at ``delta`` after ``steps`` subsampled-Gaussian steps (inf without noise)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return float("inf")
    # For small z the RDP series of some fractional orders does not converge; dp-accounting
    # then drops those orders (the bound stays valid, maybe looser) and warns once per order.
    absl_log = logging.getLogger("absl")
    level = absl_log.level
    absl_log.setLevel(logging.ERROR)
    try:
        acc = _accountant(kind)
        acc.compose(subsampled_gaussian(q, noise_multiplier, steps))
        return float(acc.get_epsilon(delta))
    finally:
        absl_log.setLevel(level)


class RoundAccountant:
    """User-level accounting for central and distributed DP: one subsampled Gaussian per round."""

    def __init__(self, q: float, noise_multiplier: float, delta: float, kind: str = "rdp"):
        self.q, self.z, self.delta, self.kind = min(q, 1.0), noise_multiplier, delta, kind
        self.rounds = 0

    def epsilon_after(self, rounds: int) -> float:
        return epsilon(self.q, self.z, rounds, self.delta, self.kind)

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

    def __init__(self, schedules: dict[str, tuple[float, int]], noise_multiplier: float, delta: float,
                 kind: str = "rdp"):
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

    def record_round(self, participants: list[str]) -> None:
        for c in participants:
            self.participations[c] = self.participations.get(c, 0) + 1


def dp_sgd_schedule(n: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(sampling rate, steps per participation) of DP-SGD on ``n`` examples with expected batch B:
    rate B / n, ``epochs * round(n / B)`` steps (Opacus' Poisson loader makes the same count)."""
    b = min(batch_size, n)
    return b / n, epochs * max(1, round(n / b))
