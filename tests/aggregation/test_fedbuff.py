import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.aggregation import FedAvgM, FedAvgOpt, make_strategy
from shoal.aggregation.fedbuff import FedBuff
from shoal.aggregation.staleness import make_staleness_weight
from shoal.config import StrategyConfig
from shoal.rounds import SyncRounds
from shoal.update import Update

X = torch.tensor([1.0, 0.0])


def test_flush_after_k_with_staleness_weights_hand_computed():
    # uniform: buf = s(0) d1 + s(3) d2 = [4, 0] + 0.5 [0, 8] = [4, 4]; /K=2 -> [2, 2]; lr 0.5
    fb = FedBuff(2, FedAvgOpt(0.5), make_staleness_weight("polynomial", a=0.5))
    fb.accumulate(Update(torch.tensor([4.0, 0.0]), 10), staleness=0)
    assert not fb.full
    fb.accumulate(Update(torch.tensor([0.0, 8.0]), 30), staleness=3)
    assert fb.full
    new = fb.flush(X)
    assert torch.equal(new, torch.tensor([2.0, 1.0]))
    assert fb.count == 0 and not fb.full
    with pytest.raises(RuntimeError, match="empty"):
        fb.flush(new)


def test_examples_weighting_keeps_staleness_out_of_the_denominator():
    # (10 * 1 * [4,0] + 30 * 0.5 * [0,8]) / (10 + 30) = [40, 120] / 40 = [1, 3]
    fb = FedBuff(2, FedAvgOpt(1.0), make_staleness_weight("polynomial", a=0.5), weighting="examples")
    fb.accumulate(Update(torch.tensor([4.0, 0.0]), 10), staleness=0)
    fb.accumulate(Update(torch.tensor([0.0, 8.0]), 30), staleness=3)
    assert torch.equal(fb.flush(X), torch.tensor([2.0, 3.0]))


def test_server_momentum_is_used_and_checkpointed():
    fb = FedBuff(1, FedAvgM(1.0, momentum=0.5), make_staleness_weight("constant"))
    fb.accumulate(Update(torch.tensor([1.0, 1.0]), 1), 0)
    x1 = fb.flush(X)  # v = [1,1]; x = [2, 1]
    fb.accumulate(Update(torch.tensor([2.0, 0.0]), 1), 0)
    state = fb.state_dict()
    x2 = fb.flush(x1)  # v = 0.5 [1,1] + [2,0] = [2.5, 0.5]; x = [4.5, 1.5]
    assert torch.equal(x2, torch.tensor([4.5, 1.5]))
    again = FedBuff(1, FedAvgM(1.0, momentum=0.5), make_staleness_weight("constant"))
    again.load_state_dict(state)  # a half-full (here: full) buffer survives a restart
    assert torch.equal(again.flush(x1), x2)


def test_full_buffer_refuses_more():
    fb = FedBuff(1, FedAvgOpt(1.0), make_staleness_weight("constant"))
    fb.accumulate(Update(torch.ones(2), 1), 0)
    with pytest.raises(RuntimeError, match="full"):
        fb.accumulate(Update(torch.ones(2), 1), 0)


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 6),
    numel=st.integers(1, 20),
    seed=st.integers(0, 2**31),
    weighting=st.sampled_from(["examples", "uniform"]),
    kind=st.sampled_from(["constant", "polynomial", "hinge"]),
)
def test_fedbuff_at_staleness_zero_is_fedavg(k, numel, seed, weighting, kind):
    """FedBuff with K = clients per round, staleness 0, server lr 1 gives FedAvg's model
    (the reference: Strategy driven by SyncRounds)."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(numel, generator=g)
    deltas = [torch.randn(numel, generator=g) for _ in range(k)]
    sizes = torch.randint(1, 500, (k,), generator=g).tolist()

    strategy = make_strategy(StrategyConfig(name="fedavg", weighting=weighting, server_lr=1.0), numel)
    sync = SyncRounds(strategy, x0.clone(), clients_per_round=k, seed=seed)
    ids = [f"c{i}" for i in range(k)]
    tasks = sync.start_round(ids)
    for i, t in enumerate(tasks):
        sync.submit(t.client_id, Update(deltas[i], sizes[i], base_version=0, sender=t.client_id))
    reference = sync.finish_round()
    assert reference.version == 1

    fb = FedBuff(k, FedAvgOpt(1.0), make_staleness_weight(kind), weighting=weighting)
    for i in range(k):
        fb.accumulate(Update(deltas[i], sizes[i]), staleness=0)
    assert fb.full
    assert torch.equal(fb.flush(x0), sync.global_params)
