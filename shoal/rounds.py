"""Synchronous rounds as a protocol object without I/O (DESIGN.md, "sans-I/O").

The simulator calls it in memory; the HTTP server calls the very same methods when
requests arrive. It owns the global model and its version, samples clients, checks
that each update belongs to the open round, streams accepted updates into the
strategy, and closes the round into a new global version. Time is never read here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from .errors import UpdateRejected
from .seeding import derive_seed, rng
from .update import Update


@dataclass(frozen=True)
class Task:
    """What a selected client is asked to do: train from global ``version`` with ``seed``."""

    client_id: str
    round: int
    version: int
    seed: int


@dataclass
class RoundSummary:
    round: int
    version: int
    num_selected: int
    num_results: int
    num_examples: int
    train_loss: float
    rejected: dict[str, int] = field(default_factory=dict)


class SyncRounds:
    """Round r: select K of the available clients, take one update from each, aggregate.

    ``strategy`` is anything with ``begin(global)``, ``accumulate(update, weight)``,
    ``finalize() -> new global`` (shoal.aggregation.Strategy).
    """

    def __init__(self, strategy, global_params: torch.Tensor, clients_per_round: int = 0,
                 fraction: float = 0.1, seed: int = 0, version: int = 0):
        self.strategy = strategy
        self.global_params = global_params
        self.clients_per_round = clients_per_round
        self.fraction = fraction
        self.seed = seed
        self.version = version
        self.round = version  # rounds are numbered by the version they start from
        self.selected: dict[str, Task] = {}
        self.received: set[str] = set()
        self.open = False
        self._examples = 0
        self._loss_sum = 0.0
        self.rejected: dict[str, int] = {}

    def sample_size(self, num_available: int) -> int:
        k = self.clients_per_round or max(1, round(self.fraction * num_available))
        return min(k, num_available)

    def start_round(self, available: list[str]) -> list[Task]:
        """Open the next round over ``available`` client ids; returns the tasks to hand out."""
        if self.open:
            raise RuntimeError("start_round called while a round is open")
        if not available:
            raise ValueError("no clients available to select")
        self.round += 1
        ids = sorted(available)
        k = self.sample_size(len(ids))
        chosen = rng(self.seed, self.round).choice(len(ids), size=k, replace=False)
        self.selected = {
            ids[i]: Task(ids[i], self.round, self.version, derive_seed(self.seed, self.round, i_hash(ids[i])))
            for i in sorted(chosen)
        }
        self.received = set()
        self._examples, self._loss_sum = 0, 0.0
        self.rejected = {}
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

    def submit(self, client_id: str, update: Update) -> None:
        """Check, then stream the update into the strategy."""
        try:
            self.check(client_id, update)
        except UpdateRejected as e:
            self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
            raise
        self.strategy.accumulate(update)
        self.received.add(client_id)
        self._examples += update.num_examples
        self._loss_sum += update.metrics.get("train_loss", 0.0) * update.num_examples

    @property
    def complete(self) -> bool:
        return self.open and len(self.received) == len(self.selected)

    def abort_round(self) -> RoundSummary:
        """Close the open round without aggregating (e.g. secure aggregation aborted):
        the global model and its version stay as they were."""
        if not self.open:
            raise RuntimeError("abort_round called with no open round")
        self.open = False
        return RoundSummary(
            round=self.round, version=self.version, num_selected=len(self.selected), num_results=0,
            num_examples=0, train_loss=float("nan"), rejected=dict(self.rejected),
        )

    def finish_round(self) -> RoundSummary:
        """Aggregate what arrived into the next global version."""
        if not self.open:
            raise RuntimeError("finish_round called with no open round")
        if not self.received:
            raise UpdateRejected("no_results", f"round {self.round} closed with no results; the model is unchanged")
        self.global_params = self.strategy.finalize()
        self.version += 1
        self.open = False
        return RoundSummary(
            round=self.round, version=self.version, num_selected=len(self.selected),
            num_results=len(self.received), num_examples=self._examples,
            train_loss=self._loss_sum / max(self._examples, 1), rejected=dict(self.rejected),
        )


def i_hash(client_id: str) -> int:
    """A stable 32-bit integer for a client id (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(client_id.encode(), digest_size=4).digest(), "little")
