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

import json
import logging
import math
from functools import cache, lru_cache
from typing import TYPE_CHECKING, Protocol

# dp-accounting is imported where it is used: it pulls in scipy (about 0.8 s), which a run or a
# process without differential privacy (a peer, a node, a server) never needs at start-up.
if TYPE_CHECKING:
    import dp_accounting

log = logging.getLogger(__name__)

ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "fixed")


def _accountant(kind: str, replace_one: bool = False) -> dp_accounting.PrivacyAccountant:
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
def _epsilon_of_segments(segments: tuple[tuple, ...], delta: float, kind: str) -> float:
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


class LedgerMismatch(ValueError):
    """A saved ledger charged rounds with a mechanism this accountant cannot compose with its own
    (the message says what the ledger recorded, what the config asks, and what to do)."""


class RoundLedger:
    """The ledger every round accountant keeps: each charged round with the parameters of the
    mechanism it ran (consecutive equal rounds as one entry, ``rounds`` counting them), so a
    restart composes the rounds as they ran and never re-prices them at today's settings.

    A subclass names its :attr:`MECHANISM`, says what the current round is (:meth:`_current`:
    ``mechanism`` and every parameter its analysis needs), checks an entry's ranges
    (:meth:`_check_entry`) and prices the ledger (:meth:`epsilon_after`)."""

    MECHANISM = ""  # the entries' "mechanism", privacy.mechanism's value for it
    ENTRY_KEYS: tuple[str, ...] = ()  # what an entry records (besides "rounds"): :meth:`_current`'s keys
    DEFAULTS: dict = {}  # entry keys an older ledger may lack, with the value they then had

    def __init__(self, delta: float, kind: str):
        self.delta, self.kind = delta, kind
        self.ledger: list[dict] = []  # charged rounds: one entry per run of equal mechanisms

    def _current(self) -> dict:
        raise NotImplementedError

    def _price(self, entries: list[dict]) -> float:
        """epsilon of ``entries``, all of this accountant's mechanism (rounds > 0)."""
        raise NotImplementedError

    def epsilon_after(self, extra: int) -> float:
        """epsilon of the ledger plus ``extra`` more rounds of the current mechanism. A ledger that
        also holds rounds of the other Poisson mechanism (a restart switched privacy.mechanism) is
        composed in RDP: :func:`mixed_ledger_epsilon`."""
        entries = [e for e in [*self.ledger, {**self._current(), "rounds": extra}] if int(e["rounds"]) > 0]
        if not entries:
            return 0.0
        if all(e["mechanism"] == self.MECHANISM for e in entries):
            return self._price(entries)
        return mixed_ledger_epsilon(entries, self.delta)

    @staticmethod
    def _check_entry(e: dict) -> None:
        """ValueError when a saved entry's parameters are out of range."""

    @property
    def rounds(self) -> int:
        return sum(int(e["rounds"]) for e in self.ledger)

    @property
    def epsilon(self) -> float:
        return self.epsilon_after(0)

    def next_epsilon(self) -> float:
        """epsilon if one more round runs: what a budget check must look at."""
        return self.epsilon_after(1)

    def earlier_rounds(self) -> int:
        """Charged rounds whose parameters differ from the current ones (a restart changed them)."""
        cur = self._current()
        return sum(
            int(e["rounds"])
            for e in self.ledger
            if e.get("mechanism") == self.MECHANISM and {k: e.get(k) for k in cur} != cur
        )

    def record_round(self, participants: list[str] | None = None) -> None:
        """Charge one round of the current mechanism."""
        cur = self._current()
        if self.ledger and {k: self.ledger[-1].get(k) for k in cur} == cur:
            self.ledger[-1]["rounds"] += 1
        else:
            self.ledger.append({**cur, "rounds": 1})

    def state_dict(self) -> dict:
        """The ledger (JSON-able), as Opacus' accountants keep theirs."""
        return {"delta": self.delta, "kind": self.kind, "ledger": [dict(e) for e in self.ledger]}

    def load_state_dict(self, state: dict) -> None:
        """Restore the charged rounds of an earlier run (a restart). ValueError for a ledger that is
        not one; :class:`LedgerMismatch` for rounds this accountant cannot compose with its own:
        an unknown mechanism, or fixed-size (replace-one) rounds beside Poisson (add/remove-one)
        rounds of the other mechanism. Poisson rounds of the continuous and the discrete Gaussian
        are kept as they ran and composed in RDP (:meth:`epsilon_after`)."""
        ledger = state.get("ledger") if isinstance(state, dict) else None
        if not isinstance(ledger, list) or not all(isinstance(e, dict) for e in ledger):
            raise ValueError("a privacy ledger without its charged rounds")
        poisson_now = self._current()["sampling"] == "poisson"
        entries, unfit = [], []
        for raw in ledger:
            kind: type[RoundLedger] | None = type(self)
            if raw.get("mechanism") != self.MECHANISM:
                rounds = raw.get("rounds")
                if not isinstance(rounds, int) or isinstance(rounds, bool):
                    raise ValueError(f"a privacy ledger entry without its rounds: {str(raw)[:200]}")
                if rounds <= 0:
                    continue  # nothing charged: nothing to compose
                kind = LEDGER_MECHANISMS.get(str(raw.get("mechanism")))
                if kind is None or raw.get("sampling") != "poisson" or not poisson_now:
                    unfit.append(raw)
                    continue
            assert kind is not None
            e = {**kind.DEFAULTS, **raw}
            keys = (*kind.ENTRY_KEYS, "rounds")
            if any(k not in e for k in keys):
                raise ValueError(f"a privacy ledger entry lacks one of {keys}: {str(e)[:200]}")
            if int(e["rounds"]) < 0 or not 0 <= float(e["q"]) <= 1:
                raise ValueError(f"a privacy ledger entry out of range: {str(e)[:200]}")
            kind._check_entry(e)
            entries.append({k: e[k] for k in keys})
        if unfit:
            raise LedgerMismatch(self._mismatch(unfit))
        self.ledger = entries

    def _mixed_note(self) -> str:
        """For :meth:`describe`: how a ledger of both Gaussians is composed (empty when it is not)."""
        others = sum(int(e["rounds"]) for e in self.ledger if e["mechanism"] != self.MECHANISM)
        if not others:
            return ""
        return (
            f"; {others} earlier rounds of the other Gaussian mechanism, composed with these in RDP at integer "
            f"orders {DDG_ORDERS[0]}-{DDG_ORDERS[-1]}"
        )

    def _mismatch(self, other: list[dict]) -> str:
        """What the ledger recorded, what this config asks, and what the user can do."""
        recorded = "; ".join(f"{int(e.get('rounds', 0))} rounds of {describe_entry(e)}" for e in other[:3]) + (
            "; ..." if len(other) > 3 else ""
        )
        was = {str(e.get("mechanism")) for e in other}
        keep = " or ".join(sorted(f"privacy.mechanism = {m!r}" for m in was))
        return (
            f"the privacy ledger records {recorded}, and this config asks for {describe_entry(self._current())}. "
            f"These rounds are not composed into one epsilon here (only Poisson-sampled rounds of the continuous "
            f"and the discrete Gaussian are: fixed-size rounds protect a replaced client, Poisson rounds an added "
            f"or removed one), so this run cannot go on from that ledger. Either restart with the "
            f"mechanism it recorded ({keep}; the noise multiplier, clip and rate may change, and every "
            "round is then composed as it ran), or start a new run from scratch (another checkpoint "
            "folder, or --fresh): its epsilon then counts its own rounds only, and for anyone in both "
            "runs the earlier run's last reported epsilon adds to it."
        )


def describe_entry(e: dict) -> str:
    """One ledger entry's mechanism in words, for messages."""
    mech = e.get("mechanism")
    q = e.get("q")
    q_text = f"q = {float(q):.4g}" if isinstance(q, (int, float)) else "q unknown"
    if mech == "discrete_gaussian":
        return (
            f"the distributed discrete Gaussian ({q_text}, modulus 2^{e.get('bits')}, t = {e.get('shares')} "
            f"shares, C = {e.get('clip')})"
        )
    if mech == "gaussian":
        return (
            f"the continuous Gaussian ({e.get('sampling')} sampling, {q_text}, z = {e.get('z')}, C = {e.get('clip')})"
        )
    return f"an unknown mechanism {str(mech)[:40]!r}"


class RoundAccountant(RoundLedger):
    """User-level accounting for central and distributed DP: one subsampled Gaussian per round.

    ``sampling="poisson"``: rate ``q``, add/remove-one client. ``sampling="fixed"``: exactly
    ``sample_size`` of ``num_clients`` per round, replace-one client (RDP only). Every round
    that starts is charged, whether or not anyone took part and whether or not it completed:
    what it releases (or that it released nothing) depends only on the sampling.

    The ledger: every charged round is recorded with the mechanism it ran (sampling, q, z, C,
    N, K), consecutive equal rounds as one entry. A run restarted with other parameters
    (:meth:`load_state_dict`, then :meth:`set_mechanism`) composes its earlier rounds as they
    were run, never re-priced at today's settings."""

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
        clip: float | str | None = None,
    ):
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling = {sampling!r} is not one of {SAMPLINGS}")
        if sampling == "fixed" and (num_clients is None or sample_size is None):
            raise ValueError("fixed-size sampling needs num_clients and sample_size")
        super().__init__(delta, kind)
        if sampling == "fixed":
            _accountant(kind, replace_one=True)  # refuses PLD up front
        self.set_mechanism(
            q, noise_multiplier, sampling=sampling, num_clients=num_clients, sample_size=sample_size, clip=clip
        )

    def set_mechanism(
        self,
        q: float,
        noise_multiplier: float,
        *,
        sampling: str = "poisson",
        num_clients: int | None = None,
        sample_size: int | None = None,
        clip: float | str | None = None,
    ) -> None:
        """The mechanism the next rounds run with (earlier rounds keep theirs)."""
        self.q, self.z = min(q, 1.0), noise_multiplier
        self.sampling, self.num_clients, self.sample_size, self.clip = sampling, num_clients, sample_size, clip

    MECHANISM = "gaussian"
    ENTRY_KEYS = ("mechanism", "sampling", "q", "z", "clip", "num_clients", "sample_size")

    def _current(self) -> dict:
        return {
            "mechanism": self.MECHANISM,
            "sampling": self.sampling,
            "q": self.q,
            "z": self.z,
            "clip": self.clip,
            "num_clients": self.num_clients,
            "sample_size": self.sample_size,
        }

    @staticmethod
    def _check_entry(e: dict) -> None:
        if e["sampling"] not in SAMPLINGS or not float(e["z"]) >= 0:
            raise ValueError(f"a privacy ledger entry out of range: {str(e)[:200]}")

    def _price(self, entries: list[dict]) -> float:
        segments = tuple(
            (e["sampling"], float(e["q"]), float(e["z"]), e["num_clients"], e["sample_size"], int(e["rounds"]))
            for e in entries
        )
        if len(segments) == 1:  # the common case, cached by value
            s, q, z, n, k, r = segments[0]
            if s == "fixed":
                return epsilon_fixed_size(n, k, z, r, self.delta)
            return epsilon(q, z, r, self.delta, self.kind)
        return _epsilon_of_segments(segments, self.delta, self.kind)

    def describe(self) -> str:
        """The analysis behind the reported epsilon, for summaries and logs."""
        if self.sampling == "fixed":
            text = (
                f"fixed-size sampling of {self.sample_size} of {self.num_clients} clients without replacement, "
                f"replace-one client (sensitivity 2C, so multiplier z/2 = {self.z / 2:g}), "
                "RDP of the sampled-without-replacement Gaussian (Wang, Balle, Kasiviswanathan 2019)"
            )
        else:
            text = (
                f"Poisson sampling of clients (q = {self.q:.4g}), add/remove-one client, "
                f"{self.kind.upper()} of the Poisson-subsampled Gaussian (z = {self.z:g})"
            )
        earlier = self.earlier_rounds()
        if earlier:
            text += f"; composed with {earlier} earlier rounds of other parameters"
        return text + self._mixed_note()


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


def dp_sgd_schedule(n: int, batch_size: int, epochs: int, rate: float = 0.0) -> tuple[float, int]:
    """(sampling rate, steps per participation) of DP-SGD on ``n`` examples with expected batch B:
    rate B / n, ``epochs * round(n / B)`` steps (Opacus' Poisson loader makes the same count).
    ``rate`` > 0 (privacy.local_sampling_rate): that rate and ``epochs * round(1 / rate)`` steps,
    whatever ``n`` is, so the schedule and the epsilon are the config's, not the data's."""
    if rate > 0:
        return min(float(rate), 1.0), epochs * max(1, round(1 / rate))
    b = min(batch_size, n)
    return b / n, epochs * max(1, round(n / b))


# --- the distributed discrete Gaussian (Kairouz, Liu, Steinke 2021) ---------------------------
#
# dp-accounting has no event for it, so its RDP curve is computed here from the paper's bound and
# amplified by Poisson sampling with Zhu and Wang's general bound; every order is an integer.

DDG_ORDERS = tuple(range(2, 257))


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


def rdp_to_epsilon(orders, rdps, delta: float) -> float:
    """(epsilon, delta) from an RDP curve: min over orders of rdp + log((a-1)/a) - (log delta + log a)/(a-1)
    (Canonne, Kamath, Steinke 2020, Prop. 12; the conversion dp-accounting's RDP accountant uses)."""
    best = math.inf
    for a, r in zip(orders, rdps, strict=True):
        if math.isfinite(r):
            best = min(best, r + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return max(best, 0.0)


def released_figures_rdp(order: float, release_z: float) -> float:
    """RDP at ``order`` of ``privacy.release = "noised"``'s two figures, unsampled: the result count
    (sensitivity 1, noise std sigma) and the clipped loss sum (sensitivity L, std sigma L), each a
    Gaussian of multiplier sigma = ``release_z``: 2 x order / (2 sigma^2). 0 without the release."""
    return order / release_z**2 if release_z > 0 else 0.0


@lru_cache(maxsize=1024)
def _ddg_round_rdp(
    q: float,
    sensitivity_sq: float,
    client_var: float,
    variance: int,
    dim: int,
    shares: int,
    summands: int,
    release_z: float = 0.0,
) -> tuple[float, ...]:
    """One round's RDP at each of DDG_ORDERS (Poisson-sampled at rate q). The noised figures of the
    round (``release_z`` > 0) are computed on the same sample as the model's sum, so the unsampled
    round is the composition of both (their RDP curves add at every order) and the sampling
    amplifies that whole curve."""

    @cache
    def curve(a: int) -> float:
        return ddg_rdp(a, sensitivity_sq, client_var, variance, dim, shares, summands) + released_figures_rdp(
            a, release_z
        )

    return tuple(poisson_subsampled_rdp(q, curve, a) for a in DDG_ORDERS)


def epsilon_ddg(q: float, ddg: dict, steps: int, delta: float) -> float:
    """epsilon at ``delta`` after ``steps`` rounds of the distributed discrete Gaussian with Poisson
    sampling rate q; ``ddg`` is aggregation.discrete_gaussian.DdgParams.as_dict() plus its
    ``sensitivity_sq`` (Delta_2^2)."""
    return DdgRoundAccountant(q, ddg, delta).epsilon_after(steps)


DDG_KEYS = ("dim", "clip", "gamma", "bits", "beta", "variance", "shares", "max_summands", "sensitivity_sq")


class DdgRoundAccountant(RoundLedger):
    """User-level accounting of the distributed discrete Gaussian under secure aggregation: one
    Poisson-sampled round per charged round, its RDP from :func:`ddg_rdp` (the paper's bound, with
    the sensitivity after conditional rounding) amplified by :func:`poisson_subsampled_rdp`,
    composed over rounds and converted with :func:`rdp_to_epsilon`. The same interface as
    :class:`RoundAccountant` (epsilon, next_epsilon, describe, record_round, state_dict); its
    ledger records every charged round's parameters, so a restart composes them as they ran."""

    MECHANISM = "discrete_gaussian"
    ENTRY_KEYS = ("mechanism", "sampling", "q", *DDG_KEYS, "release_z")
    DEFAULTS = {"release_z": 0.0}  # ledgers written before the noised release was charged had none

    def __init__(self, q: float, ddg: dict, delta: float, release_z: float = 0.0):
        super().__init__(delta, "rdp")
        self.set_mechanism(q, ddg, release_z)

    def set_mechanism(self, q: float, ddg: dict, release_z: float = 0.0) -> None:
        """The mechanism of the next rounds: rate q, the discrete Gaussian's parameters ``ddg``, and
        ``release_z`` = privacy.release_noise_multiplier when the rounds' figures are released
        noised (``privacy.release = "noised"``), else 0."""
        missing = [k for k in DDG_KEYS if k not in ddg]
        if missing:
            raise ValueError(f"discrete-Gaussian parameters lack {missing}")
        if release_z < 0:
            raise ValueError(f"release_z = {release_z} must be >= 0")
        self.q = min(float(q), 1.0)
        self.ddg = {k: ddg[k] for k in DDG_KEYS}
        self.release_z = float(release_z)

    def _current(self) -> dict:
        return {
            "mechanism": self.MECHANISM,
            "sampling": "poisson",
            "q": self.q,
            **self.ddg,
            "release_z": self.release_z,
        }

    @staticmethod
    def _check_entry(e: dict) -> None:
        if int(e["variance"]) < 0 or int(e["shares"]) < 1 or int(e["dim"]) < 1 or not float(e["release_z"]) >= 0:
            raise ValueError(f"a privacy ledger entry out of range: {str(e)[:200]}")

    @staticmethod
    def _curve(e: dict) -> tuple[float, ...]:
        client_var = float(e["gamma"]) ** 2 * int(e["variance"])
        return _ddg_round_rdp(
            float(e["q"]),
            float(e["sensitivity_sq"]),
            client_var,
            int(e["variance"]),
            int(e["dim"]),
            int(e["shares"]),
            int(e["max_summands"]),
            float(e["release_z"]),
        )

    def _price(self, entries: list[dict]) -> float:
        total = [0.0] * len(DDG_ORDERS)
        for e in entries:
            total = [t + int(e["rounds"]) * r for t, r in zip(total, self._curve(e), strict=True)]
        return rdp_to_epsilon(DDG_ORDERS, total, self.delta)

    def describe(self) -> str:
        d = self.ddg
        client_var = float(d["gamma"]) ** 2 * int(d["variance"])
        text = (
            f"distributed discrete Gaussian (Kairouz, Liu, Steinke 2021) under secure aggregation: Poisson "
            f"sampling of clients (q = {self.q:.4g}), add/remove-one client, t = {d['shares']} shares of variance "
            f"{int(d['variance'])} x gamma^2 (gamma = {float(d['gamma']):.4g}, sigma = {math.sqrt(client_var):.4g}), "
            f"Delta_2 = {math.sqrt(float(d['sensitivity_sq'])):.4g} after rounding (C = {float(d['clip']):g}), "
            f"modulus 2^{d['bits']}; RDP of the paper's bound with Zhu-Wang Poisson subsampling"
        )
        if self.release_z:
            text += (
                f"; each round also charged for its noised result count and train loss (multiplier "
                f"{self.release_z:g}), composed with the sum before sampling"
            )
        earlier = self.earlier_rounds()
        if earlier:
            text += f"; composed with {earlier} earlier rounds of other parameters"
        return text + self._mixed_note()


@lru_cache(maxsize=256)
def _gaussian_round_rdp(q: float, z: float) -> tuple[float, ...]:
    """One Poisson-subsampled Gaussian round's RDP at each of DDG_ORDERS (dp-accounting's analysis,
    Mironov, Talwar and Zhang 2019), so that it adds to the discrete Gaussian's curve order by order."""
    if z <= 0:
        return (math.inf,) * len(DDG_ORDERS)
    from dp_accounting import rdp

    acc = rdp.RdpAccountant(orders=[float(a) for a in DDG_ORDERS])
    acc.compose(subsampled_gaussian(min(q, 1.0), z, 1))
    return tuple(float(r) for r in acc.rdp)


def mixed_ledger_epsilon(entries: list[dict], delta: float) -> float:
    """epsilon at ``delta`` of a ledger holding Poisson-sampled rounds of both the continuous Gaussian
    (``z`` is the multiplier the round was charged at) and the distributed discrete Gaussian: RDP
    composes by adding the curves at each order; the total is converted with :func:`rdp_to_epsilon`.
    The continuous rounds are priced in RDP here even where the run's accountant is PLD (a valid
    upper bound, slightly looser)."""
    total = [0.0] * len(DDG_ORDERS)
    for e in entries:
        if e["mechanism"] == RoundAccountant.MECHANISM:
            if e["sampling"] != "poisson":
                raise ValueError("fixed-size rounds are not composed with Poisson rounds of another mechanism")
            curve = _gaussian_round_rdp(float(e["q"]), float(e["z"]))
        else:
            curve = DdgRoundAccountant._curve(e)
        total = [t + int(e["rounds"]) * r for t, r in zip(total, curve, strict=True)]
    return rdp_to_epsilon(DDG_ORDERS, total, delta)


# The mechanisms a ledger entry may name, for restoring rounds of the other one (RoundLedger.load_state_dict).
LEDGER_MECHANISMS: dict[str, type[RoundLedger]] = {
    RoundAccountant.MECHANISM: RoundAccountant,
    DdgRoundAccountant.MECHANISM: DdgRoundAccountant,
}


# --- against the server: no amplification by a sample it chose and saw ------------------------


class ServerViewAccountant:
    """epsilon against the aggregator itself, for distributed DP under secure aggregation.

    Amplification by sampling needs the sample to be secret; the server chose it and ran the
    protocol with the survivors, so it knows in which rounds a node took part. Against it a node's
    rounds are unsampled mechanisms, composed over the rounds the node took part in (selected, also
    if it then dropped): each a Gaussian of multiplier z on the sum of at least t shares (z/2 under
    fixed-size sampling, whose replace-one sensitivity is 2C), or one round of the distributed
    discrete Gaussian's bound without subsampling. The server's own top-up noise and the noised
    round figures (which the server computes) count for nothing here. The reported figure is the
    worst node's; a node never selected has spent nothing. This holds for any selection that does
    not look at the data, a malicious server's included (it can only select a node more often, and
    each selection is counted).

    Per node it keeps what is needed to price its rounds exactly: ``rho`` = sum of 1/z^2 over its
    Gaussian rounds (k Gaussians of multipliers z_i compose to one of multiplier rho^-1/2) and the
    count of its discrete-Gaussian rounds per parameter set."""

    def __init__(self, delta: float, kind: str = "rdp", *, replace_one: bool = False):
        self.delta, self.kind, self.replace_one = delta, kind, replace_one
        self.z = 0.0
        self.ddg: dict | None = None
        self.nodes: dict[str, dict] = {}  # node -> {"rho": float, "ddg": {params json: rounds}}

    def set_mechanism(self, z: float = 0.0, ddg: dict | None = None) -> None:
        """The next rounds' per-participation mechanism: a Gaussian of multiplier ``z`` on the sum, or
        the discrete Gaussian of parameters ``ddg`` (DdgRoundAccountant's, with ``sensitivity_sq``)."""
        self.z = float(z)
        self.ddg = {k: ddg[k] for k in DDG_KEYS} if ddg is not None else None

    def _step(self) -> tuple[float, str | None]:
        if self.ddg is not None:
            return 0.0, json.dumps(self.ddg, sort_keys=True)
        z = self.z / 2 if self.replace_one else self.z
        return (math.inf if z <= 0 else z**-2), None

    @staticmethod
    def _add(state: dict, step: tuple[float, str | None]) -> dict:
        rho, key = step
        ddg = dict(state.get("ddg", {}))
        if key is not None:
            ddg[key] = ddg.get(key, 0) + 1
        return {"rho": float(state.get("rho", 0.0)) + rho, "ddg": ddg}

    def record_round(self, participants: list[str]) -> None:
        """One round in which these nodes were selected (charged whether or not they delivered)."""
        step = self._step()
        for node in set(participants):
            self.nodes[node] = self._add(self.nodes.get(node, {}), step)

    def _price(self, rho: float, ddg: tuple[tuple[str, int], ...]) -> float:
        return _server_view_epsilon(rho, ddg, self.delta, self.kind)

    def _states(self) -> set[tuple[float, tuple[tuple[str, int], ...]]]:
        return {(s["rho"], tuple(sorted(s["ddg"].items()))) for s in self.nodes.values()}

    @property
    def epsilon(self) -> float:
        """The worst node's epsilon against the server (0 before anyone took part)."""
        return max((self._price(*s) for s in self._states()), default=0.0)

    def next_epsilon(self) -> float:
        """The worst node's epsilon should it take part in one more round (a node new to the run too)."""
        step = self._step()
        states = [{"rho": r, "ddg": dict(d)} for r, d in self._states()] or [{}]
        nxt = [self._add(s, step) for s in states]
        return max(self._price(s["rho"], tuple(sorted(s["ddg"].items()))) for s in nxt)

    def worst_rounds(self) -> int:
        """How many rounds the most-selected node took part in."""
        return max((self.rounds_of(n) for n in self.nodes), default=0)

    def rounds_of(self, node: str) -> int:
        s = self.nodes.get(node)
        if s is None:
            return 0
        z = self.z / 2 if self.replace_one else self.z
        gauss = round(s["rho"] * z * z) if z > 0 and math.isfinite(s["rho"]) else 0
        return gauss + sum(s["ddg"].values())

    def describe(self) -> str:
        what = (
            "the distributed discrete Gaussian's bound without subsampling"
            if self.ddg is not None
            else f"a Gaussian of multiplier z = {self.z:g}"
            + (" (z/2 for the replace-one sensitivity 2C of fixed-size sampling)" if self.replace_one else "")
        )
        return (
            f"against the server, which chose and saw each round's sample: no amplification by sampling; each "
            f"round a node took part in is {what} on the secure sum of at least t noise shares (the server's own "
            f"top-up not counted), composed over that node's rounds (PLD of the composed Gaussian); the worst "
            f"node's epsilon ({self.worst_rounds()} rounds)"
        )

    def state_dict(self) -> dict:
        return {"delta": self.delta, "kind": self.kind, "replace_one": self.replace_one, "nodes": self.nodes}

    def load_state_dict(self, state: dict) -> None:
        """Restore the nodes' charged rounds (a restart); ValueError for a state that is not one."""
        nodes = state.get("nodes") if isinstance(state, dict) else None
        if not isinstance(nodes, dict):
            raise ValueError("a server-view privacy ledger without its nodes")
        out = {}
        for node, s in nodes.items():
            rho = s.get("rho") if isinstance(s, dict) else None
            ddg = s.get("ddg", {}) if isinstance(s, dict) else None
            if (
                not isinstance(rho, (int, float))
                or not rho >= 0
                or not isinstance(ddg, dict)
                or not all(isinstance(v, int) and v >= 0 for v in ddg.values())
            ):
                raise ValueError(f"a server-view ledger entry out of range: {str(s)[:200]}")
            for key in ddg:
                params = json.loads(key)
                if not isinstance(params, dict) or any(k not in params for k in DDG_KEYS):
                    raise ValueError(f"a server-view ledger entry lacks discrete-Gaussian parameters: {key[:200]}")
            out[str(node)] = {"rho": float(rho), "ddg": dict(ddg)}
        self.nodes = out


@lru_cache(maxsize=4096)
def _server_view_epsilon(rho: float, ddg: tuple[tuple[str, int], ...], delta: float, kind: str) -> float:
    """epsilon at ``delta`` of unsampled rounds: Gaussians whose 1/z^2 sum to ``rho`` (one Gaussian of
    multiplier rho^-1/2, priced by dp-accounting's PLD whatever ``kind``: exact for one Gaussian) and
    discrete-Gaussian rounds (params json, count; RDP, as their accountant)."""
    if rho == math.inf:
        return math.inf
    if not ddg:  # one Gaussian: dp-accounting's PLD of it is exact up to its discretisation (an upper bound)
        return epsilon(1.0, rho**-0.5, 1, delta, "pld") if rho > 0 else 0.0
    total = [a * rho / 2 for a in DDG_ORDERS]  # the Gaussian's RDP: a / (2 z^2) per round
    for key, count in ddg:
        curve = DdgRoundAccountant._curve({**json.loads(key), "q": 1.0, "release_z": 0.0})
        total = [t + count * r for t, r in zip(total, curve, strict=True)]
    return rdp_to_epsilon(DDG_ORDERS, total, delta)
