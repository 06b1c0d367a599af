import math

import pytest

from shoal.aggregation.staleness import make_staleness_weight, staleness_weight


def test_constant_is_one_at_any_staleness():
    assert [staleness_weight("constant", t) for t in (0, 1, 7, 1000)] == [1.0] * 4


def test_polynomial_hand_values():
    # (1 + t)^-0.5: FedBuff's 1/sqrt(1 + t)
    assert staleness_weight("polynomial", 0) == 1.0
    assert staleness_weight("polynomial", 3) == 0.5
    assert staleness_weight("polynomial", 8) == pytest.approx(1 / 3)
    # a = 1: 1/(1 + t)
    assert staleness_weight("polynomial", 4, a=1.0) == 0.2
    assert staleness_weight("polynomial", 5, a=2.0) == pytest.approx(1 / 36)


def test_hinge_hand_values():
    # Xie et al.: 1 for t <= b, then 1 / (a (t - b) + 1)
    assert [staleness_weight("hinge", t, a=0.5, b=4) for t in (0, 4)] == [1.0, 1.0]
    assert staleness_weight("hinge", 5, a=0.5, b=4) == pytest.approx(1 / 1.5)
    assert staleness_weight("hinge", 10, a=0.5, b=4) == 0.25
    assert staleness_weight("hinge", 12, a=10.0, b=2) == pytest.approx(1 / 101)


@pytest.mark.parametrize("kind", ["constant", "polynomial", "hinge"])
def test_weights_start_at_one_and_never_increase(kind):
    ws = [staleness_weight(kind, t, a=0.7, b=3) for t in range(60)]
    assert ws[0] == 1.0
    assert all(0 < w <= 1 and math.isfinite(w) for w in ws)
    assert all(b <= a for a, b in zip(ws, ws[1:]))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="staleness = -1"):
        staleness_weight("polynomial", -1)
    with pytest.raises(ValueError, match="'exp' is not one of"):
        staleness_weight("exp", 1)
    with pytest.raises(ValueError, match="'exp' is not one of"):
        make_staleness_weight("exp")  # checked when made, not at the first update
    assert make_staleness_weight("hinge", a=0.5, b=1)(3) == 0.5
