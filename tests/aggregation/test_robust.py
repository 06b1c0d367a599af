import pytest
import torch

from shoal.aggregation import make_strategy
from shoal.aggregation.mean import EmptyAggregate, WeightedMean
from shoal.aggregation.robust import CoordinateMedian, MultiKrum, NormBound, TrimmedMean, make_aggregator
from shoal.config import RobustConfig, StrategyConfig
from shoal.update import Update


def feed(rule, rows, weights=None):
    for i, r in enumerate(rows):
        rule.add(torch.as_tensor(r, dtype=torch.float32), 1.0 if weights is None else weights[i])
    return rule.mean()


def test_median_odd_and_even_ignores_weights():
    assert torch.equal(feed(CoordinateMedian(2), [[1, 9], [5, -3], [100, 0]], [1, 1, 50]), torch.tensor([5.0, 0.0]))
    assert torch.equal(feed(CoordinateMedian(1), [[1], [2], [4], [100]]), torch.tensor([3.0]))


def test_median_matches_torch_across_column_slices():
    x = torch.randn(7, 70_001)  # more than one 65,536-coordinate slice
    assert torch.equal(feed(CoordinateMedian(x.shape[1]), x), x.median(dim=0).values)


def test_trimmed_mean_drops_each_tail():
    rows = [[1.0], [2.0], [3.0], [4.0], [1000.0]]
    assert feed(TrimmedMean(1, beta=0.2), rows).item() == pytest.approx(3.0)
    assert feed(TrimmedMean(1, beta=0.0), rows).item() == pytest.approx(202.0)


def honest_and_byzantine(n_honest=8, n_bad=2, d=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    honest = torch.randn(n_honest, d, generator=g) * 0.1 + 1.0
    bad = torch.randn(n_bad, d, generator=g) * 50.0
    return honest, bad


def test_krum_and_multikrum_keep_only_honest_updates():
    honest, bad = honest_and_byzantine()
    rows = torch.cat([bad[:1], honest, bad[1:]])
    krum = MultiKrum(50, f=2, m=1)
    feed(krum, rows)
    assert krum.selected()[0] not in (0, 9)
    mk = MultiKrum(50, f=2, m=0)  # m = n - f = 8: exactly the honest ones
    out = feed(mk, rows)
    assert sorted(mk.selected()) == list(range(1, 9))
    torch.testing.assert_close(out, honest.mean(0))


def test_krum_scores_are_sums_of_nearest_squared_distances():
    rows = torch.tensor([[0.0], [1.0], [3.0], [10.0], [11.0]])
    k = MultiKrum(1, f=1, m=1)
    feed(k, rows)
    # n - f - 2 = 2 nearest: 0 -> {1, 9}; 1 -> {1, 4}; 3 -> {4, 9}; 10 -> {1, 49}; 11 -> {1, 64}
    assert k.scores().tolist() == [10.0, 5.0, 13.0, 50.0, 65.0]


def test_krum_needs_more_than_2f_plus_2_updates():
    k = MultiKrum(3, f=2)
    for row in torch.randn(6, 3):
        k.add(row, 1.0)
    with pytest.raises(ValueError, match="more than 2f \\+ 2 = 6"):
        k.mean()


def test_norm_bound_clips_and_counts():
    nb = NormBound(WeightedMean(2), bound=1.0)
    out = feed(nb, [[3.0, 4.0], [0.3, 0.4]])
    torch.testing.assert_close(out, torch.tensor([0.45, 0.6]))
    assert nb.clipped == 1 and nb.count == 2
    nb.reset()
    assert nb.clipped == 0 and nb.count == 0


def test_buffer_is_bounded_and_copies():
    rule = CoordinateMedian(2, max_updates=2)
    d = torch.ones(2)
    rule.add(d, 1.0)
    d.fill_(5.0)  # the caller reuses its tensor: the rule kept a copy
    rule.add(torch.zeros(2), 1.0)
    with pytest.raises(ValueError, match="max_updates"):
        rule.add(torch.zeros(2), 1.0)
    assert torch.equal(rule.mean(), torch.full((2,), 0.5))
    rule.reset()
    with pytest.raises(EmptyAggregate):
        rule.mean()


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum", "multikrum"])
def test_rules_plug_into_a_strategy_and_resist_x100_scaling(rule):
    honest, _ = honest_and_byzantine(n_honest=8, n_bad=0)
    cfg = RobustConfig(rule=rule, trim_beta=0.2, krum_f=2)
    strategy = make_strategy(StrategyConfig(weighting="uniform"), 50, aggregator=make_aggregator(cfg, 50))
    strategy.begin(torch.zeros(50))
    for h in honest:
        strategy.accumulate(Update(delta=h, num_examples=10))
    for h in honest[:2]:  # two attackers boost honest-looking updates x100
        strategy.accumulate(Update(delta=-100 * h, num_examples=10))
    new = strategy.finalize()
    assert (new - honest.mean(0)).abs().max() < 0.5
    fedavg = make_strategy(StrategyConfig(weighting="uniform"), 50)
    fedavg.begin(torch.zeros(50))
    for h in [*honest, *(-100 * honest[:2])]:
        fedavg.accumulate(Update(delta=h, num_examples=10))
    assert (fedavg.finalize() - honest.mean(0)).abs().max() > 10


def test_make_aggregator_wraps_norm_bound():
    agg = make_aggregator(RobustConfig(rule="median", norm_bound=2.0), 4)
    assert isinstance(agg, NormBound) and isinstance(agg.inner, CoordinateMedian)
    assert isinstance(make_aggregator(RobustConfig(), 4), WeightedMean)
