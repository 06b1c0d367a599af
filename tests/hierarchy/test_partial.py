"""The partial-aggregate message and its merge: any tree gives the flat sum, retransmits count once,
stale and conflicting partials are refused, the wire form refuses what it cannot trust."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.aggregation.partial import (
    Accumulator,
    Partial,
    PartialInbox,
    decode_partial,
    empty,
    encode_partial,
    from_update,
    merge,
)
from shoal.aggregation.staleness import staleness_weight
from shoal.errors import Malformed, SpecMismatch, UpdateRejected, WireError
from shoal.update import Update

NUMEL = 257


def updates(n: int, seed: int = 0, version: int = 3) -> list[Update]:
    g = torch.Generator().manual_seed(seed)
    return [
        Update(
            torch.randn(NUMEL, generator=g) * (1 + 10 * i % 7),
            int(torch.randint(1, 500, (1,), generator=g)),
            version,
            f"node-{i:03d}",
            {"train_loss": float(i) / n},
        )
        for i in range(n)
    ]


def flat_mean(ups: list[Update]) -> torch.Tensor:
    w = torch.tensor([float(u.num_examples) for u in ups], dtype=torch.float64)
    stacked = torch.stack([u.delta.to(torch.float64) for u in ups])
    return ((w[:, None] * stacked).sum(0) / w.sum()).to(torch.float32)


def random_tree(parts: list[Partial], rnd: random.Random, label: str = "t") -> Partial:
    """Merge ``parts`` along a random tree: random groups, each merged in a random order, recursively."""
    level = 0
    while len(parts) > 1:
        rnd.shuffle(parts)
        groups, i = [], 0
        while i < len(parts):
            k = rnd.randint(1, max(1, min(6, len(parts) - i)))
            groups.append(parts[i : i + k])
            i += k
        if len(groups) == len(parts):  # no progress: pair the first two
            groups = [parts[:2], *[[p] for p in parts[2:]]]
        nxt = []
        for j, g in enumerate(groups):
            total = g[0]
            for p in g[1:]:
                total = merge(total, p) if rnd.random() < 0.5 else merge(p, total)
            nxt.append(total.sealed(f"{label}{level}.{j}"))
        parts, level = nxt, level + 1
    return parts[0]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 100))
def test_any_tree_gives_the_flat_mean(seed: int, n: int) -> None:
    ups = updates(n, seed % 1000)
    leaves = [from_update(u, round=7) for u in ups]
    top = random_tree(leaves, random.Random(seed))
    assert top.senders == {u.sender for u in ups}
    assert top.num_examples == sum(u.num_examples for u in ups)
    assert top.total_weight == pytest.approx(sum(u.num_examples for u in ups), rel=1e-12)
    torch.testing.assert_close(top.mean(), flat_mean(ups), atol=1e-6, rtol=0)


def test_accumulator_matches_merge_and_the_strategy_input() -> None:
    ups = updates(40)
    acc = Accumulator(7, 3, NUMEL)
    for u in ups[:25]:
        acc.add_update(u)
    child = Accumulator(7, 3, NUMEL)
    for u in ups[25:]:
        child.add_update(u)
    acc.add_partial(child.partial().sealed("edge-b"))
    top = acc.partial()
    assert top.edges == {"edge-b"} and top.count == 40
    torch.testing.assert_close(top.mean(), flat_mean(ups), atol=1e-6, rtol=0)
    ps = top.to_partial_sum()
    assert ps.senders == sorted(u.sender for u in ups) and ps.base_version == 3
    with pytest.raises(UpdateRejected) as e:
        acc.add_update(ups[0])  # already inside
    assert e.value.code == "duplicate"
    with pytest.raises(UpdateRejected) as e:
        acc.add_partial(from_update(ups[1], 7).sealed("edge-c"))
    assert e.value.code == "partial_mismatch" and "twice" in str(e.value)
    assert acc.count == 40  # nothing changed


def test_merge_refuses_double_counting_and_mismatches() -> None:
    a, b = (from_update(u, 1) for u in updates(2))
    with pytest.raises(ValueError, match="twice"):
        merge(merge(a, b), a)
    with pytest.raises(ValueError, match="round"):
        merge(a, from_update(updates(3, version=4)[2], 1))
    with pytest.raises(ValueError, match="weighting"):
        merge(a, from_update(updates(3)[2], 1, weighting="uniform"))
    assert merge(empty(1, 3, NUMEL), a).digest() == a.digest()  # the neutral element


def test_inbox_is_idempotent_per_child_and_refuses_conflicts() -> None:
    ups = updates(6)
    p1 = merge(from_update(ups[0], 5), from_update(ups[1], 5)).sealed("edge-1")
    p2 = merge(from_update(ups[2], 5), from_update(ups[3], 5)).sealed("edge-2")
    inbox = PartialInbox(round=5, version=3, numel=NUMEL, children={"edge-1", "edge-2", "edge-3"})
    assert inbox.offer(p1).outcome == "merged"
    for _ in range(3):  # retransmits: counted once
        assert inbox.offer(p1).outcome == "duplicate"
    assert inbox.offer(p2).outcome == "merged"
    total = inbox.total()
    assert total.count == 4 and total.edges == {"edge-1", "edge-2"}
    torch.testing.assert_close(total.mean(), flat_mean(ups[:4]), atol=1e-6, rtol=0)
    other = merge(from_update(ups[0], 5), from_update(ups[4], 5)).sealed("edge-1")
    with pytest.raises(UpdateRejected) as e:
        inbox.offer(other)  # edge-1 again, another content
    assert e.value.code == "conflict"
    with pytest.raises(UpdateRejected) as e:
        inbox.offer(merge(from_update(ups[0], 5), from_update(ups[4], 5)).sealed("edge-3"))  # node-000 twice
    assert e.value.code == "partial_mismatch"
    with pytest.raises(UpdateRejected) as e:
        inbox.offer(from_update(ups[5], 5).sealed("intruder"))
    assert e.value.code == "not_selected"
    assert inbox.total().digest() == total.digest()  # refusals changed nothing


def test_stale_partials_are_refused_or_discounted() -> None:
    old = from_update(updates(1, version=1)[0], round=2).sealed("edge-1")
    fresh = from_update(updates(2, version=3)[1], round=4).sealed("edge-2")
    strict = PartialInbox(round=4, version=3, numel=NUMEL)
    with pytest.raises(UpdateRejected) as e:
        strict.offer(old)
    assert e.value.code == "stale"
    with pytest.raises(UpdateRejected):  # from the future
        strict.offer(from_update(updates(1, version=9)[0], round=10).sealed("edge-3"))

    def s(t: int) -> float:
        return staleness_weight("polynomial", t, 0.5)

    lenient = PartialInbox(round=4, version=3, numel=NUMEL, stale="weight", late_weight=s, max_staleness=2)
    r = lenient.offer(old)
    assert r.outcome == "merged" and r.staleness == 2
    lenient.offer(fresh)
    total = lenient.total()
    w_old, w_new = old.total_weight * s(2), fresh.total_weight
    expect = (old.weighted_sum * s(2) + fresh.weighted_sum) / (w_old + w_new)
    torch.testing.assert_close(total.mean(), expect.float(), atol=1e-6, rtol=0)
    assert total.staleness == 2
    too_old = from_update(updates(1, version=0)[0], round=1).sealed("edge-4")
    with pytest.raises(UpdateRejected) as e:
        lenient.offer(too_old)
    assert e.value.code == "too_stale"


def test_masked_sums_merge_modulo_two_to_the_bits() -> None:
    bits = 20
    g = torch.Generator().manual_seed(1)
    vals = [torch.randint(0, 1 << bits, (NUMEL,), generator=g) for _ in range(9)]
    parts = [Partial(1, 0, v, 0.0, frozenset({f"n{i}"}), modulus_bits=bits, origin=f"n{i}") for i, v in enumerate(vals)]
    top = random_tree(parts, random.Random(3))
    assert torch.equal(top.weighted_sum, torch.stack(vals).sum(0) % (1 << bits))
    with pytest.raises(ValueError):
        top.mean()
    with pytest.raises(ValueError):
        merge(top, from_update(updates(1, version=0)[0], 1))


def test_wire_round_trip_and_hostile_bodies() -> None:
    ups = updates(5)
    part = merge(from_update(ups[0], 2), from_update(ups[1], 2)).sealed("edge-a")
    body = encode_partial(part, "spec1")
    back = decode_partial(body, NUMEL, "spec1", max_bytes=1 << 20)
    assert back.digest() == part.digest() and back.origin == "edge-a" and back.edges == {"edge-a"}
    with pytest.raises(SpecMismatch):
        decode_partial(body, NUMEL, "other", max_bytes=1 << 20)
    with pytest.raises(SpecMismatch):
        decode_partial(body, NUMEL + 1, "spec1", max_bytes=1 << 20)
    with pytest.raises(WireError):
        decode_partial(body, NUMEL, "spec1", max_bytes=100)
    with pytest.raises(Malformed):
        decode_partial(body[:-9], NUMEL, "spec1", max_bytes=1 << 20)
    from shoal.wire import encode

    def forged(**over) -> bytes:
        header = {
            "kind": "partial",
            "spec_hash": "spec1",
            "round": 2,
            "version": 3,
            "total_weight": 3.0,
            "senders": ["a"],
            "num_examples": 3,
            "loss_sum": 0.0,
            "weighting": "examples",
            "edges": [],
            "origin": "e",
            "staleness": 0,
            "modulus_bits": 0,
            "noise_shares": 0,
            **over,
        }
        return encode({"sum": torch.zeros(NUMEL, dtype=torch.float64)}, header)

    assert decode_partial(forged(), NUMEL, "spec1", 1 << 20).count == 1
    for bad in (
        {"senders": ["a", "a"]},
        {"senders": "a"},
        {"total_weight": -1.0},
        {"round": True},
        {"origin": ""},
        {"weighting": "median"},
        {"kind": "update"},
        {"modulus_bits": 99},
        {"num_examples": -1},
    ):
        with pytest.raises(Malformed):
            decode_partial(forged(**bad), NUMEL, "spec1", 1 << 20)
    nan = torch.zeros(NUMEL, dtype=torch.float64)
    nan[3] = float("nan")
    from shoal.wire import encode as enc

    hdr = {"kind": "partial", "spec_hash": "spec1", "modulus_bits": 0}
    with pytest.raises(WireError):
        decode_partial(enc({"sum": nan}, hdr), NUMEL, "spec1", 1 << 20)
    masked = enc({"sum": torch.full((NUMEL,), 1 << 20, dtype=torch.int64)}, {**hdr, "modulus_bits": 20})
    with pytest.raises(Malformed, match="residues"):
        decode_partial(masked, NUMEL, "spec1", 1 << 20)


def test_float32_wire_form_halves_the_bytes_within_float32_rounding() -> None:
    ups = updates(25)
    acc = Accumulator(2, 3, NUMEL)
    for u in ups:
        acc.add_update(u)
    part = acc.partial().sealed("edge-a")
    wide, narrow = encode_partial(part, "s", "float64"), encode_partial(part, "s", "float32")
    assert len(wide) - len(narrow) == 4 * NUMEL  # the same header, 4 bytes less per entry
    back = decode_partial(narrow, NUMEL, "s", 1 << 20)
    assert back.weighted_sum.dtype == torch.float64 and back.senders == part.senders
    torch.testing.assert_close(back.mean(), flat_mean(ups), atol=1e-6, rtol=0)
