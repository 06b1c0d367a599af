"""Secure groups between peers (p2p/secure_group.py): the secagg state machines driven
message by message, one member relaying; members that vanish at each stage; a silent relay."""

from __future__ import annotations

import heapq
import itertools

import pytest
import torch

from shoal.p2p.secure_group import SecureGroup

MEMBERS = ("a", "b", "c", "d")


def run(offsets, examples, drop=None, refuse=True, timeout=1.0):
    """Deliver every message after 0.01; ``drop[m]`` = the kind of m's first message never sent."""
    drop = drop or {}
    objs = {
        m: SecureGroup(m, MEMBERS, 7, offsets[m], examples[m], 0.0, timeout, clip=1.0, bits=20, seed=3) for m in MEMBERS
    }
    dead: set[str] = set()
    queue: list = []
    seq = itertools.count()

    def emit(src, msgs, t):
        for msg in msgs:
            if drop.get(src) == msg.kind:
                dead.add(src)
            if src in dead:
                return
            heapq.heappush(queue, (t + 0.01, next(seq), "msg", msg))
        d = objs[src].next_deadline()
        if d is not None:
            heapq.heappush(queue, (max(d, t), next(seq), "tick", src))

    for m in MEMBERS:
        emit(m, objs[m].start(), 0.0)
    while queue:
        t, _, kind, item = heapq.heappop(queue)
        if kind == "tick":
            if item not in dead:
                emit(item, objs[item].tick(t), t)
        elif kind == "gone":
            if item[0] not in dead:
                emit(item[0], objs[item[0]].on_unreachable(item[1], t), t)
        elif item.target in dead:
            if refuse:
                heapq.heappush(queue, (t + 0.01, next(seq), "gone", (item.sender, item.target)))
        else:
            emit(item.target, objs[item.target].on_message(item, t), t)
    return {m: objs[m].result() for m in MEMBERS if m not in dead}


def _offsets(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {m: 0.3 * torch.randn(50, generator=g) for m in MEMBERS}


def _mean(offsets, examples, who):
    w = torch.tensor([float(examples[m]) for m in who])
    return (w[:, None] * torch.stack([offsets[m].clamp(-1, 1) for m in who])).sum(0) / w.sum()


def test_every_member_gets_the_groups_weighted_average():
    offsets, examples = _offsets(), {"a": 10, "b": 30, "c": 20, "d": 40}
    out = run(offsets, examples)
    want = _mean(offsets, examples, MEMBERS)
    for r in out.values():
        assert r.mean is not None and r.included == 4
        assert torch.allclose(r.mean, want, atol=4 * 2 / 2**20 * 4)


@pytest.mark.parametrize("kind", ["keys", "shares", "masked", "unmask"])
def test_a_member_that_vanishes_at_any_stage_is_handled_as_the_protocol_says(kind):
    offsets, examples = _offsets(1), {m: 10 for m in MEMBERS}
    out = run(offsets, examples, {"c": kind})
    # lost before its masked input: left out; lost after it: included (its mask rebuilt from shares)
    who = [m for m in MEMBERS if m != "c"] if kind in ("keys", "shares", "masked") else list(MEMBERS)
    for m, r in out.items():
        assert r.mean is not None and r.included == len(who), (m, r)
        assert torch.allclose(r.mean, _mean(offsets, examples, who), atol=1e-4)


def test_below_the_threshold_the_group_aborts_and_a_silent_relay_is_given_up():
    offsets, examples = _offsets(2), {m: 10 for m in MEMBERS}
    out = run(offsets, examples, {"b": "keys", "c": "keys", "d": "keys"})  # t = 3 of 4
    assert out["a"].mean is None and "threshold" in out["a"].reason
    out = run(offsets, examples, {"a": "directory"}, refuse=False)  # the relay vanishes after the keys
    assert all(r.mean is None and "relay" in r.reason for r in out.values())


def test_the_simulators_one_call_form_gives_the_same_mean_as_the_message_objects():
    """simulations/gossip/secure_groups.py averages a group in one call (secure_group_average);
    deployed peers drive SecureGroup message by message. The same offsets and weights give the
    same mean (both in the same fixed point), to float32 precision."""
    from shoal.aggregation.secagg.group import secure_group_average

    offsets = _offsets(4)
    examples = {"a": 10, "b": 20, "c": 5, "d": 40}
    objects = run(offsets, examples)
    one_call = secure_group_average(
        {m: offsets[m].numpy() for m in MEMBERS},
        {m: float(examples[m]) for m in MEMBERS},
        session=b"equivalence",
        clip=1.0,
        bits=20,
        seed=3,
    )
    want = torch.from_numpy(one_call.mean).float()
    for m in MEMBERS:
        assert torch.allclose(objects[m].mean.float(), want, atol=1e-5), m
    assert sorted(one_call.included) == sorted(MEMBERS)
