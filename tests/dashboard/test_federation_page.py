"""The page of a federation server: every run of the runs table, each run's curves from its
metrics lines, each node's health in each run, a per-run TensorBoard flag, and the nodes with the
runs and rounds they took."""

from __future__ import annotations

import asyncio

import pytest

from shoal.metrics import read_jsonl
from tests.server.federation_live import live_federation

from .events import assert_events_match_metrics


def _run(rounds: int, tensorboard: bool) -> dict:
    return {
        "simulation": {"seed": 5},
        "train": {"batch_size": 16, "lr": 0.05},
        "server": {"rounds": rounds, "min_nodes": 2, "deadline_s": 20.0, "poll_s": 1.0, "eval": False},
        "output": {"tensorboard": tensorboard},
    }


@pytest.mark.timeout(120)
def test_federation_runs_curves_nodes_and_a_run_with_tensorboard(tmp_path):
    async def main():
        async with live_federation(tmp_path, ["n0", "n1"]) as f:
            f.start_node("n0")
            f.start_node("n1")
            a = await f.submit(_run(2, tensorboard=True))
            b = await f.submit(_run(10_000, tensorboard=False))
            await f.wait_ended(a, 60)
            async with f.session() as s:
                while True:  # run b trains: its live figures are on the page
                    async with s.get(f"{f.url}/v1/dashboard/runs/{b}") as r:
                        live = await r.json()
                    if live.get("version", 0) >= 2:
                        break
                    await asyncio.sleep(0.1)
                async with s.get(f"{f.url}/v1/dashboard/runs") as r:
                    runs = {x["run"]: x for x in (await r.json())["runs"]}
                async with s.get(f"{f.url}/v1/dashboard/runs/{a}") as r:
                    ended = await r.json()
                async with s.get(f"{f.url}/v1/dashboard/nodes") as r:
                    nodes = {n["name"]: n for n in (await r.json())["nodes"]}
                async with s.get(f"{f.url}/v1/dashboard/runs/nope") as r:
                    assert r.status == 404
            return runs, ended, live, nodes, a, b

    runs, ended, live, nodes, a, b = asyncio.run(asyncio.wait_for(main(), 100))
    assert runs[a]["status"] == "finished" and runs[b]["status"] in ("running", "stopped")
    assert runs[b]["mode"] == "sync" and runs[b]["rounds_target"] == 10_000
    lines = read_jsonl(tmp_path / "fed" / a / "metrics.jsonl")
    assert ended["metrics"]["train_loss"] == [[r["version"], r["train_loss"]] for r in lines if "train_loss" in r]
    assert ended["traffic"] == {"live": False}  # an ended run keeps its curves; the live counters went with it
    t = live["traffic"]
    assert t["live"] and t["accepted"] >= 4 and t["bytes_up"] > 0 and t["bytes_down"] > 0
    assert [h["version"] for h in t["history"]][:2] == [1, 2]
    health = live["health"]["nodes"]  # each node's health in the run, as `shoal run status` shows it
    assert set(health) == {"n0", "n1"}, live["health"]
    assert all(h["state"] in ("online", "training") and h["last_seen_s"] >= 0 for h in health.values()), health
    assert {h["answer"] for h in ended["health"]["nodes"].values()} == {"joined"}, ended["health"]
    assert set(nodes) == {"n0", "n1"} and all(b in n["runs"] for n in nodes.values())
    assert all(n["runs"][b]["accepted"] >= 2 for n in nodes.values())
    assert_events_match_metrics(tmp_path / "fed" / a, ("train_loss",))  # the run asked for TensorBoard files
    assert not list((tmp_path / "fed" / b).glob("events.out.tfevents.*"))  # this one did not
