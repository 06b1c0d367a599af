import pytest
import torch

from shoal.aggregation import make_strategy
from shoal.aggregation.staleness import make_staleness_weight
from shoal.config import StrategyConfig
from shoal.errors import UpdateRejected
from shoal.rounds import SyncRounds
from shoal.update import Update

IDS = [f"c{i}" for i in range(10)]


def _rounds(**kw):
    strategy = make_strategy(StrategyConfig(name="fedavg", weighting="uniform"), 2)
    return SyncRounds(strategy, torch.zeros(2), clients_per_round=4, seed=5, **kw)


def _send(r, task, delta):
    r.submit(task.client_id, Update(torch.tensor(delta), 1, base_version=task.version, sender=task.client_id))


def test_over_selection_closes_at_k_results():
    r = _rounds(over_selection=0.3, deadline_s=60.0)
    tasks = r.start_round(IDS, now=100.0)
    assert len(tasks) == 6  # ceil(4 * 1.3)
    assert r.deadline_at == 160.0
    for t in tasks[:3]:
        _send(r, t, [1.0, 0.0])
    assert not r.should_close(now=110.0)
    _send(r, tasks[3], [1.0, 0.0])
    assert r.should_close(now=110.0)
    s = r.finish_round()
    assert not s.failed and s.num_results == 4 and r.version == 1
    assert set(r.late_pending) == {tasks[4].client_id, tasks[5].client_id}


def test_deadline_with_enough_results_aggregates_what_arrived():
    r = _rounds(deadline_s=10.0, min_fraction=0.5)
    tasks = r.start_round(IDS, now=0.0)
    _send(r, tasks[0], [2.0, 0.0])
    _send(r, tasks[1], [0.0, 2.0])
    assert not r.should_close(now=9.9)
    assert r.should_close(now=10.0)
    s = r.finish_round()
    assert not s.failed and s.num_results == 2
    assert torch.equal(r.global_params, torch.tensor([1.0, 1.0]))


def test_below_min_fraction_at_deadline_fails_cleanly():
    r = _rounds(deadline_s=10.0, min_fraction=0.75)
    tasks = r.start_round(IDS, now=0.0)
    _send(r, tasks[0], [2.0, 0.0])
    _send(r, tasks[1], [0.0, 2.0])
    assert r.should_close(now=10.0)
    s = r.finish_round()
    assert s.failed and r.failed_rounds == 1
    assert r.version == 0 and torch.equal(r.global_params, torch.zeros(2))
    tasks = r.start_round(IDS, now=10.0)  # the next round starts from the unchanged model
    assert all(t.version == 0 for t in tasks)


def test_late_results_are_dropped_by_default():
    r = _rounds(deadline_s=10.0)
    tasks = r.start_round(IDS, now=0.0)
    for t in tasks[:3]:
        _send(r, t, [1.0, 1.0])
    r.finish_round()
    r.start_round([c for c in IDS if c != tasks[3].client_id], now=10.0)
    with pytest.raises(UpdateRejected) as e:
        _send(r, tasks[3], [5.0, 5.0])
    assert e.value.code == "late"
    assert r.rejected == {"late": 1}


def test_late_results_fold_into_the_next_round_with_their_staleness_weight():
    w = make_staleness_weight("polynomial", a=1.0)  # s(1) = 1/2
    r = _rounds(deadline_s=10.0, late="fold", late_weight=w)
    tasks = r.start_round(IDS, now=0.0)
    for t in tasks[:3]:
        _send(r, t, [0.0, 0.0])
    r.finish_round()  # version 1, model unchanged at 0
    slow = tasks[3]
    nxt = r.start_round([c for c in IDS if c != slow.client_id], now=10.0)
    _send(r, slow, [6.0, 0.0])  # staleness 1 -> weight 1/2
    for t in nxt:
        _send(r, t, [0.0, 3.0])
    s = r.finish_round()
    # uniform weights: (0.5 [6,0] + 4 [0,3]) / (0.5 + 4) = [3, 12] / 4.5
    assert s.num_late == 1 and s.late_staleness == {1: 1}
    assert torch.allclose(r.global_params, torch.tensor([3 / 4.5, 12 / 4.5]))


def test_old_calls_keep_working_and_state_round_trips():
    r = _rounds()
    tasks = r.start_round(IDS)
    assert len(tasks) == 4
    for t in tasks:
        _send(r, t, [1.0, 1.0])
    assert r.complete
    r.finish_round()
    state = r.state_dict()
    again = _rounds()
    again.load_state_dict(state)
    assert again.version == 1 and torch.equal(again.global_params, r.global_params)
    assert [t.seed for t in again.start_round(IDS)] == [t.seed for t in r.start_round(IDS)]
    with pytest.raises(ValueError, match="now="):
        _rounds(deadline_s=5.0).start_round(IDS)


def test_one_evaluation_cadence_every_kth_the_last_and_an_early_stop():
    from shoal.rounds import evaluation_due

    assert [r for r in range(0, 11) if evaluation_due(r, 3, 10)] == [3, 6, 9, 10]
    assert [r for r in range(0, 5) if evaluation_due(r, 3, 10, stop=r == 4)] == [3, 4]
    assert [v for v in range(0, 7) if evaluation_due(v, 2)] == [2, 4, 6]  # async versions: no last
