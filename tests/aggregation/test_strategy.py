import gc
import weakref

import pytest
import torch

from shoal.aggregation import EmptyAggregate, FedAvgM, Strategy, WeightedMean, make_strategy
from shoal.config import StrategyConfig
from shoal.update import Update

X0 = torch.tensor([1.0, -1.0, 0.5, 0.0])
# three clients, 1 + 2 + 5 = 8 examples
UPDATES = [
    Update(torch.tensor([1.0, 2.0, 3.0, 4.0]), num_examples=1, sender="a"),
    Update(torch.tensor([0.0, -2.0, 4.0, 8.0]), num_examples=2, sender="b"),
    Update(torch.tensor([8.0, 0.0, -8.0, 16.0]), num_examples=5, sender="c"),
]


def _round(strategy: Strategy, x: torch.Tensor, updates: list[Update]) -> torch.Tensor:
    strategy.begin(x)
    for u in updates:
        strategy.accumulate(u)
    return strategy.finalize()


def test_fedavg_example_weighted_is_exact():
    s = make_strategy(StrategyConfig(name="fedavg", weighting="examples"), numel=4)
    s.begin(X0)
    for u in UPDATES:
        s.accumulate(u)
    assert s.num_accumulated == 3
    new = s.finalize()
    # mean delta = (1*[1,2,3,4] + 2*[0,-2,4,8] + 5*[8,0,-8,16]) / 8 = [41, -2, -29, 100] / 8
    assert torch.equal(new, X0 + torch.tensor([41 / 8, -2 / 8, -29 / 8, 100 / 8]))
    assert torch.equal(X0, torch.tensor([1.0, -1.0, 0.5, 0.0]))  # the caller's global is untouched
    assert s.num_accumulated == 0


def test_uniform_weighting_ignores_example_counts():
    s = make_strategy(StrategyConfig(name="fedavg", weighting="uniform"), numel=4)
    # mean delta = ([1,2,3,4] + [0,-2,4,8] + [8,0,-8,16]) / 3 = [3, 0, -1/3, 28/3]
    torch.testing.assert_close(_round(s, X0, UPDATES), X0 + torch.tensor([3.0, 0.0, -1 / 3, 28 / 3]))


def test_extra_weight_multiplies_the_base_weight():
    s = make_strategy(StrategyConfig(name="fedavg"), numel=4)
    s.begin(X0)
    s.accumulate(UPDATES[0], weight=6.0)  # 1 example * 6 = 6
    s.accumulate(UPDATES[1], weight=1.0)  # 2 examples * 1 = 2
    # ([6, 12, 18, 24] + [0, -4, 8, 16]) / 8 = [0.75, 1, 3.25, 5]
    assert torch.equal(s.finalize(), X0 + torch.tensor([0.75, 1.0, 3.25, 5.0]))

    u = make_strategy(StrategyConfig(name="fedavg", weighting="uniform"), numel=4)
    u.begin(X0)
    u.accumulate(UPDATES[0], weight=3.0)
    u.accumulate(UPDATES[1], weight=1.0)
    # (3*[1,2,3,4] + [0,-2,4,8]) / 4 = [0.75, 1, 3.25, 5]
    assert torch.equal(u.finalize(), X0 + torch.tensor([0.75, 1.0, 3.25, 5.0]))


def test_fedavgm_over_two_rounds():
    s = make_strategy(StrategyConfig(name="fedavgm", server_lr=0.5, server_momentum=0.5), numel=4)
    x1 = _round(s, X0, UPDATES)
    # v1 = mean delta = [5.125, -0.25, -3.625, 12.5]; x1 = x0 + 0.5*v1
    assert torch.equal(x1, torch.tensor([1 + 2.5625, -1 - 0.125, 0.5 - 1.8125, 6.25]))
    x2 = _round(s, x1, [Update(torch.tensor([1.0, 1.0, 1.0, 1.0]), num_examples=3)])
    # v2 = 0.5*v1 + [1,1,1,1] = [3.5625, 0.875, -0.8125, 7.25]; x2 = x1 + 0.5*v2
    assert torch.equal(x2, x1 + torch.tensor([1.78125, 0.4375, -0.40625, 3.625]))


def test_finalize_with_nothing_accumulated_raises():
    s = make_strategy(StrategyConfig(), numel=4)
    s.begin(X0)
    with pytest.raises(EmptyAggregate, match="no accumulated update"):
        s.finalize()


def test_calls_out_of_order_raise():
    s = make_strategy(StrategyConfig(), numel=4)
    with pytest.raises(RuntimeError, match="before begin"):
        s.accumulate(UPDATES[0])
    with pytest.raises(RuntimeError, match="before begin"):
        s.finalize()
    _round(s, X0, UPDATES)
    with pytest.raises(RuntimeError, match="before begin"):  # a finalized round is closed
        s.accumulate(UPDATES[0])


def test_begin_drops_a_half_finished_round():
    s = make_strategy(StrategyConfig(name="fedavg"), numel=4)
    s.begin(X0)
    s.accumulate(UPDATES[2])
    assert torch.equal(_round(s, X0, UPDATES[:1]), X0 + UPDATES[0].delta)


def test_shape_mismatch_raises():
    s = make_strategy(StrategyConfig(), numel=4)
    s.begin(X0)
    with pytest.raises(ValueError, match="expected"):
        s.accumulate(Update(torch.zeros(5), num_examples=1))
    assert s.num_accumulated == 0


def test_examples_weighting_needs_examples():
    s = make_strategy(StrategyConfig(weighting="examples"), numel=4)
    s.begin(X0)
    with pytest.raises(ValueError, match="num_examples = 0"):
        s.accumulate(Update(torch.zeros(4), num_examples=0, sender="c7"))
    u = make_strategy(StrategyConfig(weighting="uniform"), numel=4)
    u.begin(X0)
    u.accumulate(Update(torch.ones(4), num_examples=0))
    assert u.num_accumulated == 1


def test_unknown_weighting_raises():
    with pytest.raises(ValueError, match="weighting"):
        Strategy(WeightedMean(4), FedAvgM(1.0), weighting="size")


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_state_dict_round_trip_gives_identical_rounds(name):
    cfg = StrategyConfig(name=name, server_lr=0.1)
    g = torch.Generator().manual_seed(0)
    rounds = [[Update(torch.randn(32, generator=g), num_examples=i + 1) for i in range(3)] for _ in range(4)]
    a = make_strategy(cfg, numel=32)
    x = torch.randn(32, generator=g)
    for ups in rounds[:2]:
        x = _round(a, x, ups)
    b = make_strategy(cfg, numel=32)
    b.load_state_dict(a.state_dict())
    xa = xb = x
    for ups in rounds[2:]:
        xa, xb = _round(a, xa, ups), _round(b, xb, ups)
        assert torch.equal(xa, xb)


def _held_tensors(obj: object) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through attributes and containers."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif hasattr(o, "__dict__"):
            stack.extend(vars(o).values())
    return found


@pytest.mark.parametrize("name", ["fedavg", "fedadam"])
def test_accumulating_1000_updates_holds_no_update(name):
    numel = 1000
    s = make_strategy(StrategyConfig(name=name), numel=numel)
    x = torch.zeros(numel)
    x = _round(s, x, [Update(torch.ones(numel), num_examples=1)])  # optimizer state now exists
    s.begin(x)
    before = [(t.shape, t.dtype) for t in _held_tensors(s)]
    refs = []
    for i in range(1000):
        u = Update(torch.full((numel,), float(i)), num_examples=1)
        refs.append(weakref.ref(u.delta))
        s.accumulate(u)
    del u
    gc.collect()
    assert all(r() is None for r in refs), "the strategy kept a reference to an update's delta"
    held = _held_tensors(s)
    assert [(t.shape, t.dtype) for t in held] == before
    # the accumulator, the block a float32 delta is widened through (at most mean.BLOCK entries),
    # the round's global (the caller's tensor), and m, v for FedAdam
    assert len(held) == {"fedavg": 3, "fedadam": 5}[name]
    assert sum(t.numel() for t in held) == len(held) * numel
    assert s.num_accumulated == 1000
    new = s.finalize()
    if name == "fedavg":
        assert torch.equal(new, x + 499.5)  # mean of 0..999


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_strategy_matches_cpu():
    cfg = StrategyConfig(name="fedadam", server_lr=0.1)
    results = []
    for device in ("cpu", "cuda"):
        s = make_strategy(cfg, numel=4, device=device)
        x = X0.to(device)
        for _ in range(3):
            x = _round(s, x, UPDATES)  # CPU deltas from the wire, global on the device
        results.append(x.cpu())
    torch.testing.assert_close(results[0], results[1])
