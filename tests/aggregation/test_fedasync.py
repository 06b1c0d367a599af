import pytest
import torch

from shoal.aggregation.fedasync import FedAsync
from shoal.aggregation.staleness import make_staleness_weight
from shoal.update import Update

X = torch.tensor([1.0, 2.0, -4.0])
DELTA = torch.tensor([2.0, -2.0, 8.0])


def test_fresh_update_moves_alpha_of_the_way():
    fa = FedAsync(0.5, make_staleness_weight("constant"))
    new = fa.apply(X, Update(DELTA, 3), staleness=0)
    # x + 0.5 * delta
    assert torch.equal(new, torch.tensor([2.0, 1.0, 0.0]))
    assert torch.equal(X, torch.tensor([1.0, 2.0, -4.0]))  # input untouched


def test_stale_update_model_mix_is_xie_rule():
    # alpha_t = 0.6 * (1 + 3)^-0.5 = 0.3;  x <- 0.7 x + 0.3 (base + delta)
    fa = FedAsync(0.6, make_staleness_weight("polynomial", a=0.5), mix="model")
    base = torch.tensor([0.0, 0.0, 0.0])
    new = fa.apply(X, Update(DELTA, 1), staleness=3, base=base)
    expected = 0.7 * X + 0.3 * (base + DELTA)  # [1.3, 0.8, -0.4]
    assert torch.allclose(new, expected, atol=1e-6)
    assert torch.allclose(new, torch.tensor([1.3, 0.8, -0.4]), atol=1e-6)


def test_stale_update_delta_mix_applies_progress_to_current_model():
    # hinge a=0.5 b=1 at t=3: 1/(0.5*2+1) = 0.5; alpha_t = 0.8 * 0.5 = 0.4
    fa = FedAsync(0.8, make_staleness_weight("hinge", a=0.5, b=1), mix="delta")
    assert fa.alpha_t(3) == pytest.approx(0.4)
    new = fa.apply(X, Update(DELTA, 1), staleness=3)
    assert torch.allclose(new, torch.tensor([1.8, 1.2, -0.8]), atol=1e-6)


def test_model_mix_needs_the_base_of_a_stale_update():
    fa = FedAsync(0.5, make_staleness_weight("constant"))
    with pytest.raises(ValueError, match="base model"):
        fa.apply(X, Update(DELTA, 1), staleness=2)


def test_alpha_range():
    with pytest.raises(ValueError, match="alpha"):
        FedAsync(0.0, make_staleness_weight("constant"))
    with pytest.raises(ValueError, match="mix"):
        FedAsync(0.5, make_staleness_weight("constant"), mix="avg")
