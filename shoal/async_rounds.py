"""Asynchronous training as a protocol object without I/O (DESIGN.md, "sans-I/O").

There are no rounds: any client may ask for a :meth:`AsyncRounds.task` at any time
and trains from the global version current then; its update arrives later, when the
global model may have moved on. Staleness t = (version now) - (update.base_version).
The update is rejected (``too_stale``) when t > ``max_staleness``, otherwise handed to
the algorithm with t:

- :class:`~shoal.aggregation.fedasync.FedAsync`: mixed in at once; every accepted
  update advances the version.
- :class:`~shoal.aggregation.fedbuff.FedBuff`: buffered; the version advances when K
  updates have arrived (combined by the ``[robust]`` rule when one is set).

The simulator (simulations/async_engine.py) and the HTTP server call the same methods.
No clock is read here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .aggregation.fedasync import FedAsync
from .aggregation.fedbuff import FedBuff
from .errors import UpdateRejected
from .rounds import Assignment, i_hash
from .seeding import derive_seed
from .update import PartialSum, Update


@dataclass
class AsyncStats:
    """Counts since the start: accepted updates, rejections by code, and the staleness
    histogram of accepted updates ({staleness: count})."""

    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    staleness: dict[int, int] = field(default_factory=dict)
    examples: int = 0
    loss_sum: float = 0.0  # sum of train_loss * num_examples over accepted updates

    def copy(self) -> AsyncStats:
        return AsyncStats(self.accepted, dict(self.rejected), dict(self.staleness), self.examples, self.loss_sum)


class AsyncRounds:
    """Hands out tasks from the current version and applies updates as they arrive.

    A client holds at most one task: asking again replaces it. An update is accepted
    only from a client with an open task and only if it was trained from that task's
    version; rejection codes are ``not_assigned`` (no open task, e.g. a duplicate),
    ``bad_version`` (base_version differs from the task's) and ``too_stale``. Every
    rejection is counted in ``stats.rejected`` and leaves the model unchanged.
    """

    def __init__(
        self,
        algorithm: FedAsync | FedBuff,
        global_params: torch.Tensor,
        seed: int = 0,
        max_staleness: int | None = None,
        version: int = 0,
    ):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness = {max_staleness} must be >= 0 (or None for no limit)")
        self.algorithm = algorithm
        self.global_params = global_params
        self.seed = seed
        self.max_staleness = max_staleness
        self.version = version
        self.stats = AsyncStats()
        self.outstanding: dict[str, Assignment] = {}
        self._counters: dict[str, int] = {}
        # FedAsync mix="model" needs the model a stale client trained from: keep the
        # versions that some open task still refers to, and only those.
        self._history: dict[int, torch.Tensor] = {}

    @property
    def round(self) -> int:
        """Async work is numbered by the version it starts from (the Rounds protocol)."""
        return self.version

    @property
    def _keeps_history(self) -> bool:
        return isinstance(self.algorithm, FedAsync) and self.algorithm.mix == "model"

    def task(self, client_id: str) -> Assignment:
        """A task to train from the current global version (replacing any open one).

        The seed is derived from (seed, client, how many tasks this client got), so a
        run is reproducible whatever order clients ask in."""
        n = self._counters.get(client_id, 0) + 1
        self._counters[client_id] = n
        t = Assignment(client_id, self.version, self.version, derive_seed(self.seed, i_hash(client_id), n))
        self.outstanding[client_id] = t
        if self._keeps_history:
            self._history[self.version] = self.global_params
            self._prune()
        return t

    def forget(self, client_id: str) -> None:
        """Close ``client_id``'s open task without an update (it went offline or timed
        out); a later update for it is ``not_assigned``. Nothing is counted."""
        if self.outstanding.pop(client_id, None) is not None:
            self._prune()

    def staleness(self, update: Update) -> int:
        return self.version - update.base_version

    def check(self, client_id: str, update: Update) -> int:
        """Raise UpdateRejected unless ``update`` may be applied; returns its staleness."""
        task = self.outstanding.get(client_id)
        if task is None:
            raise UpdateRejected("not_assigned", f"node {client_id!r} has no open task; ask for one first")
        if update.base_version != task.version:
            raise UpdateRejected(
                "bad_version",
                f"update is based on version {update.base_version}, but node {client_id!r} was sent "
                f"version {task.version}",
            )
        t = self.staleness(update)
        if self.max_staleness is not None and t > self.max_staleness:
            raise UpdateRejected(
                "too_stale",
                f"update is {t} versions old (version {update.base_version}, now {self.version}); "
                f"the limit is max_staleness = {self.max_staleness}",
            )
        return t

    def submit(self, client_id: str, update: Update) -> bool:
        """Apply (or buffer) ``update``; True when the global version advanced.

        A ``too_stale`` rejection closes the client's task (it must ask for a new one);
        ``not_assigned`` and ``bad_version`` leave the open task as it was."""
        try:
            t = self.check(client_id, update)
        except UpdateRejected as e:
            self.stats.rejected[e.code] = self.stats.rejected.get(e.code, 0) + 1
            if e.code == "too_stale":
                del self.outstanding[client_id]
                self._prune()
            raise
        task = self.outstanding.pop(client_id)
        self.stats.accepted += 1
        self.stats.staleness[t] = self.stats.staleness.get(t, 0) + 1
        self.stats.examples += update.num_examples
        self.stats.loss_sum += update.metrics.get("train_loss", 0.0) * update.num_examples
        advanced = False
        if isinstance(self.algorithm, FedAsync):
            base = self._history.get(task.version) if self._keeps_history else None
            self.global_params = self.algorithm.apply(self.global_params, update, t, base)
            advanced = True
        else:
            self.algorithm.accumulate(update, t)
            if self.algorithm.full:
                self.global_params = self.algorithm.flush(self.global_params)
                advanced = True
        if advanced:
            self.version += 1
        self._prune()
        return advanced

    def submit_sum(self, part: PartialSum) -> bool:
        """Several nodes' updates summed by an edge aggregator, all trained from
        ``part.base_version`` (shoal.update.PartialSum): each sender is checked as :meth:`check`
        checks one update (an open task of that version, not too stale; all or nothing), then
        the sum enters FedBuff's buffer with the senders' staleness weight and counts one per
        sender. True when the global version advanced. FedAsync mixes each update into the model
        as it arrives, which a sum of several cannot do: it takes none. A ``too_stale`` refusal
        closes the senders' tasks, as it closes one node's."""
        if not isinstance(self.algorithm, FedBuff) or self.algorithm.rule is not None:
            raise UpdateRejected(
                "not_supported", "only FedBuff with a plain weighted mean takes partial sums (no robust rule)"
            )
        if len(set(part.senders)) != len(part.senders):
            raise UpdateRejected("duplicate", "a node appears twice in one partial sum")
        if not part.senders:
            raise UpdateRejected("empty", "a partial sum of no update")
        if part.weighting != self.algorithm.weighting:
            raise UpdateRejected(
                "malformed", f"a sum weighted by {part.weighting!r}; this buffer weighs by {self.algorithm.weighting!r}"
            )
        probe = Update(torch.empty(0), 0, part.base_version)
        try:
            for cid in part.senders:
                t = self.check(cid, probe)
        except UpdateRejected as e:
            self.stats.rejected[e.code] = self.stats.rejected.get(e.code, 0) + 1
            if e.code == "too_stale":
                for cid in part.senders:
                    self.outstanding.pop(cid, None)
                self._prune()
            raise
        self.algorithm.accumulate_sum(part.weighted_sum, part.total_weight, len(part.senders), t)
        for cid in part.senders:
            del self.outstanding[cid]
        k = len(part.senders)
        self.stats.accepted += k
        self.stats.staleness[t] = self.stats.staleness.get(t, 0) + k
        self.stats.examples += part.num_examples
        self.stats.loss_sum += part.loss_sum
        advanced = self.algorithm.full
        if advanced:
            self.global_params = self.algorithm.flush(self.global_params)
            self.version += 1
        self._prune()
        return advanced

    # --- the rest of the Rounds protocol (shoal.rounds.Rounds) -------------------------

    def assignment(self, client_id: str, quorum: bool = True) -> Assignment | None:
        """A new task from the current version, when enough nodes are connected."""
        return self.task(client_id) if quorum else None

    def time_left(self, now: float) -> float | None:
        return None  # no deadline: an update is taken until it is too stale

    def check_round(self, client_id: str, claimed: Any) -> None:
        return None  # the task's version, checked in submit, is what an update must match

    def holds_task(self, client_id: str, version: int) -> bool:
        if self.max_staleness is not None and self.version - version > self.max_staleness:
            return False
        t = self.outstanding.get(client_id)
        return t is not None and t.version == version

    def status_fields(self) -> dict[str, Any]:
        return {"round_open": False, "selected": [], "received": 0, "outstanding": len(self.outstanding)}

    def version_fields(self) -> dict[str, Any]:
        return {"updates_accepted": self.stats.accepted}

    def _prune(self) -> None:
        """Drop kept base versions no open task can still use (none, or too old to be accepted)."""
        if self._history:
            oldest = -1 if self.max_staleness is None else self.version - self.max_staleness
            live = {t.version for t in self.outstanding.values() if t.version >= oldest}
            for v in [v for v in self._history if v not in live]:
                del self._history[v]

    def state_dict(self) -> dict:
        """Everything a restart needs: model, version, open tasks, counters, statistics,
        the algorithm's state (FedBuff's buffer and optimizer) and kept base versions."""
        s = self.stats
        state = {
            "version": self.version,
            "global_params": self.global_params.detach().clone(),
            "outstanding": {c: [t.round, t.version, t.seed] for c, t in self.outstanding.items()},
            "counters": dict(self._counters),
            "history": {v: p.detach().clone() for v, p in self._history.items()},
            "stats": {
                "accepted": s.accepted,
                "rejected": dict(s.rejected),
                "staleness": dict(s.staleness),
                "examples": s.examples,
                "loss_sum": s.loss_sum,
            },
        }
        if isinstance(self.algorithm, FedBuff):
            state["algorithm"] = self.algorithm.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])
        self.global_params = torch.as_tensor(state["global_params"]).clone()
        self.outstanding = {c: Assignment(c, int(r), int(v), int(sd)) for c, (r, v, sd) in state["outstanding"].items()}
        self._counters = {c: int(n) for c, n in state["counters"].items()}
        self._history = {int(v): torch.as_tensor(p).clone() for v, p in state["history"].items()}
        st = state["stats"]
        self.stats = AsyncStats(
            int(st["accepted"]),
            dict(st["rejected"]),
            {int(k): int(v) for k, v in st["staleness"].items()},
            int(st["examples"]),
            float(st["loss_sum"]),
        )
        if isinstance(self.algorithm, FedBuff):
            self.algorithm.load_state_dict(state["algorithm"])
