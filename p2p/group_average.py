"""Group averaging (Moshpit-style all-reduce in small groups) as a protocol object (sans-I/O).

Moshpit SGD (Ryabinin et al. 2021, "Moshpit SGD: communication-efficient decentralized
training on heterogeneous unreliable devices") places the peers on a virtual
d-dimensional grid and, in round r, averages exactly within the groups of peers that
differ only in coordinate ``r mod d``: after d rounds on a full grid every peer holds the
global average, with each round costing about two models of traffic per peer, however
many peers there are. Here:

- :func:`grid_groups` lays the known peers out on a grid whose sides are about
  ``group_size`` (a full grid when ``n`` factors that way, e.g. 105 = 3 x 5 x 7), in an
  order drawn afresh every d rounds from a key of (seed, epoch, peer id), so every peer
  that knows the same peers computes the same groups without talking to anyone;
- :class:`GroupAverage` is one member's side of its group's all-reduce, bandwidth-optimal
  like a butterfly all-reduce: the model is cut into one slice per member; every member
  sends slice j of its model to member j (scatter-reduce), member j averages what arrived
  (weighted) and sends the averaged slice to every member (all-gather). Each member sends
  and receives about ``2 (k-1)/k`` models, whatever the group size k.

Members that vanish. Nothing waits past a deadline (``timeout`` per phase from the
member's start, ``now`` passed in): a reducer averages the parts that arrived by its
deadline (or as soon as every member not known gone has sent); a slice whose reducer
went silent is *repaired*: every member that lacks it sends its own part of that slice
to a backup, the first member after the silent reducer (in the group's order) that it
got a slice from, and the backup answers with the slice's average if it holds it, else
with the average of the parts it was sent plus its own. A slice neither reduced nor
repaired by the last deadline keeps the member's own values. So when members vanish
before they send, or after their part in a phase is done, every surviving member ends
with the same model: per slice, the weighted average of the parts that arrived. A
reducer that crashes while sending its averaged slice can leave the members it reached
with that average and the others with the repaired one (one slice differs; the next
round averages it away).

Transports (the simulator's virtual network, the peer's HTTPS) deliver the returned
:class:`SliceMessage` objects, call :meth:`GroupAverage.tick` at
:meth:`GroupAverage.next_deadline`, and report members they could not reach
(:meth:`GroupAverage.on_unreachable`: a refused connection proves a member gone at once).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

PHASES = ("part", "reduced", "repair", "repaired")


# --- who meets whom ------------------------------------------------------------------------


def grid_dims(n: int, group_size: int) -> tuple[int, ...]:
    """Sides of a virtual grid with at least ``n`` cells and sides near ``group_size``.

    d = round(log n / log group_size) axes; among the sides in [2, max(2 g, n^(1/d) + 1)]
    the fewest empty cells win (a full grid when n factors so), then the most even sides.
    """
    if n <= 2 or group_size >= n:
        return (max(n, 1),)
    d = max(1, round(math.log(n) / math.log(max(group_size, 2))))
    if d == 1:
        return (n,)
    hi = max(2 * group_size, math.ceil(n ** (1 / d)) + 1)
    best: tuple[int, float, tuple[int, ...]] | None = None
    for sides in itertools.combinations_with_replacement(range(2, hi + 1), d):
        p = math.prod(sides)
        if p < n:
            continue
        score = (p - n, sum(abs(math.log(s / group_size)) for s in sides), sides)
        if best is None or score < best:
            best = score
    assert best is not None
    return best[2]


def _order_key(seed: int, epoch: int, peer: str) -> bytes:
    return hashlib.blake2b(f"{seed}/{epoch}/{peer}".encode(), digest_size=16).digest()


def grid_groups(peers: Sequence[str], round_: int, group_size: int, seed: int = 0) -> list[tuple[str, ...]]:
    """The groups of round ``round_``: peers ordered by a key of (seed, epoch, id), laid out
    row-major on the grid of :func:`grid_dims`, grouped along axis ``round_ mod d``; each
    group in its slice order. Groups of one are returned too (they average nothing)."""
    ids = sorted(set(peers))
    if not ids:
        return []
    dims = grid_dims(len(ids), group_size)
    d = len(dims)
    axis, epoch = round_ % d, round_ // d
    order = sorted(ids, key=lambda p: _order_key(seed, epoch, p))
    strides = [math.prod(dims[a + 1:]) for a in range(d)]
    lines: dict[tuple[int, ...], list[tuple[int, str]]] = {}
    for cell, peer in enumerate(order):
        coords = [(cell // strides[a]) % dims[a] for a in range(d)]
        key = tuple(c for a, c in enumerate(coords) if a != axis)
        lines.setdefault(key, []).append((coords[axis], peer))
    return [tuple(p for _, p in sorted(members)) for _, members in sorted(lines.items())]


def group_of(peers: Sequence[str], me: str, round_: int, group_size: int, seed: int = 0) -> tuple[str, ...]:
    """``me``'s group in round ``round_`` (``me`` is counted among ``peers``)."""
    for g in grid_groups([*peers, me], round_, group_size, seed):
        if me in g:
            return g
    raise AssertionError("unreachable: every peer is in one group")


def group_id(round_: int, members: Sequence[str]) -> str:
    """Names one group's exchange: members that disagree on the group never mix parts."""
    text = "\n".join([str(round_), *members])
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def slice_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of the k slices: as equal as possible, in order."""
    return [(j * numel // k, (j + 1) * numel // k) for j in range(k)]


# --- one group's all-reduce ------------------------------------------------------------------


@dataclass(frozen=True)
class SliceMessage:
    """A slice on its way: a member's ``part`` to the slice's reducer, the reducer's
    ``reduced`` average to a member, a ``repair`` part to a backup, a backup's ``repaired``
    answer. ``weight`` is the sender's weight (part, repair) or the summed weight of the
    average (reduced, repaired), ``count`` how many members' parts are in it."""

    sender: str
    target: str
    round: int
    group: str
    members: tuple[str, ...]
    slice: int
    phase: str
    weight: float
    data: torch.Tensor
    count: int = 1        # parts in the average (reduced, repaired); 1 for a member's own part


class Refusal(ValueError):
    """A message this member will not take (another group, a bad slice); ``code`` says why."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code


@dataclass
class GroupResult:
    values: torch.Tensor          # the member's new model
    weight: float                 # summed weight behind it (per slice, averaged by slice length)
    complete: bool                # every member's part is in every slice
    missing: list[str]            # members found gone, or whose part did not reach our own slice
    repaired: int                 # slices whose reducer was silent, filled by a backup
    kept: int                     # slices left at the member's own values
    late: int                     # messages that came after their phase closed


@dataclass
class _Reduction:
    parts: dict[str, tuple[float, torch.Tensor]] = field(default_factory=dict)
    closed: bool = False


# a finished slice: (average, summed weight, parts in it)
_Slice = tuple[torch.Tensor, float, int]


def _average(parts: dict[str, tuple[float, torch.Tensor]]) -> _Slice:
    """The weighted mean in float64 over the parts in member order (the same on every member)."""
    total = 0.0
    acc = None
    for key in sorted(parts):
        w, x = parts[key]
        total += w
        term = x.double() * w
        acc = term if acc is None else acc.add_(term)
    assert acc is not None and total > 0
    return (acc / total).float(), float(total), len(parts)


class GroupAverage:
    """One member's side of its group's all-reduce (module docstring)."""

    def __init__(self, me: str, members: Sequence[str], round_: int, values: torch.Tensor, weight: float,
                 now: float, timeout: float):
        members = tuple(members)
        if me not in members or len(set(members)) != len(members) or len(members) < 2:
            raise ValueError("a group has >= 2 distinct members, this member among them")
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"weight {weight!r} must be finite and > 0")
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self.me, self.members, self.round = me, members, int(round_)
        self.k = len(members)
        self.index = members.index(me)
        self.group = group_id(self.round, members)
        self.own = values.detach().float().clone()
        self.weight = float(weight)
        self.bounds = slice_bounds(self.own.numel(), self.k)
        self.t0, self.timeout = float(now), float(timeout)
        self.gone: set[str] = set()
        self._mine = _Reduction({me: (self.weight, self._slice(self.own, self.index))})
        self._slices: dict[int, _Slice] = {}                  # finished slices
        self._contributed: set[str] = set()                   # whose parts are in our own slice
        self._repairs: dict[int, _Reduction] = {}             # orphaned slices: the parts we got of each
        self._answered: dict[int, set[str]] = {}              # members who answered our repair part, per slice
        self._gathered = False
        self._repaired = 0
        self._late = 0
        self.started = False
        self.done = False

    # --- helpers ---------------------------------------------------------------------------

    def _slice(self, x: torch.Tensor, j: int) -> torch.Tensor:
        lo, hi = self.bounds[j]
        return x[lo:hi]

    def _msg(self, target: str, j: int, phase: str, weight: float, data: torch.Tensor, count: int = 1) -> SliceMessage:
        return SliceMessage(self.me, target, self.round, self.group, self.members, j, phase, float(weight),
                            data.detach().clone(), int(count))

    def _live_others(self) -> list[str]:
        return [m for m in self.members if m != self.me and m not in self.gone]

    def _answer(self, target: str, j: int) -> SliceMessage:
        avg, w, c = self._slices[j]
        return self._msg(target, j, "repaired", w, avg, c)

    @property
    def deadlines(self) -> tuple[float, float, float]:
        """(reduce, gather, repair): the phases' deadlines from this member's start."""
        t, s = self.t0, self.timeout
        return t + s, t + 2 * s, t + 3 * s

    def next_deadline(self) -> float | None:
        if self.done:
            return None
        reduce_at, gather_at, repair_at = self.deadlines
        if not self._mine.closed:
            return reduce_at
        return gather_at if not self._gathered else repair_at

    # --- the protocol ------------------------------------------------------------------------

    def start(self) -> list[SliceMessage]:
        """Send slice j of our model to member j; keep our own slice for our reduction."""
        self.started = True
        out = [self._msg(m, j, "part", self.weight, self._slice(self.own, j))
               for j, m in enumerate(self.members) if m != self.me]
        return out + self._progress(self.t0)

    def check(self, msg: SliceMessage) -> None:
        """Raise :class:`Refusal` unless ``msg`` belongs to this exchange and is well formed."""
        if msg.round != self.round or msg.group != self.group or tuple(msg.members) != self.members:
            raise Refusal("not_in_group", f"{self.me} is in group {self.group} of round {self.round} "
                          f"({len(self.members)} members), not {msg.group} of round {msg.round}")
        if msg.sender not in self.members or msg.sender == self.me or msg.target != self.me:
            raise Refusal("malformed", f"sender {msg.sender!r} / target {msg.target!r} do not fit the group")
        if msg.phase not in PHASES:
            raise Refusal("malformed", f"phase {msg.phase!r} is not one of {PHASES}")
        if not 0 <= msg.slice < self.k:
            raise Refusal("malformed", f"slice {msg.slice} is not in [0, {self.k})")
        lo, hi = self.bounds[msg.slice]
        if tuple(msg.data.shape) != (hi - lo,):
            raise Refusal("malformed", f"slice {msg.slice} has {hi - lo} values, got shape {list(msg.data.shape)}")
        if not (msg.weight > 0 and math.isfinite(msg.weight)):
            raise Refusal("malformed", f"weight {msg.weight!r} must be finite and > 0")
        if not 1 <= msg.count <= self.k:
            raise Refusal("malformed", f"count {msg.count!r} is not in [1, {self.k}]")
        if msg.phase == "part" and msg.slice != self.index:
            raise Refusal("malformed", f"a part of slice {msg.slice} sent to the reducer of slice {self.index}")
        if msg.phase == "reduced" and msg.slice != self.members.index(msg.sender):
            raise Refusal("malformed", f"reduced slice {msg.slice} from a member that does not reduce it")

    def on_message(self, msg: SliceMessage, now: float) -> list[SliceMessage]:
        """Take one message (checked first: raises :class:`Refusal`); returns what to send."""
        self.check(msg)
        j, data = msg.slice, msg.data.detach().float()
        if msg.phase == "repair" and j in self._slices:  # we hold it (even when done): answer with it
            return [self._answer(msg.sender, j)]
        if self.done:
            self._late += 1
            return []
        out: list[SliceMessage] = []
        if msg.phase == "part":
            if self._mine.closed:
                self._late += 1
            else:
                self._mine.parts.setdefault(msg.sender, (msg.weight, data))
        elif msg.phase == "reduced":
            if j not in self._slices:
                out += self._finish_slice(j, (data, msg.weight, msg.count))
        elif msg.phase == "repair":
            self._repairs.setdefault(j, _Reduction()).parts.setdefault(msg.sender, (msg.weight, data))
            self._answered.setdefault(j, set()).add(msg.sender)
        else:  # repaired: someone holds the slice's average; adopt it
            if j not in self._slices:
                self._repaired += 1
                out += self._finish_slice(j, (data, msg.weight, msg.count))
        return out + self._progress(now)

    def _finish_slice(self, j: int, value: _Slice) -> list[SliceMessage]:
        """Keep slice j; members that asked us for it while we lacked it get it now."""
        self._slices[j] = value
        rep = self._repairs.get(j)
        if rep is None:
            return []
        rep.closed = True
        return [self._answer(m, j) for m in rep.parts if m != self.me]

    def on_unreachable(self, peer: str, now: float) -> list[SliceMessage]:
        """The transport could not reach ``peer`` (refused connection, error answer): gone."""
        if peer in self.members and peer != self.me and not self.done:
            self.gone.add(peer)
            return self._progress(now)
        return []

    def tick(self, now: float) -> list[SliceMessage]:
        """Close whatever phase is past its deadline; returns what to send."""
        return self._progress(now)

    def _progress(self, now: float) -> list[SliceMessage]:
        if self.done or not self.started:
            return []
        out: list[SliceMessage] = []
        reduce_at, gather_at, repair_at = self.deadlines
        # 1. our reduction: all parts in (or every missing sender gone), or the deadline
        if not self._mine.closed:
            waiting = [m for m in self._live_others() if m not in self._mine.parts]
            if not waiting or now >= reduce_at:
                self._mine.closed = True
                avg, w, c = _average(self._mine.parts)
                self._contributed = set(self._mine.parts)
                out += self._finish_slice(self.index, (avg, w, c))
                out += [self._msg(m, self.index, "reduced", w, avg, c) for m in self._live_others()]
        # 2. the gather: every slice whose reducer is not gone, or the deadline; then the
        #    orphaned slices are averaged again: our part of each goes to every other member
        if self._mine.closed and not self._gathered:
            waiting = [j for j, m in enumerate(self.members) if j not in self._slices and m not in self.gone]
            if not waiting or now >= gather_at:
                self._gathered = True
                for j in range(self.k):
                    if j in self._slices:
                        continue
                    rep = self._repairs.setdefault(j, _Reduction())
                    rep.parts[self.me] = (self.weight, self._slice(self.own, j))
                    out += [self._msg(m, j, "repair", self.weight, self._slice(self.own, j))
                            for m in self._live_others() if m != self.members[j]]
        # 3. each orphaned slice: every live member answered (its part, or the average it holds),
        #    or the deadline: the average of the parts we got, ours included
        if self._gathered:
            for j, rep in self._repairs.items():
                if rep.closed or j in self._slices:
                    continue
                expect = [m for m in self._live_others() if m != self.members[j]]
                if now >= repair_at or all(m in self._answered.get(j, ()) for m in expect):
                    rep.closed = True
                    self._slices[j] = _average(rep.parts)
                    self._repaired += 1
        # 4. done: every slice in, or the last deadline
        if len(self._slices) == self.k or now >= repair_at:
            self.done = True
        return out

    def result(self) -> GroupResult:
        """The new model: finished slices averaged, the rest our own values."""
        values = self.own.clone()
        wsum = 0.0
        kept = 0
        for j, (lo, hi) in enumerate(self.bounds):
            if j in self._slices:
                avg, w, _ = self._slices[j]
                values[lo:hi] = avg
            else:
                w = self.weight
                kept += 1
            wsum += w * (hi - lo)
        complete = kept == 0 and self._repaired == 0 and all(c == self.k for _, _, c in self._slices.values())
        missing = sorted(m for m in self.members if m in self.gone or (self._mine.closed and m not in self._contributed))
        return GroupResult(values, wsum / max(self.own.numel(), 1), complete, missing, self._repaired, kept,
                           self._late)
