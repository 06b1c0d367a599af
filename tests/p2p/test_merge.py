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

    b = MergeBound(1.0, 1e4)
    own = torch.full((4,), 2.0)  # ||own|| = 4
    for huge in (torch.finfo(torch.float32).max, 1e30, 1e5):
        assert b.apply(own, torch.full((4,), huge)) is None
    assert b.refused == 3
    far = own + torch.tensor([100.0, 0, 0, 0])
    clipped = b.apply(own, far)
    assert clipped is not None and torch.isclose(torch.linalg.vector_norm(clipped - own), torch.tensor(4.0))
    assert b.clipped == 1 and b.recent == []  # a clipped merge does not widen the bound
    near = own + 0.5
    assert torch.equal(b.apply(own, near), near) and b.recent == [1.0]
    assert MergeBound(1.0, 1e4, "reject").apply(own, far) is None
    off = MergeBound(0.0, 0.0)
    assert torch.equal(off.apply(own, far), far)
    assert off.apply(own, torch.full((4,), float("inf"))) is None  # never a non-finite model


def test_merge_bound_cannot_be_ratcheted_by_models_just_inside_it():
    """A stream of models each just inside the bound grows it at most by the relative factor
    per RECENT_MERGES / 2 merges, and never past max_abs."""
    from shoal.p2p.merge import MergeBound

    b = MergeBound(1.0, 1e4)
    own = torch.zeros(10)
    for _ in range(200):
        limit = b.limit(own)
        direction = torch.zeros(10)
        direction[0] = 1.0
        other = b.apply(own, own + direction * limit * 0.999)
        if other is None:
            break
        own = own.lerp(other, 0.5)
        assert torch.isfinite(own).all() and float(own.abs().max()) <= 1e4
