"""Example-level accounting of local DP-SGD, per client over its realised participation
(:class:`LocalDpSgdAccountant`), and the DP-SGD schedule it charges (:func:`dp_sgd_schedule`)."""

from __future__ import annotations

from shoal.accounting import epsilon
from shoal.config import PrivacyConfig, TrainConfig


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
            "example-level DP-SGD per client: Poisson sampling of examples (rate B/n_k, or "
            "privacy.local_sampling_rate) in each client's steps a round (privacy.local_schedule), "
            f"{self.kind.upper()} composition over each client's realised participations, add/remove-one "
            f"example; the worst client is reported (z = {self.z:g})"
        )

    def record_round(self, participants: list[str]) -> None:
        for c in participants:
            self.participations[c] = self.participations.get(c, 0) + 1

    def rounds_of(self, client: str) -> int:
        """The rounds ``client`` took part in (was charged for)."""
        return self.participations.get(client, 0)

    def epsilon_of(self, client: str, participations: int) -> float:
        """epsilon of ``participations`` rounds of ``client`` on its own schedule (the canary audit's)."""
        return self._eps({client: participations})

    def state_dict(self) -> dict:
        """The participations charged so far, with the mechanism they were charged for (JSON-able)."""
        return {
            "noise_multiplier": self.z,
            "delta": self.delta,
            "kind": self.kind,
            "schedules": {c: list(rs) for c, rs in sorted(self._rate_steps.items())},
            "participations": dict(self.participations),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the participations of an earlier run; ValueError when they were charged for
        another mechanism (noise multiplier, accountant, or a client's schedule), which could
        not be composed with this one's."""
        saved = state.get("participations")
        if not isinstance(saved, dict) or any(not isinstance(k, int) or k < 0 for k in saved.values()):
            raise ValueError("a local-DP ledger without its participations (client -> rounds >= 0)")
        schedules = {str(c): tuple(float(v) for v in rs) for c, rs in (state.get("schedules") or {}).items()}
        mine = {c: (float(q), float(n)) for c, (q, n) in self._rate_steps.items()}
        changed = sorted(c for c in saved if saved[c] and (c not in mine or schedules.get(c) != mine[c]))
        if float(state.get("noise_multiplier", -1)) != self.z or state.get("kind") != self.kind or changed:
            raise ValueError(
                f"the local-DP ledger was charged with z = {state.get('noise_multiplier')}, the "
                f"{state.get('kind')} accountant and DP-SGD schedules {[schedules.get(c) for c in changed][:3]}; "
                f"this run has z = {self.z}, {self.kind} and {[mine.get(c) for c in changed][:3]}"
            )
        self.participations = {str(c): int(k) for c, k in saved.items()}


def dp_sgd_schedule(n: int, batch_size: int, epochs: int, rate: float = 0.0, steps: int = 0) -> tuple[float, int]:
    """(sampling rate, steps per participation) of DP-SGD on ``n`` examples with expected batch B
    (``batch_size``, at most ``n``).

    ``steps`` > 0 (privacy.local_schedule = "steps", the default; PrivacyConfig.round_steps): that
    many steps whatever ``n`` is, at ``rate`` (privacy.local_sampling_rate) when it is > 0, else at
    B / n (an expected batch of B examples: neither the step count nor the batch tells ``n``).
    ``steps`` = 0 (local_schedule = "epochs"): rate B / n and ``epochs * round(n / B)`` steps (Opacus'
    Poisson loader makes the same count), or with ``rate`` > 0 that rate and ``epochs * round(1 / rate)``."""
    if steps > 0:
        return (min(float(rate), 1.0) if rate > 0 else min(batch_size, n) / n), int(steps)
    if rate > 0:
        return min(float(rate), 1.0), epochs * max(1, round(1 / rate))
    b = min(batch_size, n)
    return b / n, epochs * max(1, round(n / b))


def local_schedule(n: int, train: TrainConfig, privacy: PrivacyConfig) -> tuple[float, int]:
    """The schedule local DP-SGD runs on a client of ``n`` examples under ``[train]`` and ``[privacy]``,
    and so the one its accountant charges (the trainer, the simulator's budget, a node's and a peer's
    ledger and the server's check of a report all call this)."""
    return dp_sgd_schedule(
        n, train.batch(n), train.epochs, privacy.local_sampling_rate, privacy.round_steps(train.epochs)
    )
