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
went silent is averaged again among the survivors: every member that lacks it sends its
own part of the slice to every other member; a member that holds the slice's average
answers with it (and the asker adopts it), otherwise each averages the parts it got, its
own included, by the last deadline. So every surviving member ends with the same model,
per slice the weighted average of the parts that arrived, whether members vanish before
they send, between phases, or while a reducer sends its average to some members only
(those that got it answer the others). Survivors can still differ when messages among
*them* are lost or late past the deadlines (the next round averages that away). A slice
that nothing filled keeps the member's own values.

Transports (the simulator's virtual network, the peer's HTTPS) deliver the returned
:class:`SliceMessage` objects, call :meth:`GroupAverage.tick` at
:meth:`GroupAverage.next_deadline`, and report members they could not reach
(:meth:`GroupAverage.on_unreachable`: a refused connection proves a member gone at once).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .merge import MergeBound

PHASES = ("part", "reduced", "repair", "repaired", "forward")


# --- who meets whom ------------------------------------------------------------------------


def grid_dims(n: int, group_size: int) -> tuple[int, ...]:
    """Sides of a virtual grid with at least ``n`` cells and sides near ``group_size``.

    d0 = round(log n / log group_size) axes. A full grid (n = the product of the sides) with
    sides in [2, 3 group_size] is preferred, with d0 axes, else d0 + 1, else d0 - 1 (the sides
    nearest ``group_size`` win); failing that, the d0-axis grid with the fewest empty cells.
    """
    if n <= 2 or group_size >= n:
        return (max(n, 1),)
    g = max(group_size, 2)
    d0 = max(1, round(math.log(n) / math.log(g)))

    def score(sides: tuple[int, ...]) -> tuple[int, float, tuple[int, ...]]:
        return (math.prod(sides) - n, sum(abs(math.log(x / g)) for x in sides), sides)

    for d in (d0, d0 + 1, d0 - 1):
        if d == 1 and n <= 3 * g:
            return (n,)
        full = [c for c in itertools.combinations_with_replacement(range(2, 3 * g + 1), d) if math.prod(c) == n]
        if d >= 2 and full:
            return min(full, key=score)
    if d0 == 1:
        return (n,)
    hi = max(2 * g, math.ceil(n ** (1 / d0)) + 1)
    cands = (c for c in itertools.combinations_with_replacement(range(2, hi + 1), d0) if math.prod(c) >= n)
    return min(cands, key=score)


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
    strides = [math.prod(dims[a + 1 :]) for a in range(d)]
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


def group_id(round_: int, members: Sequence[str], level: int = 0) -> str:
    """Names one group's exchange: members that disagree on the group never mix parts."""
    text = "\n".join([f"{round_}/{level}", *members])
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def slice_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of the k slices: as equal as possible, in order."""
    return [(j * numel // k, (j + 1) * numel // k) for j in range(k)]


# --- one group's all-reduce ------------------------------------------------------------------


@dataclass(frozen=True)
class SliceMessage:
    """A slice on its way: a member's ``part`` to the slice's reducer, the reducer's
    ``reduced`` average to a member, a member's own ``repair`` part of a slice whose reducer
    went silent, an answer to it with the reducer's average passed on (``forward``) or the
    average of repair parts (``repaired``). ``weight`` is the sender's weight (part, repair) or the summed weight of the
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
    count: int = 1  # parts in the average (reduced, repaired); 1 for a member's own part
    level: int = 0  # which axis of a multi-level exchange (GridAverage); 0 for one group


class Refusal(ValueError):
    """A message this member will not take (another group, a bad slice); ``code`` says why."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code


@dataclass
class GroupResult:
    values: torch.Tensor  # the member's new model
    weight: float  # summed weight behind it (per slice, averaged by slice length)
    complete: bool  # every member's part is in every slice
    missing: list[str]  # members found gone, or whose part did not reach our own slice
    repaired: int  # slices whose reducer was silent, filled by a backup
    kept: int  # slices left at the member's own values
    late: int  # messages that came after their phase closed


@dataclass
class _Reduction:
    parts: dict[str, tuple[float, torch.Tensor]] = field(default_factory=dict)
    closed: bool = False


# a finished slice: (average, summed weight, parts in it)
ReducedSlice = tuple[torch.Tensor, float, int]


def _average(parts: dict[str, tuple[float, torch.Tensor]]) -> ReducedSlice:
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

    def __init__(
        self,
        me: str,
        members: Sequence[str],
        round_: int,
        values: torch.Tensor,
        weight: float,
        now: float,
        timeout: float,
        level: int = 0,
        hold: bool = False,
        patience: float = 0.0,
        bound: MergeBound | None = None,
    ):
        """``hold``: once our slice is reduced, wait for :meth:`release` (the slice averaged
        further, by the next level of a :class:`GridAverage`) before sending it; ``patience``:
        how much longer than ``timeout`` to wait for the others' slices (their next levels);
        ``bound``: the member's merge bound, for self-centered clipping of the parts it reduces."""
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
        self.level, self.hold, self.patience = int(level), bool(hold), float(patience)
        self.group = group_id(self.round, members, self.level)
        self.own = values.detach().float().clone()
        self.weight = float(weight)
        self.bounds = slice_bounds(self.own.numel(), self.k)
        self.t0, self.timeout = float(now), float(timeout)
        self.gone: set[str] = set()
        self._mine = _Reduction({me: (self.weight, self._slice(self.own, self.index))})
        self._slices: dict[int, ReducedSlice] = {}  # finished slices
        self._contributed: set[str] = set()  # whose parts are in our own slice
        self._repairs: dict[int, _Reduction] = {}  # orphaned slices: the parts we got of each
        self._answered: dict[int, set[str]] = {}  # members who answered our repair part, per slice
        self._final: set[int] = set()  # slices holding their reducer's average
        self._asked: dict[int, set[str]] = {}  # whom we sent our repair part of a slice
        self._gathered = False
        self._held: ReducedSlice | None = None  # our reduction, waiting for release()
        self._sent_at: float | None = None  # when our reduced slice went out
        self._gathered_at = 0.0
        self._repaired = 0
        self._late = 0
        self.started = False
        self.done = False
        self.bound = bound
        self.clipped = 0  # parts of our slice clipped to the merge radius

    # --- helpers ---------------------------------------------------------------------------

    def _clip(self, parts: dict[str, tuple[float, torch.Tensor]]) -> dict[str, tuple[float, torch.Tensor]]:
        """Self-centered clipping of the parts of our slice (He, Karimireddy and Jaggi 2022) before
        we reduce it: each member's distance on the slice, scaled to the whole model, takes its
        slot of our merge bound's window; then each ``part - ours`` is clipped to the radius
        ``tau`` (so one member moves each slice's average by at most ``tau / k``: the whole
        model by at most ``tau / sqrt(k)``, and the member's adopt bounds the rest), and a part
        beyond ``far x tau`` is replaced by our own values (its weight stays, its pull is gone)."""
        if self.bound is None:
            return parts
        own = self._slice(self.own, self.index)
        share = math.sqrt(max(own.numel(), 1) / max(self.own.numel(), 1))
        dists = {m: float(torch.linalg.vector_norm((x - own).double())) for m, (_, x) in parts.items() if m != self.me}
        for m, d in sorted(dists.items()):
            self.bound.observe(m, d / share if share > 0 else d, 0.0)  # voting by the limit the slices get
        radius = self.bound.radius() * share
        out = dict(parts)
        for m, d in dists.items():
            # far x the radius alone, not our travel: exact averages leave the members within a
            # step of each other, and a slice's travel let forged parts and averages through
            factor = self.bound.shrink(d, radius, 0.0)
            if factor is not None and factor == 1.0:
                continue
            w, x = parts[m]  # refused (far beyond the radius): its weight stays with our own values
            out[m] = (w, own.clone() if factor is None else own + (x - own) * factor)
            self.clipped += 1
        return out

    def _bounded(self, j: int, data: torch.Tensor) -> torch.Tensor:
        """Another member's average of slice j (``reduced``, ``forward``, ``repaired``), bounded
        around our own values of that slice before we take it: a hostile reducer sends whatever
        it likes for its slice, so its ``average - ours`` is clipped like a neighbour's model, to
        the merge bound's radius scaled to the slice's share of the model (self-centered clipping
        of the reducer's output, not only of the parts we reduce); beyond ``far x`` that radius
        our own values of the slice are kept. An honest average lies within the honest spread
        and passes unchanged."""
        if self.bound is None:
            return data
        own = self._slice(self.own, j)
        radius = self.bound.radius() * math.sqrt(max(own.numel(), 1) / max(self.own.numel(), 1))
        d = float(torch.linalg.vector_norm((data - own).double()))
        factor = self.bound.shrink(d, radius, 0.0)  # a slice: far x its radius alone, as in _clip
        if factor is not None and factor == 1.0:
            return data
        self.clipped += 1
        return own.clone() if factor is None else own + (data - own) * factor

    def _slice(self, x: torch.Tensor, j: int) -> torch.Tensor:
        lo, hi = self.bounds[j]
        return x[lo:hi]

    def _msg(self, target: str, j: int, phase: str, weight: float, data: torch.Tensor, count: int = 1) -> SliceMessage:
        return SliceMessage(
            self.me,
            target,
            self.round,
            self.group,
            self.members,
            j,
            phase,
            float(weight),
            data.detach().clone(),
            int(count),
            self.level,
        )

    def _live_others(self) -> list[str]:
        return [m for m in self.members if m != self.me and m not in self.gone]

    def _answer(self, target: str, j: int) -> SliceMessage:
        avg, w, c = self._slices[j]
        return self._msg(target, j, "forward" if j in self._final else "repaired", w, avg, c)

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must be called next: our reduction closes ``timeout`` after the
        start; the gather waits ``timeout`` (+ ``patience``) after our slice went out (and 2
        ``timeout`` after the start); orphaned slices wait ``timeout`` past the gather's
        deadline. None when done or holding."""
        if self.done:
            return None
        if not self._mine.closed:
            return self.t0 + self.timeout
        if self._sent_at is None:
            return None  # holding: released by the next level, whose own deadlines bound it
        gather_at = max(self.t0 + 2 * self.timeout, self._sent_at + self.timeout + self.patience)
        if not self._gathered:
            return gather_at
        # the others gather by their deadlines (about ours) at the latest: wait for their parts
        return max(gather_at, self._gathered_at) + self.timeout

    @property
    def held(self) -> ReducedSlice | None:
        """Our reduced slice while it waits for :meth:`release` (None otherwise)."""
        return self._held if self._sent_at is None else None

    def release(self, values: torch.Tensor, weight: float, now: float) -> list[SliceMessage]:
        """Send our reduced slice as ``values`` (what the next level made of it)."""
        if self._held is None or self._sent_at is not None:
            raise RuntimeError("release() comes once, after our slice is reduced with hold=True")
        _, _, c = self._held
        return self._send_reduced((values.detach().float(), float(weight), c), now) + self._progress(now)

    def _send_reduced(self, value: ReducedSlice, now: float) -> list[SliceMessage]:
        self._sent_at = now
        avg, w, c = value
        out = self._finish_slice(self.index, value, final=True)
        told = {m.target for m in out}
        return out + [self._msg(m, self.index, "reduced", w, avg, c) for m in self._live_others() if m not in told]

    # --- the protocol ------------------------------------------------------------------------

    def start(self) -> list[SliceMessage]:
        """Send slice j of our model to member j; keep our own slice for our reduction."""
        self.started = True
        out = [
            self._msg(m, j, "part", self.weight, self._slice(self.own, j))
            for j, m in enumerate(self.members)
            if m != self.me
        ]
        return out + self._progress(self.t0)

    def check(self, msg: SliceMessage) -> None:
        """Raise :class:`Refusal` unless ``msg`` belongs to this exchange and is well formed."""
        if (
            msg.round != self.round
            or msg.group != self.group
            or tuple(msg.members) != self.members
            or msg.level != self.level
        ):
            raise Refusal(
                "not_in_group",
                f"{self.me} is in group {self.group} of round {self.round} "
                f"({len(self.members)} members), not {msg.group} of round {msg.round}",
            )
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
        """Take one message (checked first: raises :class:`Refusal`); returns what to send.

        A reducer's average (``reduced``, ``forward``) replaces a slice averaged from repair
        parts, even after we are done: the transport reads the result once the exchange is
        over, and then every survivor holds it (members that got it answer everyone who
        sent them a repair part, and everyone they sent theirs to)."""
        self.check(msg)
        j, data = msg.slice, msg.data.detach().float()
        if msg.phase in ("reduced", "forward", "repaired"):
            data = self._bounded(j, data)
        value = (data, msg.weight, msg.count)
        if msg.phase == "repair":
            self._answered.setdefault(j, set()).add(msg.sender)
            if j in self._slices:  # we hold it (even when done): answer with it
                return [self._answer(msg.sender, j)]
        if msg.phase in ("reduced", "forward") and j not in self._final and (self.done or j in self._slices):
            return self._finish_slice(j, value, final=True)  # a late reducer's average wins
        if self.done:
            self._late += 1
            return []
        out: list[SliceMessage] = []
        if msg.phase == "part":
            if self._mine.closed:
                self._late += 1
            else:
                self._mine.parts.setdefault(msg.sender, (msg.weight, data))
        elif msg.phase in ("reduced", "forward"):
            if j not in self._slices:
                self._repaired += msg.phase == "forward"
                out += self._finish_slice(j, value, final=True)
        elif msg.phase == "repair":
            self._repairs.setdefault(j, _Reduction()).parts.setdefault(msg.sender, (msg.weight, data))
        else:  # repaired: someone averaged the slice's repair parts; adopt it
            if j not in self._slices:
                self._repaired += 1
                out += self._finish_slice(j, value, final=False)
        return out + self._progress(now)

    def _finish_slice(self, j: int, value: ReducedSlice, final: bool) -> list[SliceMessage]:
        """Keep slice j; members that sent us their repair part of it, and those we sent ours
        to, get it now when it is the reducer's average (or when they asked us while we lacked it)."""
        self._slices[j] = value
        if final:
            self._final.add(j)
        rep = self._repairs.get(j)
        if rep is not None:
            rep.closed = True
        told = {m for m in (rep.parts if rep else ()) if m != self.me}
        if final:
            told |= self._asked.get(j, set())
        return [self._answer(m, j) for m in sorted(told) if m not in self.gone]

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
        # 1. our reduction: all parts in (or every missing sender gone), or the deadline
        if not self._mine.closed:
            waiting = [m for m in self._live_others() if m not in self._mine.parts]
            if not waiting or now >= self.t0 + self.timeout:
                self._mine.closed = True
                self._contributed = set(self._mine.parts)
                self._held = _average(self._clip(self._mine.parts))
                if not self.hold:
                    out += self._send_reduced(self._held, now)
        if self._sent_at is None:
            return out  # holding our slice for the next level
        # 2. the gather: every slice whose reducer is not gone, or the deadline; then the
        #    orphaned slices are averaged again: our part of each goes to every other member
        if not self._gathered:
            missing = [j for j, m in enumerate(self.members) if j not in self._slices and m not in self.gone]
            deadline = self.next_deadline()
            if not missing or (deadline is not None and now >= deadline):
                self._gathered, self._gathered_at = True, now
                for j in range(self.k):
                    if j in self._slices:
                        continue
                    rep = self._repairs.setdefault(j, _Reduction())
                    rep.parts[self.me] = (self.weight, self._slice(self.own, j))
                    targets = [m for m in self._live_others() if m != self.members[j]]
                    self._asked[j] = set(targets)
                    out += [self._msg(m, j, "repair", self.weight, self._slice(self.own, j)) for m in targets]
        # 3. each orphaned slice: every live member answered (its part, or the average it holds),
        #    or the deadline: the average of the parts we got, ours included
        if self._gathered:
            repair_at = self.next_deadline()
            assert repair_at is not None
            for j, rep in self._repairs.items():
                if rep.closed or j in self._slices:
                    continue
                expect = [m for m in self._live_others() if m != self.members[j]]
                if now >= repair_at or all(m in self._answered.get(j, ()) for m in expect):
                    rep.closed = True
                    self._slices[j] = _average(rep.parts)
                    self._repaired += 1
            # 4. done: every slice in (repairs closed at their deadline at the latest)
            if len(self._slices) == self.k:
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
        missing = sorted(
            m for m in self.members if m in self.gone or (self._mine.closed and m not in self._contributed)
        )
        return GroupResult(values, wsum / max(self.own.numel(), 1), complete, missing, self._repaired, kept, self._late)
