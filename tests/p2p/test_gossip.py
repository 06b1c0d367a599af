"""The push-pull exchange of GossipNode, driven by hand as a transport would."""

from __future__ import annotations

import torch

from shoal.p2p.gossip import GossipNode
from shoal.p2p.membership import Membership
from shoal.p2p.merge import MergeBound, MergeRule


def _node(pid: str, value: float, peers: tuple[str, ...], rule: MergeRule | None = None) -> GossipNode:
    # the merge bound off: these toy models sit farther apart than a trained network's (tests/p2p/test_merge.py)
    no_bound = MergeBound(0.0, 0.0)
    return GossipNode(Membership(pid, 4, 2, bootstrap_peers=peers), torch.full((3,), value), 10, rule, 2.0, no_bound)


def test_push_pull_merges_both_sides_with_pre_merge_models():
    a, b = _node("a", 0.0, ("b",)), _node("b", 4.0, ("a",))
    a.local_update(torch.full((3,), 1.0))
    b.local_update(torch.full((3,), 3.0))
    b.local_update(torch.full((3,), 3.0))
    push = a.start_exchange(now=0.0)
    assert push.target == "b" and push.age == 1
    answer = b.on_push(push, now=0.1)
    assert answer.age == 2 and torch.equal(answer.params, torch.full((3,), 3.0))  # before b merged
    a.on_reply(answer, now=0.2)
    # age-weighted: b keeps 2/3 of itself, a takes 2/3 of b's
    assert torch.allclose(b.params, torch.full((3,), 3.0 * 2 / 3 + 1.0 / 3))
    assert torch.allclose(a.params, torch.full((3,), 1.0 / 3 + 3.0 * 2 / 3))
    assert a.age == b.age == 2 and a.merges == b.merges == 1


def test_message_is_a_snapshot():
    a = _node("a", 0.0, ("b",))
    push = a.start_exchange(0.0)
    a.local_update(torch.full((3,), 9.0))
    assert push.params.sum() == 0


def test_unanswered_push_is_a_failure_and_removes_the_peer():
    a = _node("a", 0.0, ("b", "c"))
    a.membership.max_failures = 1
    push = a.start_exchange(0.0)
    assert a.expire(1.0) == []
    assert a.expire(3.0) == [push.target]
    assert push.target not in a.membership.view


def test_models_too_far_behind_are_not_merged():
    a, b = _node("a", 0.0, ("b",), MergeRule("age", max_age_gap=2)), _node("b", 5.0, ("a",))
    for _ in range(5):
        a.local_update(torch.full((3,), 1.0))
    a.on_push(b.start_exchange(0.0), 0.0)
    assert torch.equal(a.params, torch.full((3,), 1.0)) and a.skipped == 1
