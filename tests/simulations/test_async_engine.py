"""Virtual-clock engines end to end on the synthetic dataset (small and fast)."""

import json

import pytest
import torch

from shoal.config import load_config
from shoal.simulations.async_engine import AsyncEngine
from shoal.simulations.experiment import run_simulation
from shoal.simulations.sync_engine import VirtualSyncEngine


@pytest.fixture(autouse=True)
def one_thread():
    # Two threads on a loaded two-core machine spin far more than they compute.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cfg(*extra):
    return load_config(
        None,
        [
            "simulation.num_clients=20",
            "simulation.clients_per_round=4",
            "simulation.rounds=8",
            "heterogeneity.speed_sigma=1.0",
            "heterogeneity.network_delay_s=0.5",
            "asynchronous.buffer_size=4",
            "asynchronous.concurrency=6",
            "output.plots=false",
            *extra,
        ],
    )


@pytest.mark.parametrize("algorithm", ["fedbuff", "fedasync"])
def test_async_run_writes_virtual_time_version_staleness_and_counts(tmp_path, algorithm):
    c = cfg('simulation.mode="async"', f'asynchronous.algorithm="{algorithm}"', "simulation.eval_every=2")
    summary = run_simulation(c, tmp_path)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in recs] == [0, 2, 4, 6, 8]
    times = [r["virtual_time_s"] for r in recs]
    assert times == sorted(times) and times[-1] > 0
    for r in recs[1:]:
        assert {"staleness_mean", "staleness_max", "staleness_hist", "accepted", "rejected"} <= set(r)
    per_interval = sum(r["num_results"] for r in recs)
    assert per_interval == summary["updates_accepted"] == sum(summary["staleness"]["staleness_hist"].values())
    expected = 8 * 4 if algorithm == "fedbuff" else 8  # K updates per version vs one
    assert summary["updates_accepted"] == expected
    assert summary["mode"] == "async" and summary["algorithm"] == algorithm
    assert summary["staleness"]["staleness_max"] >= 1  # 6 clients at once: some are stale


def test_async_same_seed_same_numbers():
    def final(seed):
        e = AsyncEngine(cfg('simulation.mode="async"', f"simulation.seed={seed}"))
        recs = list(e.run())
        return e.rounds.global_params.clone(), recs[-1]["virtual_time_s"]

    (a, ta), (b, tb), (c, _tc) = final(3), final(3), final(4)
    assert torch.equal(a, b) and ta == tb
    assert not torch.equal(a, c)


def test_too_stale_updates_are_rejected_and_counted(tmp_path):
    c = cfg(
        'simulation.mode="async"',
        'asynchronous.algorithm="fedasync"',
        "asynchronous.max_staleness=1",
        "asynchronous.concurrency=10",
    )
    summary = run_simulation(c, tmp_path)
    assert summary["updates_rejected"].get("too_stale", 0) > 0
    assert summary["staleness"]["staleness_max"] <= 1


def test_sync_on_the_virtual_clock_waits_for_the_slowest_and_deadlines_cut_it():
    def run(*extra):
        e = VirtualSyncEngine(cfg("heterogeneity.enabled=true", *extra))
        recs = list(e.run())
        return e, recs

    plain, recs = run()
    assert plain.rounds.version == 8 and plain.failed_rounds == 0
    assert [r["round"] for r in recs] == list(range(0, 9))  # the final state is recorded once
    # with a deadline far shorter than the slow clients, rounds close early; late results fold in
    cut, recs_cut = run(
        "asynchronous.deadline_s=4.0",
        "asynchronous.over_selection=0.5",
        'asynchronous.late="fold"',
        "asynchronous.min_fraction=0.25",
    )
    assert cut.clients.now < plain.clients.now
    t = cut.totals()
    assert t["version"] + t["failed_rounds"] == 8
    assert t["staleness"]["staleness_max"] >= 1  # some late results were folded with their weight
    folded = [r for r in recs_cut if r.get("num_late")]
    assert folded and all(r["staleness_max"] >= 1 for r in folded)


def test_sync_virtual_rounds_match_the_plain_engine_without_heterogeneity():
    """Equal speeds, no delays, no deadline: the same rounds as the in-process engine."""
    from shoal.simulations.inprocess import InProcessSimulation

    c = cfg("heterogeneity.enabled=true", "heterogeneity.speed_sigma=0.0", "heterogeneity.network_delay_s=0.0")
    e = VirtualSyncEngine(c)
    list(e.run())
    plain = InProcessSimulation.from_config(c)
    for _ in range(8):
        plain.run_round()
    assert torch.equal(e.rounds.global_params, plain.global_params)


def test_clients_going_offline_drop_out_and_the_run_goes_on():
    c = cfg(
        'simulation.mode="async"',
        'asynchronous.algorithm="fedasync"',
        "heterogeneity.mean_on_s=6.0",
        "heterogeneity.mean_off_s=6.0",
        "simulation.rounds=12",
    )
    e = AsyncEngine(c)
    list(e.run())
    t = e.totals()
    assert t["dropouts"] > 0 and t["version"] == 12
    # FedAsync (mix = model) keeps only base versions an open task can still use
    assert len(e.rounds._history) <= len(e.rounds.outstanding) <= c.asynchronous.concurrency
