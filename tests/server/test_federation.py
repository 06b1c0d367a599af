"""One federation server hosting runs, node daemons that join once (in the test's event loop)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp
import pytest
import torch

from shoal.assembly import task_from_config
from shoal.config import config_from_dict
from tests.server.federation_live import live_federation

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

NODES = ["n0", "n1", "n2"]


def run_config(rounds: int = 3, **train) -> dict:
    return {
        "simulation": {"seed": 5},
        "train": {"batch_size": 16, "lr": 0.05, **train},
        "server": {"rounds": rounds, "min_nodes": 3, "deadline_s": 20.0, "poll_s": 1.0, "eval": False},
    }


def rounds_of(path) -> list[dict]:
    """The training rounds' lines of a metrics.jsonl (not the federated evaluations)."""
    return [r for r in map(json.loads, path.read_text().splitlines()) if "evaluation" not in r]


@pytest.mark.timeout(120)
def test_two_runs_at_once_a_policy_refusal_and_a_diverging_run(tmp_path):
    """Two runs train at once on the same daemons; a run over one node's epochs limit is refused by
    that node with its reason in the run's status and trains on the others; a run whose updates
    diverge ends after server.max_failed_rounds failed rounds, each node uploading at most that often."""

    async def main():
        async with live_federation(tmp_path, NODES, max_failed_rounds=2) as f:
            f.start_node("n0")
            f.start_node("n1")
            f.start_node("n2", max_epochs=2)
            a = await f.submit(run_config())
            fedbuff = run_config(rounds=2, lr=0.02)  # the other run is asynchronous (FedBuff, K = 3)
            fedbuff["server"]["mode"] = "async"
            fedbuff["asynchronous"] = {"algorithm": "fedbuff", "buffer_size": 3, "concurrency": 3}
            b = await f.submit(fedbuff)
            sa, sb = await asyncio.gather(f.wait_ended(a, 60), f.wait_ended(b, 60))
            assert sa["status"] == sb["status"] == "finished", (sa, sb)
            assert set(sa["nodes"]) == set(NODES) and all(v["answer"] == "joined" for v in sa["nodes"].values())
            lines = rounds_of(tmp_path / "fed" / a / "metrics.jsonl")
            assert [(r["version"], r["num_results"]) for r in lines] == [(1, 3), (2, 3), (3, 3)], lines
            lines = rounds_of(tmp_path / "fed" / b / "metrics.jsonl")
            assert [r["version"] for r in lines] == [1, 2], lines

            # `shoal run stop`: the run ends at its last version, its summary and model are written
            long = await f.submit(run_config(rounds=10_000))
            while (await f.status(long)).get("version", 0) < 1:
                await asyncio.sleep(0.02)
            async with f.session() as s, s.post(f"{f.url}/v1/runs/{long}/stop") as r:
                assert r.status == 200 and (await r.json())["status"] == "stopping"
            st = await f.wait_ended(long, 30)
            assert st["status"] == "stopped" and st["reason"] == "stopped by admin", st
            summary = json.loads((tmp_path / "fed" / long / "summary.json").read_text())
            assert summary["status"] == "stopped" and 1 <= summary["version"] < 10_000
            assert (tmp_path / "fed" / long / "model.safetensors").stat().st_size > 0

            # over n2's limit of 2 epochs: n2 refuses, the others train (min_nodes 2). The run is
            # stopped once n2 has answered: two short rounds could end before n2 next asks for offers
            cfg = run_config(rounds=10_000, epochs=3)
            cfg["server"]["min_nodes"] = 2
            c = await f.submit(cfg)
            end = asyncio.get_running_loop().time() + 60
            while "n2" not in (sc := await f.status(c)).get("nodes", {}) or sc.get("version", 0) < 2:
                assert asyncio.get_running_loop().time() < end and sc.get("status") in ("queued", "running"), sc
                await asyncio.sleep(0.02)
            async with f.session() as s, s.post(f"{f.url}/v1/runs/{c}/stop") as r:
                assert r.status == 200
            sc = await f.wait_ended(c, 30)
            assert sc["status"] == "stopped", sc
            assert sc["nodes"]["n2"]["answer"] == "refused"
            assert "train.epochs = 3 is over node n2's limit of 2" in sc["nodes"]["n2"]["reason"]
            lines = rounds_of(tmp_path / "fed" / c / "metrics.jsonl")
            assert len(lines) >= 2 and {r["num_results"] for r in lines} == {2}, lines

            # lr = 50 diverges: every upload is refused (non-finite or too large), the run ends
            d = await f.submit(run_config(rounds=10, lr=50.0, epochs=2))
            sd = await f.wait_ended(d, 90)
            assert sd["status"] == "failed", sd
            assert "2 rounds in a row without an accepted update" in sd["reason"], sd
            summary = json.loads((tmp_path / "fed" / d / "summary.json").read_text())
            assert summary["version"] == 0 and summary["updates_accepted"] == 0
            uploads = sum(v for k, v in summary["updates_rejected"].items())
            assert 1 <= uploads <= 2 * 3, summary  # each node at most max_failed_rounds uploads
            assert all(d.stop.is_set() is False for d in f.daemons.values())  # no daemon was restarted

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_revoked_node_is_never_selected_again(tmp_path):
    """`shoal server nodes revoke` in the middle of a run: from the next round on no run selects the
    node (it was connected a moment ago), its requests get 403, and the run goes on with the others."""

    async def main():
        async with live_federation(tmp_path, NODES) as f:
            for n in NODES:
                f.start_node(n)
            cfg = run_config(rounds=12)
            cfg["server"]["min_nodes"] = 2  # every connected node is selected (server.fraction = 1)
            run = await f.submit(cfg)
            while (svc := f.fed.active.get(run)) is None or svc.version < 2:
                await asyncio.sleep(0.01)
            assert "n2" in svc.rounds.selected or svc.version >= 2
            f.registry.revoke("n2")
            loop = asyncio.get_running_loop()
            revoked_at, before, selected = loop.time(), set(), {}
            while run in f.fed.active:  # the rounds that open once the server read the revocation
                r = svc.rounds
                if r.open and r.round not in before:
                    if loop.time() - revoked_at < 0.3:
                        before.add(r.round)  # opened before (n2 may be in it; it waits for its deadline)
                    else:
                        selected.setdefault(r.round, set(r.selected))
                await asyncio.sleep(0.005)
            assert selected and all(s == {"n0", "n1"} for s in selected.values()), selected
            status = await f.status(run)
            assert status["status"] == "finished", status
            assert f.daemons["n2"].stop.is_set()  # its daemon was told 403 (revoked) and stopped

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_a_researcher_submits_a_secure_run_and_a_node_pinning_another_hash_refuses_it(tmp_path):
    """A researcher's token (federation.researcher_tokens_file) submits and follows runs, a node's
    token cannot; the run is securely aggregated over three nodes; a fourth node that pinned another
    source hash of the task refuses it with that reason."""

    async def main():
        alice = secrets.token_urlsafe(32)
        async with live_federation(tmp_path, [*NODES, "n3"], researchers={"alice": alice}) as f:
            for n in NODES:
                f.start_node(n)
            f.start_node("n3", sha="0" * 64)
            headers = {"Authorization": f"Bearer {(tmp_path / 'n0.token').read_text()}"}
            async with aiohttp.ClientSession(headers=headers) as s, s.get(f.url + "/v1/runs") as r:
                assert r.status == 401 and (await r.json())["error"] == "unauthenticated"
            cfg = run_config(rounds=2)
            cfg["server"]["clients_per_round"] = 3
            cfg["secure_aggregation"] = {"enabled": True, "stage_s": 10.0}
            f.admin = alice  # from here on, requests carry the researcher's token
            run = await f.submit(cfg)
            st = await f.wait_ended(run, 60)
            assert st["status"] == "finished" and st["submitted_by"] == "alice", st
            assert st["nodes"]["n3"]["answer"] == "refused" and "pins 0000000000000000" in st["nodes"]["n3"]["reason"]
            lines = rounds_of(tmp_path / "fed" / run / "metrics.jsonl")
            assert [(r["version"], r["num_results"]) for r in lines] == [(1, 3), (2, 3)], lines

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_local_dp_runs_spend_one_budget_per_data_set(tmp_path):
    """A node's local-DP ledger is per data set, across runs: a second local-DP run on the same data
    while one trains is refused for now (a temporary refusal, with the reason), joined once the first
    is over, and each later run goes on from the rounds spent."""

    async def main():
        async with live_federation(tmp_path, NODES) as f:
            for n in NODES:
                f.start_node(n)
            cfg = run_config(rounds=2)
            cfg["privacy"] = {"mode": "local", "noise_multiplier": 1.0, "clip_norm": 1.0}
            # The first run is long, so it is surely still training when the second is offered.
            first = await f.submit({**cfg, "server": {**cfg.get("server", {}), "rounds": 1000}})
            while len((await f.status(first))["nodes"]) < 3:
                await asyncio.sleep(0.02)
            second = await f.submit(cfg)  # while the first trains (federation.max_runs = 2)
            while len((st := await f.status(second))["nodes"]) < 3:
                await asyncio.sleep(0.02)
            assert all(
                v["answer"] == "refused" and v.get("temporary") and f"trained with local DP by {first}" in v["reason"]
                for v in st["nodes"].values()
            ), st
            # a temporary refusal: once the first run is over, the nodes take part in the second
            async with f.session() as s, s.post(f"{f.url}/v1/runs/{first}/stop") as r:
                assert r.status == 200
            assert (await f.wait_ended(first, 60))["status"] == "stopped"
            st = await f.wait_ended(second, 60)
            assert st["status"] == "finished" and all(v["answer"] == "joined" for v in st["nodes"].values()), st

            def ledgers() -> list[int]:
                return [
                    json.loads(next((tmp_path / f"{n}-state").glob("data-*.privacy.json")).read_text())["rounds"]
                    for n in NODES
                ]

            spent = ledgers()
            assert min(spent) >= 1 + 2  # the first run's rounds, then the second's 2
            third = await f.submit(cfg)
            assert (await f.wait_ended(third, 60))["status"] == "finished"
            assert ledgers() == [k + 2 for k in spent]  # the third run's 2 rounds on top of the first's

    asyncio.run(main())


@pytest.mark.timeout(30)
def test_an_upload_that_found_no_round_open_is_trained_again(tmp_path):
    """After a server restart a node's retried upload can arrive before its round reopens (409
    round_closed): the reopened round hands out the same task, so the node must not mark it as one
    it never trains again (as it does for an update the server refused for what it is)."""
    from shoal.client.node import Node, read_local_data
    from shoal.client.task_message import TaskMessage

    from .hostile import good_update
    from .live import live_server
    from .task_files import write_node_data, write_task

    async def main():
        app = f"{write_task(tmp_path / 'tasks')}:Regression"
        async with live_server(tmp_path, ["n0"], sections={"task": {"app": app}}, clients_per_round=1) as live:
            svc = live.service
            cfg = config_from_dict({"task": {"app": app}})
            task = task_from_config(cfg)
            data = read_local_data(task, write_node_data(tmp_path / "n0.pt", 1))
            node = Node.from_config(live.url, live.tokens["n0"], data, cfg, torch.device("cpu"), None, 1.0, "n0", task)
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {live.tokens['n0']}"}) as node.http:
                work = TaskMessage.parse({"status": "work", "round": 1, "version": 0, "seed": 0})
                assert not await node._upload(work, good_update(svc, "n0", round=1))  # no round open: 409
                assert (1, 0) not in node.failed_tasks
                svc.seen("n0", time.monotonic())
                assert svc.tick(time.monotonic())  # the round opens
                assert not await node._upload(work, good_update(svc, "n0", value=float("nan")))  # 400 non_finite
                assert (1, 0) in node.failed_tasks

    asyncio.run(main())
