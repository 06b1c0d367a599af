"""Partial aggregates: what an aggregator sends up a tree of aggregators, and their one merge.

An edge aggregator looks to its parent like a node whose weight is the sum of its nodes'
weights, and to its nodes like a server. What it sends up is a :class:`Partial`: the round
and global version the updates were trained from, the weighted sum ``sum_k w_k delta_k``
(float64, or a masked integer sum mod 2^b under secure aggregation), the total weight
``sum_k w_k``, the nodes inside it, the aggregators it came through, example and loss
counts, its staleness and the distributed-DP noise shares it holds.

:func:`merge` adds two partials. It is associative and commutative (sums and set unions;
float64 sums change only in the last bits with the order), so the same code runs at any
depth of a tree and between gossip peers, and any tree shape gives the flat sum. Nobody
divides but the root: a mean of means weighs groups wrongly when they differ in size, the
mistake this message exists to avoid. A node may be inside at most one of two merged
partials: counting an update twice is refused, never resolved by guessing.

:class:`PartialInbox` is the receiving side of one round, without I/O: partials from the
children arrive in any order and any number of times (retransmits), a repeat of one already
merged is idempotent (counted once), a different partial from the same child is a conflict,
one from another round or version is refused or, with ``stale="weight"``, discounted by
``s(t)`` (t = versions behind, aggregation/staleness.py), up to ``max_staleness``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from shoal.errors import Malformed, UpdateRejected
from shoal.update import PartialSum, Update

Stale = Literal["refuse", "weight"]


@dataclass(frozen=True)
class Partial:
    """A sum of updates of one round, with everything the next tier needs to merge it.

    ``weighted_sum``: float64 ``sum_k w_k delta_k`` (``modulus_bits == 0``), or an int64
    vector of a masked sum in ``[0, 2^modulus_bits)`` (secure aggregation: only the root,
    which removes the masks, can read it). ``senders``: the nodes whose updates are inside,
    each once. ``edges``: every aggregator whose sum is inside (the path up the tree, as a set:
    merging forgets the order, so any tree shape gives one answer). ``origin``: the aggregator
    that sent this partial (its parent deduplicates retransmits by it). ``staleness``: the
    largest number of versions an update inside was behind when merged (its weight already
    discounted). ``noise_shares``: distributed DP's noise shares inside (one per sender that
    added one): the root checks them against the survivors the noise was sized for."""

    round: int
    version: int
    weighted_sum: torch.Tensor
    total_weight: float
    senders: frozenset[str]
    num_examples: int = 0
    loss_sum: float = 0.0
    weighting: str = "examples"
    edges: frozenset[str] = frozenset()
    origin: str = ""
    staleness: int = 0
    modulus_bits: int = 0
    noise_shares: int = 0

    def __post_init__(self) -> None:
        if self.weighted_sum.dim() != 1:
            raise ValueError(f"weighted_sum must be a flat vector, got shape {tuple(self.weighted_sum.shape)}")
        if self.modulus_bits:
            if self.weighted_sum.dtype != torch.int64:
                raise ValueError("a masked partial holds an int64 vector (residues mod 2^modulus_bits)")
            if not 1 <= self.modulus_bits <= 62:
                raise ValueError(f"modulus_bits = {self.modulus_bits} must be in [1, 62]")
        elif self.weighted_sum.dtype != torch.float64:
            raise ValueError("a partial's weighted sum is float64 (sums of float32 lose the mean's bits)")
        if not (math.isfinite(self.total_weight) and self.total_weight >= 0):
            raise ValueError(f"total_weight = {self.total_weight!r} must be finite and >= 0")
        if self.num_examples < 0 or self.staleness < 0 or self.noise_shares < 0:
            raise ValueError("num_examples, staleness and noise_shares must be >= 0")

    @property
    def count(self) -> int:
        """Updates inside (one per sender)."""
        return len(self.senders)

    @property
    def numel(self) -> int:
        return int(self.weighted_sum.numel())

    @property
    def masked(self) -> bool:
        return self.modulus_bits > 0

    def sealed(self, by: str) -> Partial:
        """This partial as aggregator ``by`` sends it up: ``by`` is its origin and on its path."""
        return replace(self, origin=by, edges=self.edges | {by})

    def discounted(self, factor: float, staleness: int) -> Partial:
        """Every update inside weighed ``factor`` times less (a staleness weight s(t) in (0, 1]):
        the sum and the total weight both scale, so the mean the root takes is still a weighted mean."""
        if self.masked:
            raise ValueError("a masked sum cannot be reweighted: only its root sees the values")
        if not 0 < factor <= 1:
            raise ValueError(f"staleness factor {factor!r} must be in (0, 1]")
        return replace(
            self,
            weighted_sum=self.weighted_sum * factor,
            total_weight=self.total_weight * factor,
            staleness=max(self.staleness, staleness),
        )

    def digest(self) -> str:
        """A hash of the content (not of the path): a retransmit has the same one, a different sum another."""
        h = hashlib.blake2b(digest_size=16)
        meta = (
            self.round,
            self.version,
            sorted(self.senders),
            repr(float(self.total_weight)),
            self.num_examples,
            self.weighting,
            self.modulus_bits,
            self.noise_shares,
            self.staleness,
        )
        h.update(repr(meta).encode())
        h.update(self.weighted_sum.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def mean(self) -> torch.Tensor:
        """The weighted mean (float32): what only the root computes, once, at the top."""
        if self.masked:
            raise ValueError("a masked sum is unmasked by the secure-aggregation protocol before any mean")
        if not self.senders or self.total_weight <= 0:
            raise ValueError("the mean of an empty partial")
        return (self.weighted_sum / self.total_weight).to(torch.float32)

    def to_partial_sum(self) -> PartialSum:
        """The sum as shoal.update.PartialSum, what SyncRounds.submit_sum takes into the root's strategy."""
        if self.masked:
            raise ValueError("a masked partial reaches the strategy only after the root unmasked it")
        return PartialSum(
            self.weighted_sum,
            self.total_weight,
            self.weighting,
            sorted(self.senders),
            self.num_examples,
            self.loss_sum,
            self.version,
        )


def empty(round: int, version: int, numel: int, weighting: str = "examples", modulus_bits: int = 0) -> Partial:
    """The neutral element of :func:`merge` for a round (an aggregator's start)."""
    dtype = torch.int64 if modulus_bits else torch.float64
    zeros = torch.zeros(numel, dtype=dtype)
    return Partial(round, version, zeros, 0.0, frozenset(), weighting=weighting, modulus_bits=modulus_bits)


def update_weight(update: Update, weighting: str) -> float:
    """FedAvg's weight of one update: its examples (``examples``) or 1 (``uniform``), as Strategy weighs it."""
    if weighting == "examples":
        if update.num_examples <= 0:
            raise UpdateRejected(
                "out_of_range", f"update of {update.sender!r} has num_examples = {update.num_examples}"
            )
        return float(update.num_examples)
    return 1.0


def from_update(update: Update, round: int, weighting: str = "examples", noise_share: bool = False) -> Partial:
    """One node's update as a partial of one sender (float64)."""
    if not update.sender:
        raise ValueError("an update in a partial needs its sender's id")
    w = update_weight(update, weighting)
    return Partial(
        round,
        update.base_version,
        update.delta.detach().to(torch.float64).flatten() * w,
        w,
        frozenset({update.sender}),
        num_examples=update.num_examples,
        loss_sum=float(update.metrics.get("train_loss", 0.0)) * update.num_examples,
        weighting=weighting,
        noise_shares=1 if noise_share else 0,
    )


def mergeable(a: Partial, b: Partial) -> str | None:
    """Why ``a`` and ``b`` cannot be added (None: they can)."""
    return _mismatch(a.round, a.version, a.numel, a.weighting, a.modulus_bits, a.senders, b)


def _mismatch(round: int, version: int, numel: int, weighting: str, bits: int, senders: Any, b: Partial) -> str | None:
    if (round, version) != (b.round, b.version):
        return f"round {b.round} / version {b.version} does not match round {round} / version {version}"
    if numel != b.numel:
        return f"a sum of {b.numel} parameters does not match one of {numel}"
    if weighting != b.weighting:
        return f"weighting {b.weighting!r} does not match {weighting!r}"
    if bits != b.modulus_bits:
        return f"a sum mod 2^{b.modulus_bits} does not add to one mod 2^{bits}"
    twice = senders & b.senders
    if twice:
        return f"{len(twice)} node(s) would be counted twice (e.g. {sorted(twice)[0]!r})"
    return None


def merge(a: Partial, b: Partial) -> Partial:
    """``a + b``: associative and commutative; refuses (ValueError) what :func:`mergeable` refuses.
    The result has no origin: the aggregator that sends it up seals it (:meth:`Partial.sealed`)."""
    why = mergeable(a, b)
    if why is not None:
        raise ValueError(f"cannot merge partials: {why}")
    if a.modulus_bits:
        total = torch.remainder(a.weighted_sum + b.weighted_sum, 1 << a.modulus_bits)
    else:
        total = a.weighted_sum + b.weighted_sum
    return Partial(
        a.round,
        a.version,
        total,
        a.total_weight + b.total_weight,
        a.senders | b.senders,
        num_examples=a.num_examples + b.num_examples,
        loss_sum=a.loss_sum + b.loss_sum,
        weighting=a.weighting,
        edges=a.edges | b.edges,
        staleness=max(a.staleness, b.staleness),
        modulus_bits=a.modulus_bits,
        noise_shares=a.noise_shares + b.noise_shares,
    )


def merge_all(parts: Iterable[Partial], start: Partial) -> Partial:
    """``start`` plus every partial of ``parts`` (a fold of :func:`merge`)."""
    total = start
    for p in parts:
        total = merge(total, p)
    return total


class Accumulator:
    """An aggregator's running sum of one round, in place (no new model-sized tensor per update):
    nodes' updates (:meth:`add_update`) and children's partials (:meth:`add_partial`).
    :meth:`partial` gives the sum as a Partial. Memory: one float64 model-sized vector."""

    def __init__(self, round: int, version: int, numel: int, weighting: str = "examples"):
        self.round, self.version, self.weighting = round, version, weighting
        self._sum = torch.zeros(numel, dtype=torch.float64)
        self.total_weight = 0.0
        self.senders: set[str] = set()
        self.edges: set[str] = set()
        self.num_examples = 0
        self.loss_sum = 0.0
        self.staleness = 0
        self.noise_shares = 0

    @property
    def count(self) -> int:
        return len(self.senders)

    def add_update(self, update: Update, noise_share: bool = False) -> None:
        """One node's update (its ``base_version`` must be this round's version; a node counted once)."""
        if update.base_version != self.version:
            raise UpdateRejected("stale", f"update trained from version {update.base_version}, not {self.version}")
        if update.sender in self.senders:
            raise UpdateRejected("duplicate", f"node {update.sender!r} is already in this sum")
        if update.delta.numel() != self._sum.numel():
            raise UpdateRejected(
                "spec_mismatch", f"update of {update.delta.numel()} parameters, not {self._sum.numel()}"
            )
        w = update_weight(update, self.weighting)
        self._sum.add_(update.delta.detach().flatten().to(torch.float64), alpha=w)
        self.total_weight += w
        self.senders.add(update.sender)
        self.num_examples += update.num_examples
        self.loss_sum += float(update.metrics.get("train_loss", 0.0)) * update.num_examples
        self.noise_shares += int(noise_share)

    def add_partial(self, part: Partial) -> None:
        """A child's partial (checked as :func:`mergeable` checks; nothing changes when refused)."""
        if part.masked:
            raise UpdateRejected(
                "masked", "a masked partial goes to a masked sum (secure aggregation), not a float one"
            )
        why = _mismatch(self.round, self.version, self._sum.numel(), self.weighting, 0, self.senders, part)
        if why is not None:
            raise UpdateRejected("partial_mismatch", why)
        self._sum.add_(part.weighted_sum)
        self.total_weight += part.total_weight
        self.senders |= part.senders
        self.edges |= part.edges
        self.num_examples += part.num_examples
        self.loss_sum += part.loss_sum
        self.staleness = max(self.staleness, part.staleness)
        self.noise_shares += part.noise_shares

    def partial(self) -> Partial:
        """The running sum as a Partial (a copy of the vector: the accumulator may go on)."""
        return Partial(
            self.round,
            self.version,
            self._sum.clone(),
            self.total_weight,
            frozenset(self.senders),
            num_examples=self.num_examples,
            loss_sum=self.loss_sum,
            weighting=self.weighting,
            edges=frozenset(self.edges),
            staleness=self.staleness,
            noise_shares=self.noise_shares,
        )


@dataclass
class Receipt:
    """What :meth:`PartialInbox.offer` did: ``merged`` (new), ``duplicate`` (a retransmit, counted
    once), with the staleness of a discounted partial."""

    outcome: Literal["merged", "duplicate"]
    origin: str
    senders: int
    staleness: int = 0


@dataclass
class PartialInbox:
    """The partials of one round at one aggregator (root or mid-tier), without I/O.

    ``offer`` is idempotent per child (``origin``): the same partial again is a ``duplicate``
    and changes nothing, another one from that child is refused (``conflict``). Partials of an
    older version are refused (``stale = "refuse"``) or discounted by ``late_weight(t)``
    (``"weight"``) up to ``max_staleness`` versions; a partial of a newer version or another
    round number (of the same version) is refused. Refusals raise UpdateRejected, with nothing
    changed."""

    round: int
    version: int
    numel: int
    weighting: str = "examples"
    stale: Stale = "refuse"
    late_weight: Callable[[int], float] | None = None
    max_staleness: int | None = None
    children: set[str] | None = None  # the origins allowed to send (None: any)
    _digests: dict[str, str] = field(default_factory=dict)
    _pending: dict[str, str] = field(default_factory=dict)
    _acc: Accumulator | None = None

    def __post_init__(self) -> None:
        if self.stale == "weight" and self.late_weight is None:
            raise ValueError("stale='weight' needs a late_weight (aggregation.staleness)")
        self._acc = Accumulator(self.round, self.version, self.numel, self.weighting)

    @property
    def acc(self) -> Accumulator:
        assert self._acc is not None
        return self._acc

    @property
    def origins(self) -> list[str]:
        return sorted(self._digests)

    def admit(self, part: Partial) -> tuple[Receipt, Partial | None]:
        """Check ``part`` without taking it: a ``duplicate`` receipt and None (nothing to merge), or a
        ``merged`` receipt and the partial to merge (discounted when stale); :meth:`record` it once
        merged. A root whose strategy is the sum (SyncRounds.submit_sum) merges it there itself."""
        if not part.origin:
            raise UpdateRejected("malformed", "a partial sent up a tree names its origin (the aggregator that sent it)")
        if self.children is not None and part.origin not in self.children:
            raise UpdateRejected("not_selected", f"{part.origin!r} is not a child aggregator of this round")
        digest = part.digest()
        seen = self._digests.get(part.origin)
        if seen is not None:
            if seen == digest:
                return Receipt("duplicate", part.origin, part.count, part.staleness), None
            raise UpdateRejected("conflict", f"{part.origin!r} already sent a different partial for round {self.round}")
        t = self.version - part.version
        if t != 0 or part.round != self.round:
            if t <= 0 or self.stale == "refuse":
                raise UpdateRejected(
                    "stale",
                    f"partial of round {part.round} / version {part.version}; this aggregator merges round "
                    f"{self.round} / version {self.version}",
                )
            if self.max_staleness is not None and t > self.max_staleness:
                raise UpdateRejected("too_stale", f"partial is {t} versions old; max_staleness = {self.max_staleness}")
            assert self.late_weight is not None
            part = replace(part.discounted(self.late_weight(t), t), round=self.round, version=self.version)
        self._pending[part.origin] = digest
        return Receipt("merged", part.origin, part.count, part.staleness), part

    def record(self, origin: str) -> None:
        """The partial of ``origin`` that :meth:`admit` passed was merged: its retransmits are duplicates."""
        self._digests[origin] = self._pending.pop(origin)

    def release(self, origin: str) -> None:
        """The partial of ``origin`` that :meth:`admit` passed was not merged after all (refused further on)."""
        self._pending.pop(origin, None)

    def offer(self, part: Partial) -> Receipt:
        """Admit, merge into this inbox's own sum and record (a mid-tier aggregator, the simulator's root)."""
        receipt, merged = self.admit(part)
        if merged is not None:
            self.acc.add_partial(merged)
            self.record(merged.origin)
        return receipt

    def total(self) -> Partial:
        """Everything merged so far (the root's sum, or what a mid-tier seals and sends up)."""
        return self.acc.partial()


# --- the wire form: one safetensors body with a JSON header (shoal/wire.py) ------------------------

PARTIAL_KIND = "partial"
MAX_SENDERS = 1 << 20  # ids in one partial's header (a million nodes under one aggregator)


WIRE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def encode_partial(part: Partial, spec_hash: str, dtype: str = "float64") -> bytes:
    """The body an aggregator POSTs to its parent: the vector ``sum`` as ``dtype`` (``float64``: the sum
    exactly; ``float32``: half the bytes, the sum rounded once, relative error <= 2^-24 per entry;
    a masked sum is int64 whatever ``dtype`` says), the rest in the JSON header."""
    from shoal.wire import encode

    if dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype = {dtype!r} must be one of {', '.join(WIRE_DTYPES)}")
    vector = part.weighted_sum if part.masked else part.weighted_sum.to(WIRE_DTYPES[dtype])

    header: dict[str, Any] = {
        "kind": PARTIAL_KIND,
        "spec_hash": spec_hash,
        "round": part.round,
        "version": part.version,
        "total_weight": part.total_weight,
        "senders": sorted(part.senders),
        "num_examples": part.num_examples,
        "loss_sum": part.loss_sum,
        "weighting": part.weighting,
        "edges": sorted(part.edges),
        "origin": part.origin,
        "staleness": part.staleness,
        "modulus_bits": part.modulus_bits,
        "noise_shares": part.noise_shares,
    }
    return encode({"sum": vector}, header)


def _field(header: dict, key: str, kind: type | tuple[type, ...], check: Callable[[Any], bool] = lambda v: True) -> Any:
    v = header.get(key)
    if isinstance(v, bool) and kind is not bool or not isinstance(v, kind) or not check(v):
        raise Malformed(f"partial header field {key!r} is missing or out of range ({type(v).__name__})")
    return v


def _ids(header: dict, key: str) -> frozenset[str]:
    v = header.get(key)
    if not isinstance(v, list) or len(v) > MAX_SENDERS:
        raise Malformed(f"partial header field {key!r} must be a list of at most {MAX_SENDERS} ids")
    if not all(isinstance(s, str) and 0 < len(s) <= 256 for s in v):
        raise Malformed(f"partial header field {key!r}: every id is a string of 1 to 256 characters")
    out = frozenset(v)
    if len(out) != len(v):
        raise Malformed(f"partial header field {key!r} names an id twice")
    return out


def decode_partial(body: bytes | bytearray | memoryview, numel: int, spec_hash: str, max_bytes: int) -> Partial:
    """Check everything of a partial from the network (Malformed / SpecMismatch / NonFinite / TooLarge)."""
    from shoal.wire import decode, read_header

    header, table = read_header(body, max_bytes)
    if header.get("kind") != PARTIAL_KIND:
        raise Malformed(f"body is not a partial aggregate (kind {header.get('kind')!r})")
    bits = _field(header, "modulus_bits", int, lambda v: 0 <= v <= 62)
    sent = table.get("sum", {}).get("dtype")
    dtype = torch.int64 if bits else (torch.float32 if sent == "F32" else torch.float64)
    header, tensors = decode(body, {"sum": (dtype, (numel,))}, max_bytes, spec_hash=spec_hash)
    total = tensors["sum"] if bits else tensors["sum"].to(torch.float64)
    if bits and (int(total.min()) < 0 or int(total.max()) >= (1 << bits)):
        raise Malformed(f"a masked sum has residues outside [0, 2^{bits})")
    uint = (int,)
    return Partial(
        round=_field(header, "round", uint, lambda v: 0 <= v < 2**53),
        version=_field(header, "version", uint, lambda v: 0 <= v < 2**53),
        weighted_sum=total,
        total_weight=float(_field(header, "total_weight", (int, float), lambda v: math.isfinite(v) and v >= 0)),
        senders=_ids(header, "senders"),
        num_examples=_field(header, "num_examples", uint, lambda v: 0 <= v < 2**53),
        loss_sum=float(_field(header, "loss_sum", (int, float), math.isfinite)),
        weighting=_field(header, "weighting", str, lambda v: v in ("examples", "uniform")),
        edges=_ids(header, "edges"),
        origin=_field(header, "origin", str, lambda v: 0 < len(v) <= 256),
        staleness=_field(header, "staleness", uint, lambda v: 0 <= v < 2**31),
        modulus_bits=bits,
        noise_shares=_field(header, "noise_shares", uint, lambda v: 0 <= v <= MAX_SENDERS),
    )
