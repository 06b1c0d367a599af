"""Synchronous rounds as a protocol object without I/O (DESIGN.md, "sans-I/O").

The simulator calls it in memory; the HTTP server calls the very same methods when
requests arrive. It owns the global model and its version, samples clients, checks
that each update belongs to the open round, streams accepted updates into the
strategy, and closes the round into a new global version. Time is never read here:
the caller passes ``now`` (any monotonic seconds, real or virtual) where a deadline
matters.

Deadlines (Bonawitz et al. 2019, "Towards Federated Learning at Scale", Sec. 2.2):
select ceil(K (1 + over_selection)) clients, close the round when K results arrived
or at ``now + deadline_s``; a round that has fewer than ``min_fraction * K`` results
at its deadline fails (model unchanged, counted in ``failed_rounds``). A result for an
earlier round is ``late``: rejected, or with ``late="fold"`` added to the open round
with weight ``s(t)`` times its usual weight (t = its staleness, s from
aggregation.staleness) when t <= ``max_staleness``.

Sampling: ``sampling="fixed"`` (the default) selects exactly K of the available clients
uniformly without replacement; ``sampling="poisson"`` selects each available client
independently with probability q = K / n (n = available clients), so a round has K
clients on average and may have none; with ``poisson_rate`` set, q is that fixed rate instead
(a deployment's q = K / N over its N registered nodes, of which only the connected ones are
available: a node's chance to be picked never exceeds the q its accountant assumes).
Poisson sampling is what DP-FedAvg's accountant assumes (McMahan et al. 2018,
Algorithm 1); an empty round still closes (a DP strategy then releases its noise alone,
others keep the model).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import numpy as np
import torch

from .errors import UpdateRejected
from .seeding import derive_seed, rng, secret_rng, secret_seed
from .update import PartialSum, Update


def evaluation_due(step: int, every: int, last: int | None = None, stop: bool = False) -> bool:
    """The one evaluation cadence of every engine, server and peer: after every ``every``-th
    round (version, local step) from the start, after the ``last`` one, and after one that ends
    the run early (``stop``: a spent privacy budget). ``simulation.eval_every`` is ``every``."""
    return step > 0 and (step % every == 0 or (last is not None and step >= last) or stop)


@dataclass(frozen=True)
class Assignment:
    """What a selected client is asked to do: train from global ``version`` with ``seed``."""

    client_id: str
    round: int
    version: int
    seed: int


class Rounds(Protocol):
    """What a server drives without knowing the mode: SyncRounds and AsyncRounds (async_rounds.py)
    both implement it. ``round`` numbers the work handed out (sync: the round; async: the version)."""

    version: int
    global_params: torch.Tensor

    @property
    def round(self) -> int: ...

    def assignment(self, client_id: str, quorum: bool) -> Assignment | None:
        """The work ``client_id`` may fetch now (None: nothing for it). ``quorum``: enough
        nodes are connected to hand out new work (async rounds hand out work on demand)."""
        ...

    def time_left(self, now: float) -> float | None:
        """Seconds until the open round's deadline (None: no deadline in this mode)."""
        ...

    def check_round(self, client_id: str, claimed: Any) -> None:
        """Refuse (UpdateRejected) an update whose header names another round than the open one."""
        ...

    def submit(self, client_id: str, update: Update) -> bool:
        """Take one update; True when it completed a new global version by itself."""
        ...

    def holds_task(self, client_id: str, version: int) -> bool:
        """``client_id`` holds work from ``version`` whose result would still be taken."""
        ...

    def status_fields(self) -> dict[str, Any]:
        """round_open, selected, received, outstanding: the round's state for /v1/status."""
        ...

    def version_fields(self) -> dict[str, Any]:
        """What the record of a version that :meth:`submit` completed says of the updates behind it."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class RoundSummary:
    round: int
    version: int
    num_selected: int
    num_results: int
    num_examples: int
    train_loss: float
    rejected: dict[str, int] = field(default_factory=dict)
    failed: bool = False  # closed below min_fraction at its deadline; model unchanged
    num_late: int = 0  # late results folded into this round
    late_staleness: dict[int, int] = field(default_factory=dict)
    # each on-time result's train loss (privacy.release = "noised" clips and noises their sum);
    # None when some results arrived summed (PartialSum) and their losses are not known one by one
    client_losses: list[float] | None = field(default_factory=list)


class SyncRounds:
    """Round r: select K of the available clients, take one update from each, aggregate.

    ``strategy`` is anything with ``begin(global)``, ``accumulate(update, weight)``,
    ``finalize() -> new global`` (shoal.aggregation.Strategy).
    """

    LATE_RULES = ("drop", "fold")
    SAMPLINGS = ("fixed", "poisson")

    def __init__(
        self,
        strategy,
        global_params: torch.Tensor,
        clients_per_round: int = 0,
        fraction: float = 0.1,
        seed: int = 0,
        version: int = 0,
        *,
        over_selection: float = 0.0,
        deadline_s: float | None = None,
        min_fraction: float = 0.0,
        late: str = "drop",
        late_weight: Callable[[int], float] | None = None,
        max_staleness: int | None = None,
        sampling: str = "fixed",
        poisson_rate: float | None = None,
    ):
        if sampling not in self.SAMPLINGS:
            raise ValueError(f"sampling = {sampling!r} must be one of {', '.join(self.SAMPLINGS)}")
        if sampling == "poisson" and over_selection > 0:
            raise ValueError("over_selection needs sampling='fixed': Poisson sampling decides each client alone")
        if over_selection < 0:
            raise ValueError(f"over_selection = {over_selection} must be >= 0")
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s = {deadline_s} must be > 0 (or None for no deadline)")
        if not 0 <= min_fraction <= 1:
            raise ValueError(f"min_fraction = {min_fraction} must be in [0, 1]")
        if late not in self.LATE_RULES:
            raise ValueError(f"late = {late!r} must be one of {', '.join(self.LATE_RULES)}")
        if late == "fold" and late_weight is None:
            raise ValueError("late='fold' needs a late_weight (a staleness weight, aggregation.staleness)")
        if poisson_rate is not None and not 0 < poisson_rate <= 1:
            raise ValueError(f"poisson_rate = {poisson_rate} must be in (0, 1]")
        self.sampling = sampling
        self.poisson_rate = poisson_rate  # poisson: a fixed q instead of K / available (see the module doc)
        self.over_selection = over_selection
        self.deadline_s = deadline_s
        self.min_fraction = min_fraction
        self.late = late
        self.late_weight = late_weight
        self.max_staleness = max_staleness
        self.deadline_at: float | None = None
        self.target = 0  # K: results that close the round early
        self.failed_rounds = 0
        self.late_pending: dict[str, Assignment] = {}  # selected in an earlier round, no result yet
        self._late_count = 0
        self._late_hist: dict[int, int] = {}
        self.strategy = strategy
        self.global_params = global_params
        self.clients_per_round = clients_per_round
        self.fraction = fraction
        self.seed = seed
        # With a secret (bytes from the OS: differential privacy in `shoal server`), selection draws
        # and task seeds come from a keyed hash of it (shoal.seeding.secret_rng / secret_seed)
        # instead of ``seed``: nobody who knows the config can recompute who was sampled.
        self.secret: bytes | None = None
        self.version = version
        self.round = version  # rounds are numbered by the version they start from
        self.selected: dict[str, Assignment] = {}
        self.received: set[str] = set()
        self.open = False
        self._examples = 0
        self._loss_sum = 0.0
        self._losses: list[float] | None = []
        self.rejected: dict[str, int] = {}

    def sample_size(self, num_available: int) -> int:
        """K: the clients a round selects (fixed), or selects on average (poisson)."""
        k = self.clients_per_round or max(1, round(self.fraction * num_available))
        return min(k, num_available)

    def sampling_rate(self, num_available: int) -> float:
        """q = K / n (or the fixed ``poisson_rate``): each client's probability of being selected in a round."""
        if self.sampling == "poisson" and self.poisson_rate is not None:
            return self.poisson_rate if num_available else 0.0
        return self.sample_size(num_available) / num_available if num_available else 0.0

    def _rng(self, *parts: int) -> np.random.Generator:
        return secret_rng(self.secret, *parts) if self.secret is not None else rng(self.seed, *parts)

    def _seed(self, *parts: int) -> int:
        return secret_seed(self.secret, *parts) if self.secret is not None else derive_seed(self.seed, *parts)

    def start_round(self, available: Sequence[str], now: float | None = None) -> list[Assignment]:
        """Open the next round over ``available`` client ids; returns the tasks to hand out.

        K = sample_size(len(available)) results are wanted; ceil(K (1 + over_selection))
        clients are selected (at most all available). With a deadline, ``now`` is needed."""
        if self.open:
            raise RuntimeError("start_round called while a round is open")
        if not available:
            raise ValueError("no clients available to select")
        deadline_at: float | None = None
        if self.deadline_s is not None:
            if now is None:
                raise ValueError("this SyncRounds has a deadline: pass now= to start_round")
            deadline_at = now + self.deadline_s
        self.round += 1
        ids = sorted(available)
        self.target = self.sample_size(len(ids))
        self.deadline_at = deadline_at
        if self.sampling == "poisson":
            draws = self._rng(self.round, 0x9015).random(len(ids))
            q = self.poisson_rate if self.poisson_rate is not None else self.target / len(ids)
            chosen = [i for i in range(len(ids)) if draws[i] < q]
            self.target = len(chosen)  # the round is complete when every selected client reported
        else:
            k = min(len(ids), math.ceil(self.target * (1 + self.over_selection) - 1e-9))
            chosen = self._rng(self.round).choice(len(ids), size=k, replace=False).tolist()
        self.selected = {
            ids[i]: Assignment(ids[i], self.round, self.version, self._seed(self.round, i_hash(ids[i])))
            for i in sorted(chosen)
        }
        for cid in self.selected:  # a new task replaces an outstanding late one
            self.late_pending.pop(cid, None)
        self.received = set()
        self._examples, self._loss_sum, self._losses = 0, 0.0, []
        self.rejected = {}
        self._late_count, self._late_hist = 0, {}
        self.strategy.begin(self.global_params)
        self.open = True
        return list(self.selected.values())

    def check(self, client_id: str, update: Update) -> None:
        """Raise UpdateRejected unless ``update`` may enter the open round (nothing changes)."""
        if not self.open:
            raise UpdateRejected("round_closed", f"no round is open (current version {self.version})")
        if client_id not in self.selected:
            raise UpdateRejected("not_selected", f"node {client_id!r} was not selected for round {self.round}")
        if client_id in self.received:
            raise UpdateRejected("duplicate", f"node {client_id!r} already sent its update for round {self.round}")
        if update.base_version != self.version:
            raise UpdateRejected(
                "stale", f"update is based on version {update.base_version}, the round trains version {self.version}"
            )

    def _late_staleness(self, client_id: str, update: Update) -> int | None:
        """The staleness of a result for an earlier round, or None if it is not one."""
        task = self.late_pending.get(client_id)
        if task is None or update.base_version != task.version:
            return None
        return self.version - update.base_version

    def submit(self, client_id: str, update: Update, blocks: Iterable[torch.Tensor] | None = None) -> bool:
        """Check, then stream the update into the strategy (late ones: see the module doc).
        False: a round closes into a new version in :meth:`finish_round`, never here.
        ``blocks``: the delta in consecutive pieces instead of ``update.delta`` (Strategy.accumulate_blocks)."""
        t = self._late_staleness(client_id, update)
        if t is not None:
            self._submit_late(client_id, update, t, blocks)
            return False
        try:
            self.check(client_id, update)
        except UpdateRejected as e:
            self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
            raise
        if blocks is None:
            self.strategy.accumulate(update)
        else:
            self.strategy.accumulate_blocks(update, blocks)
        self.received.add(client_id)
        self._examples += update.num_examples
        self._loss_sum += update.metrics.get("train_loss", 0.0) * update.num_examples
        if self._losses is not None:
            self._losses.append(float(update.metrics.get("train_loss", float("nan"))))
        return False

    def submit_sum(self, part: PartialSum) -> None:
        """Several selected clients' updates summed where they trained (shoal.update.PartialSum):
        each sender is checked as :meth:`submit` checks one (all or nothing), then the sum enters
        the strategy, which must be a plain weighted mean (Strategy.accumulate_sum)."""
        seen: set[str] = set()
        for cid in part.senders:
            if cid in seen:
                self.rejected["duplicate"] = self.rejected.get("duplicate", 0) + 1
                raise UpdateRejected("duplicate", f"node {cid!r} appears twice in one partial sum")
            seen.add(cid)
            try:
                self.check(cid, Update(torch.empty(0), 0, part.base_version, cid))
            except UpdateRejected as e:
                self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
                raise
        if not part.senders:
            return
        self.strategy.accumulate_sum(part)
        self.received.update(part.senders)
        self._examples += part.num_examples
        self._loss_sum += part.loss_sum
        self._losses = None  # summed where they trained: no loss of one client is known here

    def _submit_late(
        self, client_id: str, update: Update, t: int, blocks: Iterable[torch.Tensor] | None = None
    ) -> None:
        def reject(code: str, detail: str) -> NoReturn:
            self.rejected[code] = self.rejected.get(code, 0) + 1
            raise UpdateRejected(code, detail)

        del self.late_pending[client_id]
        if self.late == "drop":
            reject(
                "late",
                f"update for version {update.base_version} arrived after its round closed "
                f"(now version {self.version}); late results are dropped (late = 'drop')",
            )
        if self.max_staleness is not None and t > self.max_staleness:
            reject("too_stale", f"late update is {t} versions old; the limit is max_staleness = {self.max_staleness}")
        if not self.open:
            reject("round_closed", f"late update arrived with no round open to fold it into (version {self.version})")
        assert self.late_weight is not None  # __init__ refuses late='fold' without one
        if blocks is None:
            self.strategy.accumulate(update, self.late_weight(t))
        else:
            self.strategy.accumulate_blocks(update, blocks, self.late_weight(t))
        self._late_count += 1
        self._late_hist[t] = self._late_hist.get(t, 0) + 1

    @property
    def complete(self) -> bool:
        """K results arrived (every selected client's, without over-selection)."""
        return self.open and len(self.received) >= min(self.target or len(self.selected), len(self.selected))

    def should_close(self, now: float | None = None) -> bool:
        """Close now? True when K results arrived, or when the deadline has passed
        (then :meth:`finish_round` aggregates, or fails the round below min_fraction)."""
        if not self.open:
            return False
        if self.complete:
            return True
        return self.deadline_at is not None and now is not None and now >= self.deadline_at

    def abort_round(self) -> RoundSummary:
        """Close the open round without aggregating (e.g. secure aggregation aborted):
        the global model and its version stay as they were."""
        if not self.open:
            raise RuntimeError("abort_round called with no open round")
        self.open = False
        return RoundSummary(
            round=self.round,
            version=self.version,
            num_selected=len(self.selected),
            num_results=0,
            num_examples=0,
            train_loss=float("nan"),
            rejected=dict(self.rejected),
        )

    def finish_round(self) -> RoundSummary:
        """Aggregate what arrived into the next global version.

        Selected clients that have not reported become late (see the module doc). With
        fewer than ``min_fraction * K`` on-time results the round fails: the model and
        version are unchanged, ``failed_rounds`` counts it and the summary says
        ``failed=True``."""
        if not self.open:
            raise RuntimeError("finish_round called with no open round")
        for cid, task in self.selected.items():
            if cid not in self.received:
                self.late_pending[cid] = task
        needed = self.min_fraction * self.target
        if self.min_fraction > 0 and len(self.received) < needed:
            self.open = False
            self.failed_rounds += 1
            self.strategy.begin(self.global_params)  # drop what was accumulated
            return self._summary(failed=True)
        if not self.received and not self._late_count and self.sampling == "poisson" and not self.selected:
            return self._finish_empty()
        if not self.received and not self._late_count:
            self.open = False
            raise UpdateRejected("no_results", f"round {self.round} closed with no results; the model is unchanged")
        self.global_params = self.strategy.finalize()
        self.version += 1
        self.open = False
        if self.max_staleness is not None:  # results older than the limit would be refused anyway
            self.late_pending = {
                c: t for c, t in self.late_pending.items() if self.version - t.version <= self.max_staleness
            }
        return self._summary(failed=False)

    def finish_empty(self) -> RoundSummary:
        """Close the open round as one that selected nobody, dropping anything summed into it (secure
        distributed DP's abort: the DP noise of an empty round is released, so that an abort shows as
        nothing of its own; shoal.accounting_aborts). Its selected clients are not late."""
        if not self.open:
            raise RuntimeError("finish_empty called with no open round")
        self.strategy.begin(self.global_params)
        self.selected, self.received = {}, set()
        self._examples, self._loss_sum, self._losses = 0, 0.0, []
        self._late_count, self._late_hist = 0, {}
        return self._finish_empty()

    def _finish_empty(self) -> RoundSummary:
        """Poisson sampling picked nobody: a strategy that releases something without updates
        (DP noise, so that an empty round looks like any other) makes a new version; any other
        keeps the model."""
        from shoal.aggregation.mean import EmptyAggregate

        self.open = False
        try:
            self.global_params = self.strategy.finalize()
        except EmptyAggregate:
            return self._summary(failed=False)
        self.version += 1
        return self._summary(failed=False)

    def _summary(self, failed: bool) -> RoundSummary:
        return RoundSummary(
            round=self.round,
            version=self.version,
            num_selected=len(self.selected),
            num_results=len(self.received),
            num_examples=self._examples,
            train_loss=self._loss_sum / max(self._examples, 1),
            rejected=dict(self.rejected),
            failed=failed,
            num_late=self._late_count,
            late_staleness=dict(self._late_hist),
            client_losses=None if self._losses is None else list(self._losses),
        )

    # --- the rest of the Rounds protocol (what the server asks) ---------------------------

    def assignment(self, client_id: str, quorum: bool = True) -> Assignment | None:
        """The client's task in the open round, until it reported (the round's selection
        already needed the quorum)."""
        if self.open and client_id in self.selected and client_id not in self.received:
            return self.selected[client_id]
        return None

    def time_left(self, now: float) -> float | None:
        return max((self.deadline_at if self.deadline_at is not None else now) - now, 0.0)

    def check_round(self, client_id: str, claimed: Any) -> None:
        if self.open and client_id not in self.late_pending and claimed is not None and claimed != self.round:
            raise UpdateRejected("wrong_round", f"update is for round {claimed!r}, the open round is {self.round}")

    def holds_task(self, client_id: str, version: int) -> bool:
        return self.open and self.version == version and client_id in self.selected and client_id not in self.received

    def status_fields(self) -> dict[str, Any]:
        return {
            "round_open": self.open,
            "selected": sorted(self.selected) if self.open else [],
            "received": len(self.received) if self.open else 0,
            "outstanding": 0,
        }

    def version_fields(self) -> dict[str, Any]:
        return {}  # a sync version's record is its RoundSummary (finish_round)

    def state_dict(self) -> dict:
        """What survives a restart between rounds: model, version, round counter, the
        strategy's optimizer state, failed rounds and the tasks whose results would be
        late. An open round is not included; checkpoint after :meth:`finish_round`. The model is
        the live tensor, not a copy (a large model's checkpoint costs no second model): each
        version is a new tensor, the global parameters are never changed in place."""
        if self.open:
            raise RuntimeError("state_dict() while a round is open: checkpoint after finish_round()")
        return {
            "version": self.version,
            "round": self.round,
            "global_params": self.global_params.detach(),
            "strategy": self.strategy.state_dict(),
            "failed_rounds": self.failed_rounds,
            "late_pending": {c: [t.round, t.version, t.seed] for c, t in self.late_pending.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])
        self.round = int(state["round"])
        self.global_params = torch.as_tensor(state["global_params"]).clone()
        self.strategy.load_state_dict(state["strategy"])
        self.failed_rounds = int(state["failed_rounds"])
        self.late_pending = {
            c: Assignment(c, int(r), int(v), int(sd)) for c, (r, v, sd) in state["late_pending"].items()
        }
        self.open = False


def i_hash(client_id: str) -> int:
    """A stable 32-bit integer for a client id (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(client_id.encode(), digest_size=4).digest(), "little")
