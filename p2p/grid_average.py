"""Group averaging across several grid axes in one exchange (sans-I/O).

:func:`grid_path` gives a member its groups along the axes of one exchange, and
:class:`GridAverage` chains one :class:`~shoal.p2p.group_average.GroupAverage` per axis into a
hierarchical all-reduce (see its docstring). The single-group protocol, the grid layout and the
slice messages are in p2p/group_average.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .group_average import (
    GroupAverage,
    GroupResult,
    ReducedSlice,
    Refusal,
    SliceMessage,
    grid_dims,
    grid_groups,
    group_id,
)
from .merge import MergeBound

# --- several axes in one exchange --------------------------------------------------------------


def grid_path(
    peers: Sequence[str], me: str, step: int, group_size: int, levels: int, seed: int = 0
) -> list[tuple[str, ...]]:
    """``me``'s groups for one exchange of ``levels`` axes (0: every axis of the grid): the
    group along axis ``step mod d``, then along the next axis, and so on (layout of epoch
    ``step // d``, the same for every level). Only a full grid chains axes (its lines along
    an axis all have the same length, so they cut the model into the same slices)."""
    everyone = sorted(set(peers) | {me})
    dims = grid_dims(len(everyone), group_size)
    d = len(dims)
    levels = d if levels <= 0 else min(levels, d)
    if math.prod(dims) != len(everyone):
        levels = 1  # lines of unequal length slice the model differently: one axis per exchange
    base = (step // d) * d
    path = []
    for lv in range(levels):
        axis = (step + lv) % d
        for g in grid_groups(everyone, base + axis, group_size, seed):
            if me in g:
                path.append(g)
                break
    return path


class GridAverage:
    """An all-reduce across several grid axes in one exchange, still only in small groups.

    Level 0 scatter-reduces the model in our group along the first axis; the slice we reduce
    (averaged over our line) goes on, as the whole vector, to our group along the next axis,
    which scatter-reduces it again; and so on. The last level averages its (smallest) vector
    within its group; then each level all-gathers what the level below made of its slice,
    back up to the whole model. On a full grid with every axis that is the exact global
    (weighted) average, for about ``2 (1 - 1/n)`` models sent per member (a hierarchical,
    bandwidth-optimal all-reduce, n the peers), where a group average along one axis per
    exchange costs about ``2 (1 - 1/k)`` models and needs d exchanges for the same.

    Members that vanish: each level is a :class:`GroupAverage` and averages what arrived; a
    slice whose reducer vanished is averaged again within its group at that level only, so
    survivors in different groups can then differ on it (the next exchange, along other axes,
    averages that away). Nothing waits past the levels' deadlines: a level waits for the ones
    below it at most ``3 timeout`` each beyond its own.
    """

    def __init__(
        self,
        me: str,
        path: Sequence[Sequence[str]],
        round_: int,
        values: torch.Tensor,
        weight: float,
        now: float,
        timeout: float,
        bound: MergeBound | None = None,
    ):
        self.me, self.round, self.timeout = me, int(round_), float(timeout)
        self.bound = bound  # the member's merge bound: each level clips the parts it reduces
        self.path = [tuple(g) for g in path]
        if not self.path or any(me not in g for g in self.path):
            raise ValueError("every group of the path holds this member")
        if len(self.path[0]) < 2 and len(self.path) == 1:
            raise ValueError("a group has >= 2 distinct members")
        self.values, self.weight, self.t0 = values.detach().float().clone(), float(weight), float(now)
        self.levels: list[GroupAverage | None] = [None] * len(self.path)
        self._skipped: dict[int, ReducedSlice] = {}  # levels whose group is only us: the value passes through
        self._early: list[SliceMessage] = []  # messages for a level we have not reached yet
        self.groups = {group_id(self.round, g, lv): lv for lv, g in enumerate(self.path)}
        self.started = False

    @property
    def done(self) -> bool:
        top = self._top()
        return top is not None and top.done

    def _top(self) -> GroupAverage | None:
        return next((lv for lv in self.levels if lv is not None), None)

    def _open(self, lv: int, values: torch.Tensor, weight: float, now: float) -> list[SliceMessage]:
        """Start level ``lv`` on ``values``; skip down through levels where we are alone."""
        while lv < len(self.path) and len(self.path[lv]) < 2:
            self._skipped[lv] = (values, weight, 1)
            lv += 1
        if lv >= len(self.path):
            return []
        last = lv == len(self.path) - 1
        below = sum(1 for g in self.path[lv + 1 :] if len(g) >= 2)
        ga = GroupAverage(
            self.me,
            self.path[lv],
            self.round,
            values,
            weight,
            now,
            self.timeout,
            level=lv,
            hold=not last,
            patience=3 * self.timeout * below,
            bound=self.bound,
        )
        self.levels[lv] = ga
        out = ga.start()
        early, self._early = [m for m in self._early if m.level == lv], [m for m in self._early if m.level != lv]
        for m in early:
            try:
                out += ga.on_message(m, now)
            except Refusal:
                pass
        return out

    def start(self) -> list[SliceMessage]:
        self.started = True
        out = self._open(0, self.values, self.weight, self.t0)
        return out + self._advance(self.t0)

    def _advance(self, now: float) -> list[SliceMessage]:
        """Hand each level's held slice down, and the level below's result back up."""
        out: list[SliceMessage] = []
        changed = True
        while changed:
            changed = False
            for lv, ga in enumerate(self.levels):
                if ga is None or ga.held is None:
                    continue
                nxt = next((i for i in range(lv + 1, len(self.path)) if len(self.path[i]) >= 2), None)
                if nxt is not None and self.levels[nxt] is None:
                    avg, w, _ = ga.held
                    out += self._open(lv + 1, avg, w, now)
                    changed = True
                below = self.levels[nxt] if nxt is not None else None
                if nxt is None or (below is not None and below.done):
                    if below is None:
                        avg, w, _ = ga.held
                    else:
                        res = below.result()
                        avg, w = res.values, res.weight
                    out += ga.release(avg, w, now)
                    changed = True
        return out

    def check(self, msg: SliceMessage) -> None:
        lv = self.groups.get(msg.group)
        if lv is None or msg.level != lv or msg.round != self.round or tuple(msg.members) != self.path[lv]:
            raise Refusal(
                "not_in_group", f"{self.me} has no group {msg.group} at level {msg.level} of round {msg.round}"
            )
        ga = self.levels[lv]
        if ga is not None:
            ga.check(msg)

    def on_message(self, msg: SliceMessage, now: float) -> list[SliceMessage]:
        self.check(msg)
        ga = self.levels[msg.level]
        if ga is None:
            if len(self._early) < 4 * sum(len(g) for g in self.path):
                self._early.append(msg)
            return []
        return ga.on_message(msg, now) + self._advance(now)

    def on_unreachable(self, peer: str, now: float) -> list[SliceMessage]:
        out: list[SliceMessage] = []
        for ga in self.levels:
            if ga is not None:
                out += ga.on_unreachable(peer, now)
        return out + self._advance(now)

    def tick(self, now: float) -> list[SliceMessage]:
        out: list[SliceMessage] = []
        for ga in self.levels:
            if ga is not None:
                out += ga.tick(now)
        return out + self._advance(now)

    def next_deadline(self) -> float | None:
        times = [t for ga in self.levels if ga is not None and (t := ga.next_deadline()) is not None]
        return min(times) if times else None

    def result(self) -> GroupResult:
        top = self._top()
        if top is None:  # alone at every level
            return GroupResult(self.values.clone(), self.weight, True, [], 0, 0, 0)
        res = top.result()
        inner = [ga.result() for ga in self.levels if ga is not None and ga is not top]
        return GroupResult(
            res.values,
            res.weight,
            res.complete and all(r.complete for r in inner),
            sorted(set(res.missing).union(*(r.missing for r in inner))),
            res.repaired + sum(r.repaired for r in inner),
            res.kept + sum(r.kept for r in inner),
            res.late + sum(r.late for r in inner),
        )
