"""Round accountants (user-level DP, one charged round at a time): the ledger they share, the
continuous Gaussian's (:class:`RoundAccountant`) and the distributed discrete Gaussian's
(:class:`DdgRoundAccountant`), and the composition of a ledger that holds rounds of both."""

from __future__ import annotations

import math
from functools import lru_cache

from shoal.accounting import (
    ACCOUNTANTS,
    LEDGER_ORDERS,
    SAMPLINGS,
    epsilon,
    epsilon_fixed_size,
    epsilon_of_segments,
    make_accountant,
    rdp_to_epsilon,
    subsampled_gaussian,
)
from shoal.accounting_ddg import DDG_KEYS, ROUNDING_VAR, ddg_round_gaussian, ddg_round_rdp
from shoal.accounting_mixture import (
    NEGLIGIBLE,
    PLAIN,
    Branches,
    as_json,
    mixture_pld_epsilon,
    mixture_rdp,
    normalize,
    split_tail,
)


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
    # entry keys an older ledger may lack, with the value they then had (aborts were not charged)
    DEFAULTS: dict = {"abort_delta": 0.0, "abort_branches": as_json(PLAIN)}

    def __init__(self, delta: float, kind: str):
        self.delta, self.kind = delta, kind
        self.ledger: list[dict] = []  # charged rounds: one entry per run of equal mechanisms
        # each round's failure probability from secure aggregation's aborts (shoal.accounting_aborts):
        # the epsilon holds at delta plus the ledger's sum of it (composed_delta)
        self.abort_delta = 0.0
        # or priced as a mixture: (s, p) = with probability p the round has sensitivity s C
        # (shoal.accounting_mixture; an aborted round released like an empty one)
        self.abort_branches: Branches = PLAIN

    def _current(self) -> dict:
        raise NotImplementedError

    def _price(self, entries: list[dict]) -> float:
        """epsilon of ``entries``, all of this accountant's mechanism (rounds > 0)."""
        raise NotImplementedError

    def epsilon_after(self, extra: int) -> float:
        """epsilon of the ledger plus ``extra`` more rounds of the current mechanism. A ledger that
        also holds rounds of the other Poisson mechanism (a restart switched privacy.mechanism) is
        composed as :func:`mixed_ledger_epsilon` says."""
        entries = [e for e in [*self.ledger, {**self._current(), "rounds": extra}] if int(e["rounds"]) > 0]
        if not entries:
            return 0.0
        if all(e["mechanism"] == self.MECHANISM for e in entries):
            return self._price(entries)
        return mixed_ledger_epsilon(entries, self.delta, self.kind)

    @staticmethod
    def _check_entry(e: dict) -> None:
        """ValueError when a saved entry's parameters are out of range."""

    def composed_delta(self) -> float:
        """The delta the epsilon holds at: the accountant's delta plus every charged round's abort
        failure probability (shoal.accounting_aborts; ledgers of the union-bound charge carry it)."""
        return self.delta + sum(int(e["rounds"]) * float(e.get("abort_delta", 0.0)) for e in self.ledger)

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
            if int(e["rounds"]) < 0 or not 0 <= float(e["q"]) <= 1 or not 0 <= float(e["abort_delta"]) <= 1:
                raise ValueError(f"a privacy ledger entry out of range: {str(e)[:200]}")
            e["abort_branches"] = as_json(normalize(e["abort_branches"]))  # ValueError if it is not one
            kind._check_entry(e)
            entries.append({k: e[k] for k in keys})
        if unfit:
            raise LedgerMismatch(self._mismatch(unfit))
        self.ledger = entries

    def _aborts_note(self) -> str:
        """For :meth:`describe`: the abort branches the rounds are priced with (empty without)."""
        if self.abort_branches == PLAIN:
            return ""
        mix = ", ".join(f"{s:g} C with P = {p:.3g}" for s, p in self.abort_branches)
        return f"; an aborted round released as an empty one, each round the mixture of sensitivities {mix}"

    def _mixed_note(self) -> str:
        """For :meth:`describe`: how a ledger of both Gaussians is composed (empty when it is not)."""
        others = sum(int(e["rounds"]) for e in self.ledger if e["mechanism"] != self.MECHANISM)
        if not others:
            return ""
        if self.kind == "pld":
            return f"; {others} earlier rounds of the other Gaussian mechanism, composed with these by PLD"
        return (
            f"; {others} earlier rounds of the other Gaussian mechanism, composed with these in RDP at integer "
            f"orders {LEDGER_ORDERS[0]}-{LEDGER_ORDERS[-1]}"
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
            make_accountant(kind, replace_one=True)  # refuses PLD up front
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
    ENTRY_KEYS = (
        "mechanism", "sampling", "q", "z", "clip", "num_clients", "sample_size", "abort_delta", "abort_branches"
    )  # fmt: skip

    def _current(self) -> dict:
        return {
            "mechanism": self.MECHANISM,
            "sampling": self.sampling,
            "q": self.q,
            "z": self.z,
            "clip": self.clip,
            "num_clients": self.num_clients,
            "sample_size": self.sample_size,
            "abort_delta": self.abort_delta,
            "abort_branches": as_json(self.abort_branches),
        }

    @staticmethod
    def _check_entry(e: dict) -> None:
        if e["sampling"] not in SAMPLINGS or not float(e["z"]) >= 0:
            raise ValueError(f"a privacy ledger entry out of range: {str(e)[:200]}")

    def _price(self, entries: list[dict]) -> float:
        if any(branches_of(e) != PLAIN for e in entries):  # Poisson rounds priced as mixtures
            return mixed_ledger_epsilon(entries, self.delta, self.kind)
        segments = tuple(
            (e["sampling"], float(e["q"]), float(e["z"]), e["num_clients"], e["sample_size"], int(e["rounds"]))
            for e in entries
        )
        if len(segments) == 1:  # the common case, cached by value
            s, q, z, n, k, r = segments[0]
            if s == "fixed":
                return epsilon_fixed_size(n, k, z, r, self.delta)
            return epsilon(q, z, r, self.delta, self.kind)
        return epsilon_of_segments(segments, self.delta, self.kind)

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
        return text + self._aborts_note() + self._mixed_note()


def epsilon_ddg(q: float, ddg: dict, steps: int, delta: float, kind: str = "rdp") -> float:
    """epsilon at ``delta`` after ``steps`` rounds of the distributed discrete Gaussian with Poisson
    sampling rate q; ``ddg`` is aggregation.discrete_gaussian.DdgParams.as_dict() plus its
    ``sensitivity_sq`` (Delta_2^2)."""
    return DdgRoundAccountant(q, ddg, delta, kind=kind).epsilon_after(steps)


class DdgRoundAccountant(RoundLedger):
    """User-level accounting of the distributed discrete Gaussian under secure aggregation: one
    Poisson-sampled round per charged round, its RDP from :func:`ddg_rdp` (the paper's bound, with
    the sensitivity after conditional rounding) amplified by :func:`poisson_subsampled_rdp`,
    composed over rounds and converted with :func:`rdp_to_epsilon`. The same interface as
    :class:`RoundAccountant` (epsilon, next_epsilon, describe, record_round, state_dict); its
    ledger records every charged round's parameters, so a restart composes them as they ran."""

    MECHANISM = "discrete_gaussian"
    ENTRY_KEYS = ("mechanism", "sampling", "q", *DDG_KEYS, "release_z", "abort_delta", "abort_branches")
    # ledgers written before the noised release (or the aborts) were charged had none
    DEFAULTS = {"release_z": 0.0, "abort_delta": 0.0, "abort_branches": as_json(PLAIN)}

    def __init__(self, q: float, ddg: dict, delta: float, release_z: float = 0.0, kind: str = "rdp"):
        if kind not in ACCOUNTANTS:
            raise ValueError(f"accountant {kind!r} is not one of {ACCOUNTANTS}")
        super().__init__(delta, kind)
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
            "abort_delta": self.abort_delta,
            "abort_branches": as_json(self.abort_branches),
        }

    @staticmethod
    def _check_entry(e: dict) -> None:
        if int(e["variance"]) < 0 or int(e["shares"]) < 1 or int(e["dim"]) < 1 or not float(e["release_z"]) >= 0:
            raise ValueError(f"a privacy ledger entry out of range: {str(e)[:200]}")

    @staticmethod
    def rdp_curve(e: dict) -> tuple[float, ...]:
        client_var = float(e["gamma"]) ** 2 * int(e["variance"])
        return ddg_round_rdp(
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
        return mixed_ledger_epsilon(entries, self.delta, self.kind)

    def describe(self) -> str:
        d = self.ddg
        client_var = float(d["gamma"]) ** 2 * int(d["variance"])
        text = (
            f"distributed discrete Gaussian (Kairouz, Liu, Steinke 2021) under secure aggregation: Poisson "
            f"sampling of clients (q = {self.q:.4g}), add/remove-one client, t = {d['shares']} shares of variance "
            f"{int(d['variance'])} x gamma^2 (gamma = {float(d['gamma']):.4g}, sigma = {math.sqrt(client_var):.4g}), "
            f"Delta_2 = {math.sqrt(float(d['sensitivity_sq'])):.4g} after rounding (C = {float(d['clip']):g}), "
            f"modulus 2^{d['bits']}; "
        )
        if self.kind == "pld":
            z, b = ddg_round_gaussian(self._current())
            text += (
                f"PLD: each round is the continuous Gaussian of multiplier {z:.4g} (the sum of t shares, less "
                f"{ROUNDING_VAR:g} of its integer variance) up to a factor e^(+-{b:.2g}) on every output's "
                "probability, Poisson-subsampled and composed by dp-accounting's PLD"
            )
        else:
            text += "RDP of the paper's bound with Zhu-Wang Poisson subsampling"
        if self.release_z:
            text += (
                f"; each round also charged for its noised result count and train loss (multiplier "
                f"{self.release_z:g}), composed with the sum before sampling"
            )
        earlier = self.earlier_rounds()
        if earlier:
            text += f"; composed with {earlier} earlier rounds of other parameters"
        return text + self._aborts_note() + self._mixed_note()


@lru_cache(maxsize=256)
def _gaussian_round_rdp(q: float, z: float) -> tuple[float, ...]:
    """One Poisson-subsampled Gaussian round's RDP at each of LEDGER_ORDERS (dp-accounting's analysis,
    Mironov, Talwar and Zhang 2019), so that it adds to the discrete Gaussian's curve order by order."""
    if z <= 0:
        return (math.inf,) * len(LEDGER_ORDERS)
    from dp_accounting import rdp

    acc = rdp.RdpAccountant(orders=[float(a) for a in LEDGER_ORDERS])
    acc.compose(subsampled_gaussian(min(q, 1.0), z, 1))
    return tuple(float(r) for r in acc.rdp)


def branches_of(e: dict) -> Branches:
    """The entry's abort branches (shoal.accounting_mixture; PLAIN: sensitivity C in every round)."""
    return normalize(e.get("abort_branches", PLAIN))


def _poisson_z(e: dict) -> float:
    """The multiplier of a continuous-Gaussian entry of Poisson rounds (ValueError for fixed-size ones,
    which these compositions do not cover)."""
    if e["sampling"] != "poisson":
        raise ValueError("fixed-size rounds are not composed with Poisson rounds of another mechanism")
    return float(e["z"])


def _entry_gaussian(e: dict) -> tuple[float, float]:
    """(z, b) of one unsampled round of entry ``e`` at sensitivity C: its multiplier as a continuous
    Gaussian and the pointwise factor e^{+-b} (0 for the continuous Gaussian itself)."""
    if e["mechanism"] == RoundAccountant.MECHANISM:
        return _poisson_z(e), 0.0
    return ddg_round_gaussian(e)


def entry_rdp(e: dict) -> tuple[float, ...]:
    """One round of entry ``e`` in RDP at LEDGER_ORDERS: the mixture of its abort branches, each the
    round at s times the sensitivity (s^2 the discrete Gaussian's Delta_2^2, and the noised figures'
    multiplier over s: a branch of s clients moves the count by s and the loss sum by s L)."""
    curves: list[tuple[float, tuple[float, ...] | None]] = []
    for s, p in branches_of(e):
        if s <= 0:
            curves.append((p, None))
        elif e["mechanism"] == RoundAccountant.MECHANISM:
            curves.append((p, _gaussian_round_rdp(float(e["q"]), _poisson_z(e) / s)))
        else:
            scaled = {**e, "sensitivity_sq": float(e["sensitivity_sq"]) * s * s}
            scaled["release_z"] = float(e["release_z"]) / s
            curves.append((p, DdgRoundAccountant.rdp_curve(scaled)))
    if len(curves) == 1 and curves[0][1] is not None:
        return curves[0][1]
    return mixture_rdp(curves, LEDGER_ORDERS)


def pld_ledger_epsilon(entries: list[dict], delta: float) -> float:
    """epsilon at ``delta`` of Poisson-sampled rounds of the continuous Gaussian (``z`` is the multiplier
    the round was charged at) and of the distributed discrete Gaussian (each the continuous Gaussian of
    :func:`ddg_round_gaussian` up to a pointwise factor e^{+-b}), by dp-accounting's PLD: the
    Gaussians' epsilon at delta e^-B, plus 2B, B the rounds' factors summed (shoal.accounting_ddg).
    Rounds with abort branches are their mixture (shoal.accounting_mixture): the factor e^{+-b} is
    pointwise, whatever the sensitivity, so it holds for every branch and for their mixture."""
    segments, mixed, slack = [], [], 0.0
    for e in entries:
        z, b = _entry_gaussian(e)
        slack += int(e["rounds"]) * b
        q, rounds = min(float(e["q"]), 1.0), int(e["rounds"])
        segments.append(("poisson", q, z, None, None, rounds))
        mixed.append((q, z, branches_of(e), rounds))
    if not math.isfinite(slack):
        return math.inf
    target = delta * math.exp(-slack)
    if any(br != PLAIN for _, _, br, _ in mixed):
        return mixture_pld_epsilon(tuple(mixed), target) + 2 * slack
    if len(segments) == 1:
        _, q, z, _, _, r = segments[0]
        return epsilon(q, z, r, target, "pld") + 2 * slack
    return epsilon_of_segments(tuple(segments), target, "pld") + 2 * slack


def mixed_ledger_epsilon(entries: list[dict], delta: float, kind: str = "rdp") -> float:
    """epsilon at ``delta`` of a ledger of Poisson-sampled rounds of the continuous Gaussian (``z`` is
    the multiplier the round was charged at) and the distributed discrete Gaussian, either or both,
    with or without abort branches. With ``kind = "pld"`` by :func:`pld_ledger_epsilon`; else in
    RDP, which composes by adding the curves at each order, the total converted with
    :func:`rdp_to_epsilon`. Where rounds have branches above sensitivity C, also with the negligible
    ones, and then all of them, charged as an infinite loss (their probability times q, summed over the
    rounds, taken from delta: shoal.accounting_mixture.split_tail); the smallest epsilon, all upper
    bounds."""
    best = _ledger_epsilon(entries, delta, kind)
    for rarer_than in (NEGLIGIBLE, 1.0):
        cut, spent = [], 0.0
        for e in entries:
            rest, tail = split_tail(branches_of(e), rarer_than)
            cut.append({**e, "abort_branches": as_json(rest)})
            spent += int(e["rounds"]) * min(float(e["q"]), 1.0) * tail
        if 0 < spent < delta:
            best = min(best, _ledger_epsilon(cut, delta - spent, kind))
    return best


def _ledger_epsilon(entries: list[dict], delta: float, kind: str) -> float:
    if kind == "pld":
        return pld_ledger_epsilon(entries, delta)
    if all(e["mechanism"] == RoundAccountant.MECHANISM and branches_of(e) == PLAIN for e in entries):
        segments = tuple(
            ("poisson", min(float(e["q"]), 1.0), _poisson_z(e), None, None, int(e["rounds"])) for e in entries
        )
        if len(segments) == 1:  # dp-accounting's RDP at its own orders, as a round without aborts
            return epsilon(segments[0][1], segments[0][2], segments[0][5], delta, "rdp")
        return epsilon_of_segments(segments, delta, "rdp")
    total = [0.0] * len(LEDGER_ORDERS)
    for e in entries:
        total = [t + int(e["rounds"]) * r for t, r in zip(total, entry_rdp(e), strict=True)]
    return rdp_to_epsilon(LEDGER_ORDERS, total, delta)


# The mechanisms a ledger entry may name, for restoring rounds of the other one (RoundLedger.load_state_dict).
LEDGER_MECHANISMS: dict[str, type[RoundLedger]] = {
    RoundAccountant.MECHANISM: RoundAccountant,
    DdgRoundAccountant.MECHANISM: DdgRoundAccountant,
}
