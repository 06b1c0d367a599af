"""Group averaging (p2p/group_average.py): the grid, and the all-reduce driven by a small
in-memory transport with random delays, members that vanish at every stage, refused
connections and silent ones. Properties: exact (weighted) averages, d rounds on a full
grid give the global average, survivors agree on the average of what arrived."""

from __future__ import annotations

import heapq
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.p2p.grid_average import GridAverage, grid_path
from shoal.p2p.group_average import (
    GroupAverage,
    Refusal,
    SliceMessage,
    grid_dims,
    grid_groups,
    group_id,
    group_of,
    slice_bounds,
)

STAGES = (None, "never", "after_parts", "mid_reduce", "after_reduce")


def drive(members, values, weights, crash=None, refuse=True, seed=0, timeout=1.0, latency=0.05, round_=0, make=None):
    """Run one group's exchange; returns ({member: GroupResult} for the survivors, messages sent).

    ``crash[m]``: "never" (never starts), "after_parts" (vanishes once its parts are sent),
    "mid_reduce" (sends its averaged slice to half the others, then vanishes), "after_reduce"
    (vanishes once its averaged slice is sent). A message to a vanished member is
    refused (the sender learns it at once) when ``refuse``, else silently lost."""
    crash = crash or {}
    gen = torch.Generator().manual_seed(seed)
    make = make or (lambda m: GroupAverage(m, members, round_, values[m], weights[m], 0.0, timeout))
    objs = {m: make(m) for m in members}
    dead = {m for m in members if crash.get(m) == "never"}
    queue: list = []
    seq = itertools.count()
    sent = 0

    def delay() -> float:
        return float(torch.rand((), generator=gen)) * 2 * latency

    def emit(src: str, msgs: list[SliceMessage], t: float) -> None:
        nonlocal sent
        if src in dead:
            return
        if crash.get(src) == "mid_reduce" and any(m.phase == "reduced" for m in msgs):
            msgs = [m for m in msgs if m.phase != "reduced"] + [m for m in msgs if m.phase == "reduced"][::2]
            dead.add(src)
        for m in msgs:
            sent += 1
            heapq.heappush(queue, (t + delay(), next(seq), "msg", m))
        stage = crash.get(src)
        if stage == "after_parts" or (stage == "after_reduce" and any(m.phase == "reduced" for m in msgs)):
            dead.add(src)
        schedule(src, t)

    def schedule(m: str, t: float) -> None:
        d = objs[m].next_deadline()
        if d is not None and m not in dead:
            heapq.heappush(queue, (max(d, t), next(seq), "tick", m))

    for m in members:
        if m not in dead:
            emit(m, objs[m].start(), 0.0)
    while queue:
        t, _, kind, item = heapq.heappop(queue)
        if kind == "tick":
            if item not in dead and not objs[item].done:
                emit(item, objs[item].tick(t), t)
            continue
        if kind == "gone":
            sender, target = item
            if sender not in dead:
                emit(sender, objs[sender].on_unreachable(target, t), t)
            continue
        msg = item
        if msg.target in dead:
            if refuse:
                heapq.heappush(queue, (t + delay(), next(seq), "gone", (msg.sender, msg.target)))
            continue
        emit(msg.target, objs[msg.target].on_message(msg, t), t)
    survivors = [m for m in members if m not in dead]
    assert all(objs[m].done for m in survivors)
    drive.last_time = t
    return {m: objs[m].result() for m in survivors}, sent


def _vectors(members, numel, seed):
    g = torch.Generator().manual_seed(seed)
    return {m: torch.randn(numel, generator=g) for m in members}


def _mean(values, weights, who):
    total = sum(weights[m] for m in who)
    return sum(values[m].double() * weights[m] for m in who) / total


def test_a_group_averages_exactly_with_weights_and_sends_two_models_per_member():
    members = [f"p{i}" for i in range(5)]
    values = _vectors(members, 103, 0)
    weights = {m: float(10 + 7 * i) for i, m in enumerate(members)}
    out, sent = drive(members, values, weights)
    want = _mean(values, weights, members).float()
    for r in out.values():
        assert torch.allclose(r.values, want, atol=1e-6)
        assert r.complete and r.weight == pytest.approx(sum(weights.values())) and not r.missing
    assert sent == 2 * 5 * 4  # k-1 parts and k-1 averaged slices per member
    equal, _ = drive(members, values, {m: 1.0 for m in members})
    assert torch.allclose(equal["p0"].values, torch.stack(list(values.values())).mean(0), atol=1e-6)


@pytest.mark.parametrize(
    "n,g,dims",
    [
        (105, 4, (3, 5, 7)),
        (64, 4, (4, 4, 4)),
        (10, 4, (2, 5)),
        (3, 4, (3,)),
        (1, 4, (1,)),
        (7, 4, (7,)),
        (9, 3, (3, 3)),
        (13, 4, (2, 7)),
        (101, 4, (3, 5, 7)),
    ],
)
def test_grid_dims(n, g, dims):
    assert grid_dims(n, g) == dims


@given(n=st.integers(1, 200), g=st.integers(2, 12), r=st.integers(0, 50), seed=st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_grid_groups_partition_the_peers_and_agree_with_group_of(n, g, r, seed):
    peers = [f"https://10.0.0.{i}:9000" for i in range(n)]
    groups = grid_groups(peers, r, g, seed)
    flat = [p for grp in groups for p in grp]
    assert sorted(flat) == sorted(peers)
    assert math.prod(grid_dims(n, g)) >= n
    me = peers[(r * 7) % n]
    assert group_of([p for p in peers if p != me], me, r, g, seed) in groups


def test_groups_of_different_axes_meet_in_one_member_and_change_every_epoch():
    peers = [f"p{i:03d}" for i in range(105)]
    a, b = grid_groups(peers, 0, 4, 1), grid_groups(peers, 1, 4, 1)
    assert max(len(set(x) & set(y)) for x in a for y in b) == 1
    assert sorted(map(len, a)) == [3] * 35 and sorted(map(len, b)) == [5] * 21
    assert grid_groups(peers, 3, 4, 1) != a and grid_groups(peers, 0, 4, 2) != a  # next epoch, other seed


@pytest.mark.parametrize("n,g,weighted", [(27, 3, False), (16, 4, True), (105, 4, True), (12, 4, False)])
def test_d_rounds_on_a_full_grid_give_the_exact_global_average(n, g, weighted):
    peers = [f"p{i:03d}" for i in range(n)]
    d = len(grid_dims(n, g))
    assert math.prod(grid_dims(n, g)) == n  # a full grid
    values = _vectors(peers, 37, n)
    weights = {m: (float(1 + (i * 13) % 17) if weighted else 1.0) for i, m in enumerate(peers)}
    want = _mean(values, weights, peers)
    cur, w = dict(values), dict(weights)
    for r in range(d):
        before = torch.stack([cur[p] for p in peers])
        for grp in grid_groups(peers, r, g, seed=9):
            out, _ = drive(list(grp), {m: cur[m] for m in grp}, {m: w[m] for m in grp}, seed=r, round_=r)
            for m, res in out.items():
                cur[m], w[m] = res.values, res.weight
        if r < d - 1:  # not yet: the models still differ
            assert not all(torch.allclose(cur[p], cur[peers[0]], atol=1e-5) for p in peers)
        assert not torch.equal(before, torch.stack([cur[p] for p in peers]))
    for p in peers:
        assert torch.allclose(cur[p].double(), want, atol=1e-5)
        assert w[p] == pytest.approx(sum(weights.values()))


@given(
    k=st.integers(2, 7),
    stages=st.lists(st.sampled_from(STAGES), min_size=7, max_size=7),
    refuse=st.booleans(),
    seed=st.integers(0, 1000),
    weighted=st.booleans(),
)
@settings(max_examples=150, deadline=None)
def test_with_dropouts_survivors_agree_on_the_average_of_what_arrived(k, stages, refuse, seed, weighted):
    members = [f"m{i}" for i in range(k)]
    crash = {m: s for m, s in zip(members, stages) if s}
    if all(crash.get(m) for m in members):
        crash.pop(members[seed % k])  # at least one survivor
    values = _vectors(members, 3 * k + seed % 5, seed)
    weights = {m: (float(1 + (seed + i) % 9) if weighted else 1.0) for i, m in enumerate(members)}
    out, _ = drive(members, values, weights, crash, refuse, seed)
    survivors = [m for m in members if m not in crash]
    assert sorted(out) == survivors
    started = [m for m in members if crash.get(m) != "never"]
    first = out[survivors[0]].values
    for m in survivors:
        r = out[m]
        assert torch.allclose(r.values, first, atol=0, rtol=0), "survivors disagree"
        assert r.kept == 0
        if not refuse and not set(crash.values()) & {"never", "after_parts", "mid_reduce"}:
            assert r.complete  # (a refusal may overtake a vanished member's last message)
    crashed_started = [m for m in started if m in crash]
    for j, (lo, hi) in enumerate(slice_bounds(len(first), k)):
        # every survivor's part, and those of crashed members that reached the reducer (or, for a
        # repaired slice, the survivors) before it learnt they were gone
        part = {m: v[lo:hi] for m, v in values.items()}
        options = [
            survivors + list(extra)
            for n in range(len(crashed_started) + 1)
            for extra in itertools.combinations(crashed_started, n)
        ]
        assert any(torch.allclose(first[lo:hi], _mean(part, weights, who).float(), atol=1e-6) for who in options), j


def test_a_silent_member_delays_by_the_deadlines_only():
    members = ["a", "b", "c", "d"]
    values = _vectors(members, 40, 3)
    out, _ = drive(members, values, {m: 1.0 for m in members}, {"c": "never"}, refuse=False, timeout=1.0)
    want = _mean(values, {m: 1.0 for m in members}, ["a", "b", "d"]).float()
    for r in out.values():
        assert torch.allclose(r.values, want, atol=1e-6)
        assert r.missing == ["c"] and r.repaired == 1 and not r.complete


def test_messages_of_another_group_or_malformed_are_refused():
    members = ("a", "b", "c")
    ga = GroupAverage("a", members, 4, torch.zeros(9), 1.0, 0.0, 1.0)
    ga.start()
    good = SliceMessage("b", "a", 4, group_id(4, members), members, 0, "part", 1.0, torch.ones(3))
    ga.on_message(good, 0.1)
    cases = {
        "not_in_group": [dict(round=5), dict(group="x"), dict(members=("a", "b", "d"))],
        "malformed": [
            dict(sender="z"),
            dict(sender="a"),
            dict(target="b"),
            dict(phase="hello"),
            dict(slice=3),
            dict(data=torch.ones(4)),
            dict(weight=0.0),
            dict(weight=float("nan")),
            dict(slice=1),
            dict(count=4),
            dict(phase="reduced", slice=0),
        ],
    }
    import dataclasses

    for code, changes in cases.items():
        for change in changes:
            with pytest.raises(Refusal) as e:
                ga.check(dataclasses.replace(good, **change))
            assert e.value.code == code, change
    with pytest.raises(ValueError):
        GroupAverage("z", members, 0, torch.zeros(3), 1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        GroupAverage("a", members, 0, torch.zeros(3), 0.0, 0.0, 1.0)


def _grid(n, g):
    return [f"p{i:03d}" for i in range(n)]


@pytest.mark.parametrize(
    "n,g,step,weighted", [(105, 4, 0, True), (27, 3, 4, False), (12, 4, 1, True), (64, 4, 2, False)]
)
def test_one_grid_exchange_gives_the_exact_global_average_for_two_models_per_member(n, g, step, weighted):
    peers = _grid(n, g)
    values = _vectors(peers, 211, n)
    weights = {m: (float(1 + (i * 7) % 11) if weighted else 1.0) for i, m in enumerate(peers)}
    paths = {m: grid_path([p for p in peers if p != m], m, step, g, 0, seed=5) for m in peers}
    assert all(len(pth) == len(grid_dims(n, g)) for pth in paths.values())
    out, sent = drive(
        peers, values, weights, make=lambda m: GridAverage(m, paths[m], step, values[m], weights[m], 0.0, 1.0)
    )
    want = _mean(values, weights, peers).float()
    for r in out.values():
        assert torch.allclose(r.values, want, atol=1e-5) and r.complete
        assert r.weight == pytest.approx(sum(weights.values()))
    # messages per member: 2 (k_l - 1) per level; values sent: about 2 (1 - 1/n) models
    dims = grid_dims(n, g)
    assert sent == n * sum(2 * (k - 1) for k in dims)


def test_a_grid_exchange_on_a_grid_that_is_not_full_averages_one_axis():
    peers = _grid(13, 4)
    assert grid_dims(13, 4) == (2, 7)  # 14 cells
    assert all(len(grid_path(peers, m, 0, 4, 0)) == 1 for m in peers)
    assert grid_path(peers, "p000", 1, 4, 0)[0] == group_of(peers, "p000", 1, 4)


@given(
    stages=st.lists(st.sampled_from(STAGES), min_size=12, max_size=12), refuse=st.booleans(), seed=st.integers(0, 1000)
)
@settings(max_examples=40, deadline=None)
def test_a_grid_exchange_with_dropouts_finishes_within_its_deadlines_and_stays_an_average(stages, refuse, seed):
    peers = _grid(12, 4)  # 3 x 4
    crash = {m: s for m, s in zip(peers, stages) if s and (seed + peers.index(m)) % 3 == 0}
    values = _vectors(peers, 50, seed)
    weights = {m: 1.0 for m in peers}
    paths = {m: grid_path(peers, m, seed % 2, 4, 0) for m in peers}
    out, _ = drive(
        peers,
        values,
        weights,
        crash,
        refuse,
        seed,
        make=lambda m: GridAverage(m, paths[m], seed % 2, values[m], 1.0, 0.0, 1.0),
    )
    assert drive.last_time < 3 * 4 + 3 * 3 + 2  # level 1 waits for level 2 at most 3 timeouts a slice
    stack = torch.stack(list(values.values()))
    lo, hi = stack.min(0).values, stack.max(0).values
    survivors = [m for m in peers if m not in crash]
    for m in survivors:
        r = out[m].values
        assert bool(((r >= lo - 1e-5) & (r <= hi + 1e-5)).all())  # a convex combination, coordinate-wise
    if not crash:
        assert all(torch.allclose(out[m].values, stack.mean(0), atol=1e-5) for m in survivors)


def test_a_hostile_reducers_forged_slice_is_clipped_around_each_members_own_values():
    """An insider takes part with a forged model (x100): the honest reducers clip its parts, and its
    own reduced slice (which it controls whole) is clipped around each honest member's values of
    that slice, so no honest member's model moves by more than the radius on any slice."""
    from shoal.p2p.merge import MergeBound

    members = ["p0", "p1", "bad"]
    values = _vectors(members, 30, 1)
    values["bad"] = 100 * values["bad"]
    weights = {m: 1.0 for m in members}
    radius = 1.0
    out, _ = drive(
        members,
        values,
        weights,
        make=lambda m: GroupAverage(m, members, 0, values[m], 1.0, 0.0, 1.0, bound=MergeBound(radius=radius)),
    )
    for m in ("p0", "p1"):
        moved = out[m].values - values[m]
        assert float(torch.linalg.vector_norm(moved)) <= radius * (1 + 1e-5), m
    # without the bound the forged slice is taken as it came
    plain, _ = drive(members, values, weights)
    assert float(torch.linalg.vector_norm(plain["p0"].values - values["p0"])) > 10 * radius
