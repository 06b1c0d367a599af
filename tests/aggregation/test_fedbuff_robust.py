"""FedBuff with a robust rule over its K buffered updates, and FedAsync's norm bound."""

import pytest
import torch

from shoal.aggregation import FedAvgM, FedAvgOpt
from shoal.aggregation.fedasync import FedAsync
from shoal.aggregation.fedbuff import FedBuff
from shoal.aggregation.mean import WeightedMean
from shoal.aggregation.robust import CoordinateMedian, NormBound, TrimmedMean
from shoal.aggregation.staleness import make_staleness_weight
from shoal.update import Update

DELTAS = [[1.0, 10.0, -2.0], [2.0, -5.0, 0.0], [100.0, 0.0, 4.0]]


def fill(fb: FedBuff, staleness=(0, 1, 0), examples=(1, 1, 1)) -> None:
    for d, t, n in zip(DELTAS, staleness, examples):
        fb.accumulate(Update(torch.tensor(d), n), staleness=t)


def test_fedbuff_median_step_hand_computed():
    # s(t) = 1 / (1 + t): the stale second update enters as 0.5 [2, -5, 0] = [1, -2.5, 0].
    # Per coordinate, median of {1, 1, 100} = 1, of {10, -2.5, 0} = 0, of {-2, 0, 4} = 0.
    # FedAvg server at lr 0.5: x + 0.5 [1, 0, 0].
    fb = FedBuff(3, FedAvgOpt(0.5), make_staleness_weight("polynomial", a=1.0), rule=CoordinateMedian(3))
    fill(fb)
    assert fb.full
    new = fb.flush(torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(new, torch.tensor([1.5, 1.0, 1.0]))
    assert fb.count == 0 and fb.rule.count == 0
    with pytest.raises(RuntimeError, match="empty"):
        fb.flush(new)


def test_fedbuff_trimmed_mean_drops_the_outlier_per_coordinate():
    # beta = 0.34 with K = 3 trims one value at each end: the trimmed mean is the median here
    fb = FedBuff(3, FedAvgOpt(1.0), make_staleness_weight("polynomial", a=1.0), rule=TrimmedMean(3, 0.34))
    fill(fb)
    assert torch.equal(fb.flush(torch.zeros(3)), torch.tensor([1.0, 0.0, 0.0]))


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_weighted_mean_rule_is_plain_fedbuff(weighting):
    plain = FedBuff(3, FedAvgOpt(1.0), make_staleness_weight("polynomial", a=0.5), weighting)
    ruled = FedBuff(3, FedAvgOpt(1.0), make_staleness_weight("polynomial", a=0.5), weighting, rule=WeightedMean(3))
    for fb in (plain, ruled):
        fill(fb, staleness=(0, 3, 1), examples=(10, 30, 5))
    x = torch.tensor([0.5, -1.0, 2.0])
    torch.testing.assert_close(ruled.flush(x), plain.flush(x))


def test_norm_bound_clips_each_buffered_update():
    # bound 1: [3, 4] -> [0.6, 0.8]; [0, 0.5] is inside. Mean = [0.3, 0.65].
    fb = FedBuff(2, FedAvgOpt(1.0), make_staleness_weight("constant"), rule=NormBound(WeightedMean(2), 1.0))
    fb.accumulate(Update(torch.tensor([3.0, 4.0]), 1), 0)
    fb.accumulate(Update(torch.tensor([0.0, 0.5]), 1), 0)
    torch.testing.assert_close(fb.flush(torch.zeros(2)), torch.tensor([0.3, 0.65]))


def test_partly_filled_robust_buffer_survives_a_checkpoint():
    def make():
        return FedBuff(3, FedAvgM(1.0, 0.5), make_staleness_weight("polynomial", a=1.0), rule=CoordinateMedian(3))

    a = make()
    a.accumulate(Update(torch.tensor(DELTAS[0]), 1), 0)
    a.accumulate(Update(torch.tensor(DELTAS[1]), 1), 1)
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.count == 2
    for fb in (a, b):
        fb.accumulate(Update(torch.tensor(DELTAS[2]), 1), 0)
    x = torch.zeros(3)
    assert torch.equal(a.flush(x), b.flush(x))


def test_fedasync_norm_bound_scales_the_delta_before_mixing():
    fa = FedAsync(0.5, make_staleness_weight("constant"), norm_bound=1.0)
    new = fa.apply(torch.zeros(2), Update(torch.tensor([6.0, 8.0]), 1), staleness=0)
    torch.testing.assert_close(new, torch.tensor([0.3, 0.4]))  # 0.5 * [6, 8] / 10
    assert fa.clipped == 1
    small = fa.apply(torch.zeros(2), Update(torch.tensor([0.6, 0.0]), 1), staleness=0)
    torch.testing.assert_close(small, torch.tensor([0.3, 0.0]))
    assert fa.clipped == 1
