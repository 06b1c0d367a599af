"""Run health without I/O: node states, what a waiting run waits for, and when a run that cannot
proceed ends failed (server/federation/run_health.py); the run keys a submission may set (server/federation/runs.py)."""

from __future__ import annotations

import pytest

from shoal.server.federation.run_health import RunWatch, node_health
from shoal.server.federation.runs import RunError, check_run_config

HORIZON = 25.0


def test_a_node_not_heard_from_for_a_poll_period_is_offline_unless_it_holds_a_task():
    answers = {"a": {"answer": "joined"}, "b": {"answer": "joined"}, "c": {"answer": "joined"}}
    health = node_health(answers, {"a": 95.0, "b": 10.0, "c": 10.0}, 100.0, HORIZON, training={"c"})
    assert health["a"]["state"] == "online" and health["a"]["last_seen_s"] == 5.0
    assert health["b"]["state"] == "offline" and health["b"]["last_seen_s"] == 90.0
    assert health["c"]["state"] == "training"  # silent while it trains its task


def test_a_temporary_refusal_is_deferred_and_never_ends_the_run():
    answers = {"a": {"answer": "refused", "temporary": True, "reason": "its local-DP ledger is busy"}}
    health = node_health(answers, {}, 5.0, HORIZON)
    assert health["a"]["state"] == "deferred"
    watch = RunWatch(min_nodes=1, stall_s=60)
    waiting, fail = watch.check(health, registered=1, now=5.0)
    assert fail is None and waiting is not None and "a deferred: its local-DP ledger is busy" in waiting
    assert watch.check(node_health(answers, {}, 500.0, HORIZON), registered=1, now=500.0)[1] is None


def test_every_node_failed_or_refused_ends_the_run_at_once_with_their_reasons():
    answers = {
        "a": {"answer": "failed", "reason": "task t.py:task: loss(model, x, y) raised IndexError"},
        "b": {"answer": "refused", "reason": "task t.py:task is not installed here"},
    }
    watch = RunWatch(min_nodes=1, stall_s=600)
    waiting, fail = watch.check(node_health(answers, {}, 5.0, HORIZON), registered=2, now=5.0)
    assert fail is not None and fail.startswith("every node refused or failed the run")
    assert "a failed: task t.py:task: loss(model, x, y) raised IndexError" in fail and "b refused" in fail


def test_a_run_short_of_min_nodes_says_what_it_waits_for_then_fails_after_run_stall_s():
    watch = RunWatch(min_nodes=3, stall_s=60)
    answers = {"a": {"answer": "joined"}, "b": {"answer": "joined"}, "c": {"answer": "refused", "reason": "limits"}}
    seen = {"a": 0.0, "b": 0.0}
    waiting, fail = watch.check(node_health(answers, seen, 0.0, HORIZON), registered=4, now=0.0)
    assert fail is None
    assert waiting is not None and "server.min_nodes = 3" in waiting and "2 (a, b)" in waiting
    assert "c refused: limits" in waiting and "federation.run_stall_s = 60" in waiting
    seen = {"a": 59.0, "b": 59.0}
    assert watch.check(node_health(answers, seen, 59.0, HORIZON), registered=4, now=59.0)[1] is None
    waiting, fail = watch.check(node_health(answers, seen, 60.0, HORIZON), registered=4, now=60.0)
    assert fail is not None and "fewer than server.min_nodes = 3 nodes took part" in fail


def test_the_stall_clock_restarts_once_the_run_has_its_nodes_and_zero_waits_for_ever():
    watch = RunWatch(min_nodes=1, stall_s=60)
    answers = {"a": {"answer": "joined"}}
    assert watch.check(node_health(answers, {}, 0.0, HORIZON), 1, 0.0)[0] is not None  # a is not seen yet
    assert watch.check(node_health(answers, {"a": 50.0}, 50.0, HORIZON), 1, 50.0) == (None, None)
    assert watch.check(node_health(answers, {"a": 50.0}, 100.0, HORIZON), 1, 100.0)[1] is None  # short since 100
    forever = RunWatch(min_nodes=1, stall_s=0)
    assert forever.check({}, 1, 0.0)[1] is None and forever.check({}, 1, 1e9)[1] is None


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"server": {"min_nodess": 2}}, "unknown key 'server.min_nodess' (did you mean server.min_nodes?)"),
        ({"server": {"port": 1}}, "server.port is the federation's, not a run's"),
    ],
)
def test_a_misspelt_run_key_is_unknown_and_a_federation_key_is_the_federations(raw, needle):
    with pytest.raises(RunError) as e:
        check_run_config(raw)
    assert needle in str(e.value)
