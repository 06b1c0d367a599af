import pytest
import torch

from shoal.aggregation import FedAvgOpt
from shoal.aggregation.fedasync import FedAsync
from shoal.aggregation.fedbuff import FedBuff
from shoal.aggregation.staleness import make_staleness_weight
from shoal.async_rounds import AsyncRounds
from shoal.errors import UpdateRejected
from shoal.update import Update

X0 = torch.zeros(2)


def _upd(task, delta, n=1):
    return Update(torch.tensor(delta), n, base_version=task.version, sender=task.client_id)


def test_fedasync_version_advances_on_every_update_and_mixes_stale_ones_with_their_base():
    ar = AsyncRounds(FedAsync(0.5, make_staleness_weight("polynomial", a=1.0)), X0.clone(), seed=1)
    ta, tb = ar.task("a"), ar.task("b")
    assert ta.version == tb.version == 0 and ta.seed != tb.seed
    assert ar.submit("a", _upd(ta, [4.0, 0.0]))  # x = 0 + 0.5 [4, 0] = [2, 0]
    assert ar.version == 1 and torch.equal(ar.global_params, torch.tensor([2.0, 0.0]))
    # b trained from version 0 (x = [0,0]); staleness 1 -> alpha_t = 0.5 / 2 = 0.25
    # x <- 0.75 [2, 0] + 0.25 ([0, 0] + [0, 8]) = [1.5, 2]
    assert ar.submit("b", _upd(tb, [0.0, 8.0]))
    assert torch.allclose(ar.global_params, torch.tensor([1.5, 2.0]))
    assert ar.stats.accepted == 2 and ar.stats.staleness == {0: 1, 1: 1}
    assert ar._history == {}  # no open task refers to an old version any more


def test_fedbuff_advances_only_when_the_buffer_is_full():
    ar = AsyncRounds(FedBuff(2, FedAvgOpt(1.0), make_staleness_weight("polynomial")), X0.clone())
    ta, tb = ar.task("a"), ar.task("b")
    assert not ar.submit("a", _upd(ta, [2.0, 0.0]))
    assert ar.version == 0 and torch.equal(ar.global_params, X0)
    assert ar.submit("b", _upd(tb, [0.0, 2.0]))
    assert ar.version == 1 and torch.equal(ar.global_params, torch.tensor([1.0, 1.0]))


def test_rejections_are_typed_counted_and_leave_the_model_alone():
    ar = AsyncRounds(FedAsync(1.0, make_staleness_weight("constant"), mix="delta"), X0.clone(), max_staleness=1)
    old = ar.task("slow")
    for _ in range(2):
        t = ar.task("fast")
        ar.submit("fast", _upd(t, [1.0, 1.0]))
    before = ar.global_params.clone()
    with pytest.raises(UpdateRejected) as e:
        ar.submit("slow", _upd(old, [9.0, 9.0]))
    assert e.value.code == "too_stale" and "max_staleness = 1" in str(e.value)
    with pytest.raises(UpdateRejected) as e:
        ar.submit("slow", _upd(old, [9.0, 9.0]))  # its task was closed by the rejection
    assert e.value.code == "not_assigned"
    t = ar.task("x")
    with pytest.raises(UpdateRejected) as e:
        ar.submit("x", Update(torch.ones(2), 1, base_version=t.version - 1))
    assert e.value.code == "bad_version"
    assert torch.equal(ar.global_params, before) and ar.version == 2
    assert ar.stats.rejected == {"too_stale": 1, "not_assigned": 1, "bad_version": 1}
    assert ar.stats.accepted == 2


def test_seeds_depend_on_client_and_count_not_on_order():
    a = AsyncRounds(FedAsync(0.5, make_staleness_weight("constant")), X0.clone(), seed=7)
    b = AsyncRounds(FedAsync(0.5, make_staleness_weight("constant")), X0.clone(), seed=7)
    sa = [a.task("p").seed, a.task("q").seed, a.task("p").seed]
    sb = [b.task("q").seed, b.task("p").seed, b.task("p").seed]
    assert sa[0] == sb[1] and sa[1] == sb[0] and sa[2] == sb[2]
    assert len(set(sa)) == 3


@pytest.mark.parametrize("algo", ["fedasync", "fedbuff"])
def test_state_dict_round_trip_continues_identically(algo):
    def make():
        w = make_staleness_weight("hinge", a=0.5, b=0)
        alg = FedAsync(0.5, w) if algo == "fedasync" else FedBuff(3, FedAvgOpt(0.7), w)
        return AsyncRounds(alg, X0.clone(), seed=3, max_staleness=5)

    def drive(ar, start, n):
        for i in range(start, start + n):
            cid = f"c{i % 4}"
            if cid in ar.outstanding:
                t = ar.outstanding[cid]
                ar.submit(cid, Update(torch.tensor([float(i), -float(i)]), i + 1, base_version=t.version))
            ar.task(cid)

    ref = make()
    drive(ref, 0, 14)
    state = ref.state_dict()
    drive(ref, 14, 10)
    restored = make()
    restored.load_state_dict(state)
    drive(restored, 14, 10)
    assert restored.version == ref.version
    assert torch.equal(restored.global_params, ref.global_params)
    assert restored.stats == ref.stats


def test_forget_closes_a_task_and_frees_its_base_version():
    ar = AsyncRounds(FedAsync(0.5, make_staleness_weight("constant")), X0.clone())
    t = ar.task("gone")
    fast = ar.task("fast")
    ar.submit("fast", _upd(fast, [1.0, 1.0]))
    assert set(ar._history) == {0}  # "gone" may still report from version 0
    ar.forget("gone")
    assert ar._history == {}
    with pytest.raises(UpdateRejected) as e:
        ar.submit("gone", _upd(t, [1.0, 1.0]))
    assert e.value.code == "not_assigned"
