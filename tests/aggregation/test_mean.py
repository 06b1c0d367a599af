import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.aggregation import EmptyAggregate, WeightedMean


def test_example_weighted_mean_is_exact():
    m = WeightedMean(4)
    m.add(torch.tensor([1.0, 2.0, 3.0, 4.0]), 1)
    m.add(torch.tensor([0.0, -2.0, 4.0, 8.0]), 2)
    m.add(torch.tensor([8.0, 0.0, -8.0, 16.0]), 5)
    # sum w*d = [1+0+40, 2-4+0, 3+8-40, 4+16+80] = [41, -2, -29, 100]; total weight 8
    out = m.mean()
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([41 / 8, -2 / 8, -29 / 8, 100 / 8]))
    assert m.count == 3 and m.total_weight == 8.0


def test_mean_is_a_new_tensor_and_reset_starts_over():
    m = WeightedMean(2)
    m.add(torch.tensor([2.0, 4.0]), 1.0)
    out = m.mean()
    out.fill_(99.0)
    assert torch.equal(m.mean(), torch.tensor([2.0, 4.0]))
    m.reset()
    assert m.count == 0 and m.total_weight == 0.0
    m.add(torch.tensor([1.0, 1.0]), 3.0)
    assert torch.equal(m.mean(), torch.tensor([1.0, 1.0]))


def test_empty_mean_raises():
    m = WeightedMean(3)
    with pytest.raises(EmptyAggregate, match="nothing to average"):
        m.mean()
    m.add(torch.ones(3), 1.0)
    m.reset()
    with pytest.raises(EmptyAggregate):
        m.mean()


@pytest.mark.parametrize("bad", [torch.ones(3), torch.ones(5), torch.ones(2, 2), torch.tensor(1.0)])
def test_shape_mismatch_raises(bad):
    m = WeightedMean(4)
    with pytest.raises(ValueError, match=r"expected \(4,\)"):
        m.add(bad, 1.0)
    assert m.count == 0


@pytest.mark.parametrize("w", [0.0, -1.0, math.nan, math.inf])
def test_bad_weight_raises(w):
    m = WeightedMean(2)
    with pytest.raises(ValueError, match="weight"):
        m.add(torch.ones(2), w)
    assert m.count == 0 and m.total_weight == 0.0


def test_numel_must_be_positive():
    with pytest.raises(ValueError):
        WeightedMean(0)


def _cancelling_deltas(n: int, numel: int) -> tuple[list[torch.Tensor], list[float]]:
    """Large positive deltas, then as many large negative ones, plus small noise: the
    running sum peaks at n/2 * 1e4 where a float32 ulp dwarfs the noise, and the mean is
    small."""
    g = torch.Generator().manual_seed(0)
    deltas, weights = [], []
    for i in range(n):
        sign = 1.0 if i < n // 2 else -1.0
        deltas.append(sign * 1e4 + torch.randn(numel, generator=g))
        weights.append(1.0)
    return deltas, weights


def _reference(deltas: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    d = torch.stack(deltas).double()
    w = torch.tensor(weights, dtype=torch.float64)
    return (w[:, None] * d).sum(0) / w.sum()


def test_float64_accumulator_is_within_one_float32_rounding_of_exact():
    """Why the default accumulator is float64: 1,000 cancelling deltas give the float32
    rounding of the float64 reference, while a float32 sum is off by orders more."""
    deltas, weights = _cancelling_deltas(1000, 256)
    ref = _reference(deltas, weights)
    errors = {}
    for dtype in (torch.float64, torch.float32):
        m = WeightedMean(256, dtype=dtype)
        for d, w in zip(deltas, weights):
            m.add(d, w)
        errors[dtype] = (m.mean().double() - ref).abs()
    # round-to-nearest float32 is within a relative 2**-24 of the exact value
    assert (errors[torch.float64] <= ref.abs() * 2**-24 * (1 + 1e-6)).all()
    assert errors[torch.float32].max() > 100 * errors[torch.float64].max()


def test_float64_accumulator_does_not_depend_on_arrival_order():
    deltas, _ = _cancelling_deltas(500, 256)
    g = torch.Generator().manual_seed(1)
    weights = [float(w) for w in torch.rand(500, generator=g) + 0.1]
    means = []
    for order in (range(500), torch.randperm(500, generator=g).tolist()):
        m = WeightedMean(256)
        for i in order:
            m.add(deltas[i], weights[i])
        means.append(m.mean())
    assert torch.equal(means[0], means[1])


floats32 = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False, width=32)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streaming_mean_equals_stacked_weighted_mean(data):
    n = data.draw(st.integers(1, 30), label="n")
    numel = data.draw(st.integers(1, 8), label="numel")
    rows = data.draw(st.lists(st.lists(floats32, min_size=numel, max_size=numel), min_size=n, max_size=n))
    weights = data.draw(st.lists(st.floats(1e-3, 1e3), min_size=n, max_size=n))
    deltas = [torch.tensor(r, dtype=torch.float32) for r in rows]
    m = WeightedMean(numel)
    for d, w in zip(deltas, weights):
        m.add(d, w)
    torch.testing.assert_close(m.mean().double(), _reference(deltas, weights), rtol=1e-6, atol=1e-6)
    assert m.count == n
    assert m.total_weight == pytest.approx(sum(weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_accumulator_takes_cpu_deltas_and_matches_cpu():
    deltas, weights = _cancelling_deltas(50, 64)
    means = []
    for device in ("cpu", "cuda"):
        m = WeightedMean(64, device=device)
        for d, w in zip(deltas, weights):
            m.add(d, w)
        means.append(m.mean().cpu())
    torch.testing.assert_close(means[0], means[1], rtol=1e-7, atol=0)


def test_a_float32_sum_is_within_the_recursive_summation_bound_and_becomes_the_mean_in_place():
    """server.sum_dtype = "float32" (large models): each coordinate's error against the exact
    weighted mean stays within (K - 1) * 2**-24 * sum w|d| / sum w (plus the final rounding), even
    for deltas that cancel; take_mean hands the sum's own memory over and releases the aggregator."""
    g = torch.Generator().manual_seed(3)
    for deltas, weights in (
        _cancelling_deltas(200, 256),
        (
            [torch.randn(256, generator=g) * 1e-3 for _ in range(50)],
            [float(w) for w in torch.rand(50, generator=g) + 0.1],
        ),
    ):
        ref = _reference(deltas, weights)
        m = WeightedMean(256, dtype=torch.float32)
        for d, w in zip(deltas, weights):
            m.add(d, w)
        buffer = m._sum.data_ptr()
        out = m.take_mean()
        assert out.dtype == torch.float32 and out.data_ptr() == buffer  # no second buffer
        assert m.count == 0 and m._acc is None
        w = torch.tensor(weights, dtype=torch.float64)
        magnitude = (w[:, None] * torch.stack(deltas).double().abs()).sum(0) / w.sum()
        bound = (len(deltas) - 1 + 2) * 2**-24 * magnitude
        error = (out.double() - ref).abs()
        assert (error <= bound).all(), float((error / bound).max())
        assert error.max() > 0  # it is a float32 sum: not exact, only bounded


def test_take_mean_of_a_float64_sum_is_mean_and_keeps_the_sum():
    deltas, weights = _cancelling_deltas(10, 16)
    m = WeightedMean(16)
    for d, w in zip(deltas, weights):
        m.add(d, w)
    assert torch.equal(m.take_mean(), m.mean()) and m.count == 10
    with pytest.raises(EmptyAggregate):
        WeightedMean(4, dtype=torch.float32).take_mean()
