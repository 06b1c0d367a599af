"""Merge rules: average, example-weighted, age-weighted, staleness, max age gap."""

from __future__ import annotations

import pytest
import torch

from shoal.p2p.merge import MergeRule, ModelInfo


def test_weights_of_the_three_rules():
    own, other = ModelInfo(age=3, num_examples=10), ModelInfo(age=1, num_examples=30)
    assert MergeRule("average").weight(own, other) == 0.5
    assert MergeRule("examples").weight(own, other) == pytest.approx(0.75)
    assert MergeRule("age").weight(own, other) == pytest.approx(0.25)
    assert MergeRule("age").weight(ModelInfo(0, 1), ModelInfo(0, 1)) == 0.5


def test_staleness_discount_only_for_models_behind():
    rule = MergeRule("average", staleness_exponent=1.0)
    assert rule.weight(ModelInfo(5, 1), ModelInfo(2, 1)) == pytest.approx(0.5 / 4)
    assert rule.weight(ModelInfo(2, 1), ModelInfo(5, 1)) == 0.5


def test_max_age_gap_skips_far_behind_and_adopts_far_ahead():
    rule = MergeRule("age", max_age_gap=10)
    own = torch.zeros(4)
    lam, info = rule.merge(own, ModelInfo(50, 5), torch.ones(4), ModelInfo(30, 5))
    assert lam == 0.0 and info.age == 50 and own.sum() == 0
    lam, info = rule.merge(own, ModelInfo(0, 5), torch.full((4,), 2.0), ModelInfo(30, 7))
    assert lam == 1.0 and info == ModelInfo(30, 5) and torch.equal(own, torch.full((4,), 2.0))


def test_merge_is_the_convex_combination_and_age_is_the_max():
    own = torch.tensor([0.0, 4.0])
    lam, info = MergeRule("age").merge(own, ModelInfo(1, 1), torch.tensor([4.0, 0.0]), ModelInfo(3, 1))
    assert lam == pytest.approx(0.75)
    assert torch.allclose(own, torch.tensor([3.0, 1.0]))
    assert info.age == 3


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError):
        MergeRule("median")


def test_norm_bound_clips_the_pull_of_a_hostile_model():
    rule = MergeRule("average", norm_bound=1.0)
    own = torch.zeros(4)
    lam, _ = rule.merge(own, ModelInfo(1, 1), torch.full((4,), 100.0), ModelInfo(1, 1))
    assert lam == 0.5
    assert float(own.norm()) == pytest.approx(0.5)  # lam * bound, not lam * 200
    near = torch.tensor([0.1, 0.0, 0.0, 0.0])
    plain, clipped = torch.zeros(4), torch.zeros(4)
    MergeRule("average").merge(plain, ModelInfo(1, 1), near, ModelInfo(1, 1))
    rule.merge(clipped, ModelInfo(1, 1), near, ModelInfo(1, 1))
    assert torch.equal(plain, clipped)  # inside the bound: the plain merge


def test_norm_bound_also_clips_adoption_of_a_model_claiming_a_huge_age():
    rule = MergeRule("age", max_age_gap=5, norm_bound=2.0)
    own = torch.zeros(3)
    lam, info = rule.merge(own, ModelInfo(1, 1), torch.full((3,), -50.0), ModelInfo(10**9, 1))
    assert lam == 1.0 and float(own.norm()) == pytest.approx(2.0)


def test_reject_mode_ignores_a_model_beyond_the_bound():
    rule = MergeRule("average", norm_bound=1.0, bound_mode="reject")
    own = torch.zeros(4)
    lam, info = rule.merge(own, ModelInfo(2, 1), torch.full((4,), 100.0), ModelInfo(9, 1))
    assert lam == 0.0 and info == ModelInfo(2, 1) and own.sum() == 0
    lam, _ = rule.merge(own, ModelInfo(2, 1), torch.full((4,), 0.25), ModelInfo(2, 1))
    assert lam == 0.5 and torch.allclose(own, torch.full((4,), 0.125))


def test_merge_bound_refuses_huge_values_and_clips_far_models():
    from shoal.p2p.merge import MergeBound

    b = MergeBound(2.0, 1e4)
    own = torch.full((4,), 2.0)
    for huge in (torch.finfo(torch.float32).max, 1e30, 1e5):
        assert b.apply(own, torch.full((4,), huge), "x") is None
    assert b.refused == 3
    b.local_step(0.5)  # our own step sets the floor of the radius: 2 x 0.5
    assert b.radius() == pytest.approx(1.0)
    far = own + torch.tensor([3.0, 0, 0, 0])  # beyond the radius, within far x radius: clipped
    clipped = b.apply(own, far, "x")
    assert clipped is not None and torch.isclose(torch.linalg.vector_norm(clipped - own), torch.tensor(1.0))
    assert b.clipped == 1 and b.distances["x"] == pytest.approx(1.0)  # recorded clipped to the radius
    assert MergeBound(2.0, 1e4, "reject", radius=1.0).apply(own, far) is None
    assert b.apply(own, own + torch.tensor([100.0, 0, 0, 0]), "y") is None  # beyond far x radius: refused
    assert b.refused == 4 and b.distances["y"] == pytest.approx(1.0)
    clip_all = MergeBound(2.0, 1e4, radius=1.0, far=0.0)  # far = 0: clipped however far
    assert clip_all.apply(own, own + torch.tensor([100.0, 0, 0, 0])) is not None
    off = MergeBound(0.0, 0.0, drift=0.0)
    assert torch.equal(off.apply(own, far), far)
    assert off.apply(own, torch.full((4,), float("inf"))) is None  # never a non-finite model


def test_the_radius_follows_the_honest_spread_not_the_norm():
    """Honest neighbours 0.3 apart set the radius (2 x their lower median), however large our
    model's norm and whatever one sender writes, however often."""
    from shoal.p2p.merge import MergeBound

    b = MergeBound(2.0, 1e6)
    own = torch.full((100,), 50.0)  # norm 500: the old bound would have allowed 500
    b.local_step(0.1)
    for _ in range(20):  # the radius grows to the honest spread in a few rounds (x2 each)
        for k in range(4):
            b.apply(own, own + 0.3 * torch.eye(100)[k], f"honest{k}")
    assert b.radius() == pytest.approx(0.6, rel=1e-4)
    for _ in range(1000):  # one insider, far off, a thousand times: one slot, clipped to the radius
        b.apply(own, own * 10, "insider")
    assert b.radius() == pytest.approx(0.6, rel=1e-4)
    assert len(b.distances) == 6  # our step, four honest senders, the insider


def test_the_window_holds_one_slot_per_sender_and_is_bounded():
    from shoal.p2p.merge import SELF, MergeBound

    b = MergeBound(2.0, 1e4, window=4)
    b.local_step(1.0)
    own = torch.zeros(3)
    for k in range(10):
        b.apply(own, torch.tensor([0.5, 0.0, 0.0]), f"s{k}")
    assert len(b.distances) == 4 and SELF in b.distances  # our own step is never pushed out
    assert list(b.distances)[-1] == "s9"


def test_the_drift_budget_caps_how_far_merges_move_a_model_between_local_steps():
    from shoal.p2p.merge import MergeBound

    b = MergeBound(2.0, 1e4, radius=1.0, drift=3.0, far=0.0)  # far = 0: the flood is clipped, not refused
    own = torch.zeros(5)
    start = own.clone()
    target = torch.full((5,), 100.0)
    moved = [b.move(own, b.apply(own, target, "a"), 0.5) for _ in range(50)]  # a flood of merges
    assert float(torch.linalg.vector_norm(own - start)) == pytest.approx(3.0, rel=1e-5)
    assert moved[:6] == [0.5] * 6 and moved[-1] == 0.0 and b.capped > 0
    b.local_step(0.1)  # the next local step opens a new budget
    assert b.move(own, b.apply(own, target, "a"), 0.5) == 0.5


def test_a_flood_of_scaled_models_moves_an_honest_model_by_a_bounded_amount():
    """An insider pushing 10x its model a thousand times between two local steps, with clipping
    alone (far = 0: no refusal): the honest model moves at most drift x radius, not x (1 + lam)
    per merge as a norm-relative bound allowed."""
    from shoal.p2p.gossip import GossipNode, ModelMessage
    from shoal.p2p.membership import Membership
    from shoal.p2p.merge import MergeBound

    clip_only = MergeBound(far=0.0)
    node = GossipNode(
        Membership("me", 4, 2, bootstrap_peers=("h",)), torch.zeros(50), 10, MergeRule("average"), bound=clip_only
    )
    torch.manual_seed(0)
    trained = torch.randn(50)
    node.local_update(trained)  # one local step of length ||trained||
    tau = node.merge_bound.radius()
    for k in range(1000):
        node.on_push(ModelMessage("evil", "me", trained * 10, 1, 1, 10, seq=k + 1), now=0.0)
    assert float(torch.linalg.vector_norm(node.params - trained)) <= node.merge_bound.drift * tau * (1 + 1e-5)
    assert node.merge_bound.capped > 0


def test_a_sign_flipped_model_moves_nothing_and_a_fresh_peer_still_catches_up():
    """A sign-flipped x10 model (x0 - 10 (x - x0)) lies 11 times as far from an honest model as
    that model has come from the start, far beyond far x radius too: refused, so a thousand of
    them move the model not at all (clipping alone moved it by the radius each merge, in one
    direction). A fresh peer (no local step yet) adopts a far-off honest model at once; its own
    model, the start, points back along our travel and is refused too."""
    from shoal.p2p.gossip import GossipNode, ModelMessage
    from shoal.p2p.membership import Membership

    node = GossipNode(Membership("me", 4, 2, bootstrap_peers=("h",)), torch.zeros(50), 10, MergeRule("average"))
    torch.manual_seed(0)
    node.local_update(torch.randn(50))
    trained = node.params + 0.01 * torch.randn(50)
    node.local_update(trained)  # a short step: the radius is 2 x its length
    for k, h in enumerate(("h1", "h2")):  # two honest neighbours with our model: merged
        node.on_push(ModelMessage(h, "me", trained.clone(), 1, 1, 10, seq=k + 1), now=0.0)
    for k in range(1000):
        node.on_push(ModelMessage("evil", "me", -10 * trained, 1, 1, 10, seq=k + 1), now=0.0)
    assert torch.equal(node.params, trained) and node.merge_bound.refused == 1000 and node.merges == 2
    fresh = GossipNode(Membership("new", 4, 2, bootstrap_peers=("me",)), torch.zeros(50), 10, MergeRule("age"))
    answer = node.on_push(ModelMessage("new", "me", fresh.params.clone(), 0, 0, 10, seq=1), now=0.0)
    # the fresh peer's model is where we started: it would undo our training, held to far x tau: refused
    assert torch.equal(node.params, trained) and node.merge_bound.refused == 1001
    fresh.on_reply(answer, now=0.0)
    assert torch.equal(fresh.params, trained)  # adopted whole (age rule, its own age 0)


def test_a_neighbourhood_that_moved_together_is_followed_a_lone_far_insider_is_refused():
    """Four honest senders all move far off together (a partition healed, or we are the one that
    drifted): once most live senders are beyond far x tau we are the outlier, and their models
    are clipped toward, not refused. One insider far off, however often it writes, stays refused;
    a sender not heard from for ``horizon`` local steps leaves the window and its vote."""
    from shoal.p2p.merge import SELF, MergeBound

    b = MergeBound(2.0, 1e4, horizon=8)
    own = torch.zeros(10)
    b.local_step(0.1)
    honest = [f"h{k}" for k in range(4)]
    for k, h in enumerate(honest):  # near neighbours: the radius is 2 x their lower median
        assert b.apply(own, own + 0.1 * torch.eye(10)[k], h) is not None
    tau = b.radius()
    assert tau == pytest.approx(0.2)
    for _ in range(100):  # a lone insider, far off: one vote of five, refused every time
        assert b.apply(own, own + 100.0, "insider") is None
    assert b.refused == 100 and not b.outvoted()
    moved = own + 50 * tau * torch.ones(10) / 10**0.5  # the whole neighbourhood, 50 radii away
    taken = [b.apply(own, moved + 0.01 * torch.eye(10)[k], h) for k, h in enumerate(honest)]
    # h0: two far votes of five (with the insider's): refused; h1 makes three of five: followed
    assert taken[0] is None and all(t is not None for t in taken[1:])
    assert float(torch.linalg.vector_norm(taken[1] - own)) == pytest.approx(tau, rel=1e-5)  # clipped to tau
    assert b.followed == 3 and b.outvoted()
    for _ in range(9):  # nobody heard for more than the horizon: the window is our own step alone
        b.local_step(0.1)
    assert set(b.distances) == {SELF} and not b.beyond and b.radius() == pytest.approx(0.2)
    assert b.apply(own, own + 100.0, "insider") is None  # alone, the insider is never followed


def test_peers_pulled_apart_come_back_together_and_a_restarted_peer_catches_up():
    """Two groups of three GossipNodes, each peer pulled toward its own optimum (the groups' optima
    13 apart), gossip within their group only for 40 steps (a partition): far beyond far x tau of
    each other. Then push-pull between all of them, on a virtual clock: with the default bound
    (refuse beyond far x tau, unless most live senders are that far) the groups merge into one
    again (refusing alone kept them apart), then every model a sign-flipping insider pushes to
    them is refused. A
    peer restarted from scratch (model reset) catches up with the others."""
    from shoal.p2p.gossip import GossipNode, ModelMessage
    from shoal.p2p.membership import Membership

    torch.manual_seed(0)
    ids = [f"p{k}" for k in range(6)]
    nodes = [GossipNode(Membership(i, 5, 2, bootstrap_peers=tuple(set(ids) - {i})), torch.zeros(20), 10) for i in ids]
    optimum = [torch.full((20,), 3.0 * (k // 3) + 0.1 * k) for k in range(6)]
    count = iter(range(1, 10**6))
    x0 = torch.zeros(20)

    def seq(now: float) -> int:  # message counters are wall-clock microseconds (p2p/freshness.py)
        return int(now * 1e6) + next(count)

    def train(k: int) -> None:  # one local step: 10% of the way to the peer's own optimum, plus noise
        n = nodes[k]
        n.local_update(n.params + 0.1 * (optimum[k] - n.params) + 0.01 * torch.randn(20))

    def exchange(k: int, now: float, among: range) -> None:
        n, peer = nodes[k], ids[among[int(torch.randint(len(among), ()))]]
        if peer != n.id:
            push = ModelMessage(n.id, peer, n.params.clone(), n.age, n.version, 10, False, seq(now))
            n.on_reply(nodes[ids.index(peer)].on_push(push, now), now)

    def gap() -> float:  # distance between the two groups' mean models
        return float(torch.linalg.vector_norm(sum(n.params for n in nodes[:3]) - sum(n.params for n in nodes[3:]))) / 3

    for step in range(40):  # partitioned: each group gossips on its own
        for k in range(6):
            train(k)
            exchange(k, float(step), range(3 * (k // 3), 3 * (k // 3) + 3))
    assert gap() > 10 > 4 * max(n.merge_bound.radius() for n in nodes) * 10
    for step in range(40, 240):  # healed: gossip between all of them
        for k in range(6):
            train(k)
            exchange(k, float(step), range(6))
    # the far group was followed: 1.79 apart, as with clipping alone (far = 0); refusing kept them 14.7 apart
    assert gap() < 3.0 and sum(n.merge_bound.followed for n in nodes) > 0
    refused = [n.merge_bound.refused for n in nodes]
    for step in range(240, 340):  # an insider pushes its sign flip to everyone, every step: refused
        for k in range(6):
            train(k)
            exchange(k, float(step), range(6))
            evil = ModelMessage("evil", ids[k], x0 - 10 * (nodes[k].params - x0), 10**6, 1, 10, False, seq(step))
            nodes[k].on_push(evil, float(step))
    assert all(n.merge_bound.refused - r >= 100 for n, r in zip(nodes, refused, strict=True)) and gap() < 3.0
    nodes[0].restart(torch.zeros(20))
    for step in range(340, 440):
        for k in range(6):
            train(k)
            exchange(k, float(step), range(6))
    assert float(torch.linalg.vector_norm(nodes[0].params - nodes[1].params)) < 1.0  # its group's neighbour


def test_a_peer_ahead_in_age_follows_a_far_majority_behind_it():
    """With ``max_age_gap`` a model far behind ours in age is not merged. A group that ran ahead
    in age while apart would then skip the larger group's models for good, while that group
    refuses its far ones. Such a model still takes its sender's slot and vote: a lone one is
    skipped, but once most live senders are far, their models are merged (clipped to tau)."""
    from shoal.p2p.gossip import GossipNode, ModelMessage
    from shoal.p2p.membership import Membership

    node = GossipNode(
        Membership("me", 4, 2, bootstrap_peers=("a",)), torch.zeros(10), 10, MergeRule("age", max_age_gap=20)
    )
    for _ in range(100):  # far ahead in age: 100 local steps of length 0.1
        node.local_update(node.params + 0.01)
    own = node.params.clone()
    far = own + 10.0  # behind by 90 in age, hundreds of radii away
    node.on_push(ModelMessage("a", "me", far.clone(), 10, 10, 10, seq=1), now=0.0)
    assert torch.equal(node.params, own) and node.skipped == 1  # a lone far sender: skipped
    node.on_push(ModelMessage("b", "me", far.clone(), 10, 10, 10, seq=1), now=0.0)
    moved = float(torch.linalg.vector_norm(node.params - own))
    assert 0 < moved <= node.merge_bound.radius() * (1 + 1e-5) and node.merge_bound.followed == 1


def test_a_data_heavy_minority_is_merged_and_a_sign_flipping_insider_refused():
    """Four peers take short local steps, two hold more data and take steps about 6x longer
    toward an optimum of their own. Right after each of its steps a heavy peer lies beyond
    ``far x tau`` of the light peers, whose radius comes from their short steps (measured on this
    test: by the radius alone the light peers refused 26 to 45 of the heavy peers' models each,
    and the groups' means ended 1.19 apart instead of 0.86). It lies well within ``far x`` how
    far a light peer's model has come from the start they share, so it is clipped and merged.
    A sign-flipped x2 model lies only 3 times that far, but it points back toward the start, so
    it is held to ``far x tau`` and refused by every peer, heavy or not."""
    from shoal.p2p.gossip import GossipNode, ModelMessage
    from shoal.p2p.membership import Membership

    torch.manual_seed(0)
    ids = [f"p{k}" for k in range(6)]
    heavy = {4, 5}
    x0 = torch.randn(20)
    nodes = [GossipNode(Membership(i, 5, 2, bootstrap_peers=tuple(set(ids) - {i})), x0.clone(), 10) for i in ids]
    base, apart = torch.randn(20), torch.randn(20)
    optimum = [x0 + base + (apart if k in heavy else 0) + 0.1 * torch.randn(20) for k in range(6)]
    count = iter(range(1, 10**6))
    lengths: dict[bool, list[float]] = {False: [], True: []}

    def seq(now: float) -> int:
        return int(now * 1e6) + next(count)

    def train(k: int) -> None:  # the heavy peers go 25% of the way to their optimum a step, the others 10%
        n, (rate, noise) = nodes[k], (0.25, 0.03) if k in heavy else (0.1, 0.01)
        new = n.params + rate * (optimum[k] - n.params) + noise * torch.randn(20)
        lengths[k in heavy].append(float(torch.linalg.vector_norm(new - n.params)))
        n.local_update(new)

    def exchange(k: int, now: float) -> None:
        n, peer = nodes[k], int(torch.randint(6, ()))
        if peer != k:
            push = ModelMessage(n.id, ids[peer], n.params.clone(), n.age, n.version, 10, False, seq(now))
            n.on_reply(nodes[peer].on_push(push, now), now)

    for step in range(100):
        for k in range(6):
            train(k)
            exchange(k, float(step))
    light, steps = [n for k, n in enumerate(nodes) if k not in heavy], {h: sum(v) / len(v) for h, v in lengths.items()}
    assert steps[True] > 4 * steps[False]  # the heavy peers' steps are much longer
    assert all(n.merge_bound.refused <= 1 for n in light)  # their models are merged, not refused
    mean = [sum(n.params for k, n in enumerate(nodes) if (k in heavy) == h) / (2 if h else 4) for h in (False, True)]
    assert float(torch.linalg.vector_norm(mean[0] - mean[1])) < 1.0
    refused = [n.merge_bound.refused for n in nodes]
    for step in range(100, 120):  # an insider pushes its sign flip to every peer, every step
        for k in range(6):
            train(k)
            exchange(k, float(step))
            evil = ModelMessage("evil", ids[k], x0 - 2 * (nodes[k].params - x0), 10**6, 1, 10, False, seq(step))
            nodes[k].on_push(evil, float(step))
    assert all(n.merge_bound.refused - r == 20 for n, r in zip(nodes, refused, strict=True))
