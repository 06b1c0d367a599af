"""An edge's own rounds, without I/O (docs/hierarchy.md).

:class:`EdgeRound` is one root round at an edge (its nodes' sum, when to close: every node, a
quorum by weight, or a margin before the root's deadline) and :class:`Retransmit` when it sends its
partial again; :class:`EdgeRounds` runs HierFAVG's ``hierarchy.edge_rounds`` edge rounds inside one
root round (the edge's own model between them); :class:`EdgeBuffer` buffers its nodes' updates by
version under an async root. The root's side is intake.py; the process around them service.py,
uplink.py and app.py.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from shoal.aggregation.partial import Accumulator, Partial
from shoal.config.rules import MAX_EDGE_ROUNDS  # edge versions of one root version
from shoal.errors import UpdateRejected
from shoal.seeding import derive_seed
from shoal.update import Update

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


class EdgeRound:
    """One root round at an edge aggregator, without I/O: the edge's nodes' updates go into one
    float64 sum (aggregation/partial.Accumulator) and leave as one sealed partial.

    The edge closes its part of the round (:meth:`should_close`) when every node it was given
    reported, when the reported weight reaches ``quorum`` of the weight it expects (``expected``:
    each node's weight as the edge last saw it, e.g. its examples in the previous round; a node
    never seen counts as the mean of the known ones; with no weight known, ``quorum`` is a share
    of its nodes), or ``margin_s`` before the root's
    deadline, whichever comes first; a round with no update closes into nothing to send. An
    update after the close, from a node the edge was not given, from another version, or a second
    one from the same node is refused (UpdateRejected) and changes nothing."""

    def __init__(
        self,
        edge: str,
        round: int,
        version: int,
        numel: int,
        nodes: list[str],
        *,
        weighting: str = "examples",
        deadline_at: float | None = None,
        margin_s: float = 0.0,
        quorum: float = 1.0,
        expected: dict[str, float] | None = None,
    ):
        if not 0 < quorum <= 1:
            raise ValueError(f"quorum = {quorum} must be in (0, 1]")
        self.edge, self.round, self.version = edge, round, version
        self.nodes = set(nodes)
        self.acc = Accumulator(round, version, numel, weighting)
        self.close_at = None if deadline_at is None else deadline_at - margin_s
        self.quorum = quorum
        self._expected = expected or {}
        self._weigh()
        self.closed = False

    def _weigh(self) -> None:
        known = {n: w for n, w in self._expected.items() if n in self.nodes and w > 0}
        default = sum(known.values()) / len(known) if known else 0.0
        # the weight the quorum is a share of (0: no weight known, the quorum counts nodes)
        self.expected_weight = sum(known.get(n, default) for n in self.nodes)

    def add(self, node: str) -> bool:
        """The root gave this edge ``node``'s task during the round (it re-attached here): the edge waits
        for it too. False once closed."""
        if self.closed or node in self.nodes:
            return False
        self.nodes.add(node)
        self._weigh()
        return True

    def drop(self, node: str) -> None:
        """``node`` will send nothing this round (its training failed): the edge stops waiting for it."""
        if not self.closed and node in self.nodes and node not in self.acc.senders:
            self.nodes.discard(node)

    def submit(self, node: str, update: Update) -> None:
        if self.closed:
            raise UpdateRejected("round_closed", f"edge {self.edge!r} closed its part of round {self.round}")
        if node not in self.nodes:
            raise UpdateRejected("not_selected", f"node {node!r} has no task from edge {self.edge!r} this round")
        update.sender = node  # the authenticated identity, not what the body claims
        self.acc.add_update(update)

    @property
    def complete(self) -> bool:
        return self.acc.count >= len(self.nodes)

    def should_close(self, now: float) -> bool:
        if self.closed:
            return False
        if self.complete:
            return True
        if self.acc.count and self.quorum < 1:
            if self.expected_weight > 0 and self.acc.total_weight >= self.quorum * self.expected_weight:
                return True
            if self.expected_weight == 0 and self.acc.count >= self.quorum * len(self.nodes):
                return True
        return self.close_at is not None and now >= self.close_at

    def close(self) -> Partial | None:
        """The edge's partial, sealed with its name (None: no update arrived)."""
        self.closed = True
        return self.acc.partial().sealed(self.edge) if self.acc.count else None


#: Versions of an edge's own models (edge rounds 2..k of a root round) start here: far above any
#: root version (one per root round), so a node never takes an edge model for a root one.
EDGE_VERSION_BASE = 1 << 52
EDGE_ROUND_STREAM = 0xE06E  # a node's seed in edge round k > 1, derived as the simulator derives it


def edge_version(root_version: int, k: int) -> int:
    """The version id of the edge model a node trains from in edge round ``k`` (0-based, k >= 1)."""
    if not 1 <= k < MAX_EDGE_ROUNDS:
        raise ValueError(f"edge round {k} is not in 1..{MAX_EDGE_ROUNDS - 1}")
    return EDGE_VERSION_BASE + root_version * MAX_EDGE_ROUNDS + k


class EdgeRounds:
    """HierFAVG's edge rounds (``hierarchy.edge_rounds = kappa``) inside one root round at an edge,
    without I/O: the same cycle as the simulator's virtual edges (simulations/hierarchy.py).

    Edge round 0 is the root's round as a plain edge serves it: its nodes train from the root's
    model x. When an edge round closes (:meth:`advance`), the edge adds its nodes' weighted mean
    to its own model x_e (float32, as the simulator does) and opens the next one: the same nodes
    train from x_e, served under :func:`edge_version`, each with a seed derived from its root
    seed and k. The last edge round's partial goes to the root (:meth:`final`) with
    ``W_e (x_e - x)`` added to its sum (W_e: that round's total weight), so the root's FedAvg
    gives the edges' models weighted by W_e. Each edge round gets an equal share of the time left
    before the root's deadline less the margin (:meth:`close_at`); a node that misses one is that
    edge round's drop-out, and an edge round with no update ends the cycle with nothing to send."""

    def __init__(self, kappa: int, round: int, version: int, seeds: dict[str, int], close_at: float | None):
        if not 1 <= kappa <= MAX_EDGE_ROUNDS:
            raise ValueError(f"edge_rounds = {kappa} is not in 1..{MAX_EDGE_ROUNDS}")
        self.kappa, self.round, self.root_version = kappa, round, version
        self.seeds = dict(seeds)
        self.deadline = close_at  # the whole cycle closes by then (the root's deadline less the margin)
        self.k = 0
        self.root: torch.Tensor | None = None  # the root's model x (float32), taken at the first advance
        self.params: torch.Tensor | None = None  # the edge's model x_e (float32)

    @property
    def version(self) -> int:
        """The version the open edge round's nodes train from."""
        return self.root_version if self.k == 0 else edge_version(self.root_version, self.k)

    @property
    def last(self) -> bool:
        return self.k == self.kappa - 1

    def seed(self, node: str) -> int:
        s = self.seeds[node]
        return s if self.k == 0 else derive_seed(s, EDGE_ROUND_STREAM, self.k)

    def close_at(self, now: float) -> float | None:
        """When the open edge round closes at the latest: its share of the time left."""
        if self.deadline is None:
            return None
        return now + max(self.deadline - now, 0.0) / (self.kappa - self.k)

    def advance(self, part: Partial, root_params: torch.Tensor) -> None:
        """Edge round k closed with ``part`` (not the last): x_e += its mean; edge round k + 1 opens."""
        if self.last:
            raise ValueError("the last edge round's partial goes to the root (final)")
        if self.params is None:
            self.root = root_params.detach().to("cpu", torch.float32).clone()
            self.params = self.root.clone()
        self.params = self.params + part.mean()
        self.k += 1

    def final(self, part: Partial) -> Partial:
        """The partial for the root, of its round and version: sum_i w_i delta_i + W_e (x_e - x)."""
        if not self.last:
            raise ValueError(f"edge round {self.k} of {self.kappa} is not the last")
        if self.params is None or self.root is None:
            return part  # one edge round: the root's own
        offset = self.params.to(torch.float64) - self.root.to(torch.float64)
        return replace(part, version=self.root_version, weighted_sum=part.weighted_sum + part.total_weight * offset)


class EdgeBuffer:
    """An edge aggregator under an async (FedBuff) root, without I/O: its nodes' tasks, each from the
    version current at the root when it was handed out, and their updates summed by base version
    (one float64 Accumulator per version present: each partial's nodes share a staleness at the
    root). The edge flushes (:meth:`should_flush`) once ``size`` updates are buffered or the oldest
    has waited ``wait_s``; :meth:`flush` gives one sealed partial per version held.

    A node holds at most one task here; a task whose model this edge no longer serves (the root's
    version moved on before the node fetched it) is dropped, and the node asks again (:meth:`stale`);
    a node that asks again after its task was delivered gave that task up (as at a flat async root,
    asking again replaces the task). A node whose update is buffered here, or on its way to the root,
    gets no new task until the root answered that partial (:meth:`answered`): the root holds one open
    task per node, and a new one would replace the task the buffered update belongs to.
    An update from a node holding no task, from another version than its task's, or a second one
    is refused (UpdateRejected) and changes nothing."""

    def __init__(self, edge: str, numel: int, *, weighting: str = "examples", size: int = 1, wait_s: float = 1.0):
        if size < 1 or not wait_s > 0:
            raise ValueError(f"an edge buffer of size {size} flushed after {wait_s} s: both must be > 0")
        self.edge, self.numel, self.weighting = edge, numel, weighting
        self.size, self.wait_s = size, wait_s
        self.tasks: dict[str, tuple[int, int]] = {}  # node -> (version, seed) of its open task
        self.want: set[str] = set()  # nodes that asked this edge for a task and hold none
        self.delivered: set[str] = set()  # nodes whose open task reached them
        self.pending: set[str] = set()  # nodes whose update is buffered or in a partial not yet answered
        self.held_back: set[str] = set()  # pending nodes that asked for a task meanwhile
        self.sums: dict[int, Accumulator] = {}
        self.first_at: float | None = None  # when the oldest buffered update arrived

    @property
    def count(self) -> int:
        return sum(a.count for a in self.sums.values())

    def asks(self, node: str) -> tuple[int, int] | None:
        """``node`` polls: its open task (version, seed), or None (it then waits for one from the root)."""
        if node in self.pending:
            self.held_back.add(node)
            return None
        if node in self.delivered:  # it asks again: it gave up the task it got
            self.stale(node)
        task = self.tasks.get(node)
        if task is None:
            self.want.add(node)
        return task

    def deliver(self, node: str) -> None:
        """``node``'s open task went out to it."""
        self.delivered.add(node)

    def given(self, tasks: dict[str, int], version: int) -> None:
        """The root handed out ``tasks`` (node -> seed) from ``version``."""
        for n, seed in tasks.items():
            self.tasks[n] = (version, seed)
            self.want.discard(n)

    def stale(self, node: str) -> None:
        """``node``'s task is of a model this edge no longer serves: dropped; it asks for another."""
        self.tasks.pop(node, None)
        self.delivered.discard(node)
        self.want.add(node)

    def forget(self, keep: Iterable[str]) -> None:
        """Nodes no longer connected wait for nothing."""
        self.want &= set(keep)

    def submit(self, node: str, update: Update, now: float) -> None:
        task = self.tasks.get(node)
        if task is None:
            raise UpdateRejected("not_assigned", f"node {node!r} holds no task from edge {self.edge!r}")
        if update.base_version != task[0]:
            raise UpdateRejected(
                "bad_version", f"update trained from version {update.base_version}, the task was of {task[0]}"
            )
        update.sender = node  # the authenticated identity, not what the body claims
        acc = self.sums.get(task[0])
        if acc is None:
            acc = Accumulator(task[0], task[0], self.numel, self.weighting)
        acc.add_update(update)
        self.sums[task[0]] = acc
        del self.tasks[node]
        self.delivered.discard(node)
        self.pending.add(node)
        if self.first_at is None:
            self.first_at = now

    def drop(self, node: str, version: int) -> bool:
        """``node`` reports its task of ``version`` failed: closed (True), or it held no such task."""
        if self.tasks.get(node, (None,))[0] != version:
            return False
        del self.tasks[node]
        self.delivered.discard(node)
        return True

    def answered(self, part: Partial) -> bool:
        """The root answered ``part`` (or the edge gave up on it): its nodes may get new tasks; True
        when some of them are waiting for one."""
        self.pending -= part.senders
        back = self.held_back & part.senders
        self.held_back -= back
        self.want |= back
        return bool(back)

    def should_flush(self, now: float) -> bool:
        if not self.sums:
            return False
        assert self.first_at is not None
        return self.count >= self.size or now - self.first_at >= self.wait_s

    def flush(self) -> list[Partial]:
        """The buffered updates as one sealed partial per base version (oldest first); the buffer empties."""
        parts = [self.sums[v].partial().sealed(self.edge) for v in sorted(self.sums)]
        self.sums.clear()
        self.first_at = None
        return parts


class Retransmit:
    """When an edge (re)sends its partial: at once, then after ``first_s``, doubling up to
    ``max_s``, until the parent answers (accepted, or duplicate: both mean it is in) or refuses
    (a refusal is final: a stale or conflicting partial does not become acceptable by repeating),
    and never after ``give_up_at`` (the root's deadline: the round is over there)."""

    def __init__(self, now: float, give_up_at: float | None = None, first_s: float = 0.5, max_s: float = 8.0):
        self.next_at = now
        self.wait = first_s
        self.max_s = max_s
        self.give_up_at = give_up_at
        self.done = False
        self.attempts = 0

    def due(self, now: float) -> bool:
        if self.done or (self.give_up_at is not None and now > self.give_up_at):
            return False
        return now >= self.next_at

    def sent(self, now: float) -> None:
        """An attempt went out (its answer may never come)."""
        self.attempts += 1
        self.next_at = now + self.wait
        self.wait = min(self.wait * 2, self.max_s)

    def answered(self) -> None:
        """The parent answered (accepted, duplicate or refused): stop."""
        self.done = True
