"""Federated evaluation reports (POST /v1/eval), the spec check on every poll, and a
server built from a user's task, against a live server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from shoal.config import config_from_dict
from shoal.server.exposition import prometheus_text
from shoal.server.http_common import SPEC_HASH_HEADER
from shoal.server.service import MAX_EVAL_METRICS, ServerService
from shoal.server.store import open_service

from .live import ADMIN, live_server
from .task_files import write_task
from .test_validation import NODES, _good, _open_round

GOOD = {"version": 1, "num_examples": 10, "metrics": {"loss": 0.5, "accuracy": 0.75}}


def _fed_state(svc):
    f = svc.fed.get(1)
    return None if f is None else (set(f.reported), dict(f.sums), dict(f.counts), f.num_examples)


def _bad_reports(big: int) -> dict[str, tuple[int, str, bytes]]:
    def j(obj):
        return json.dumps(obj).encode()

    many = {f"m{i}": 1.0 for i in range(MAX_EVAL_METRICS + 1)}
    return {  # case: (status, error code, body)
        "not_json": (400, "malformed", b"{version: 1"),
        "not_object": (400, "malformed", b"[1, 2]"),
        "unknown_field": (400, "malformed", j({**GOOD, "extra": 1})),
        "zero_examples": (400, "malformed", j({**GOOD, "num_examples": 0})),
        "bool_examples": (400, "malformed", j({**GOOD, "num_examples": True})),
        "huge_examples": (400, "malformed", j({**GOOD, "num_examples": 10**12})),
        "string_version": (400, "malformed", j({**GOOD, "version": "1"})),
        "nan": (400, "non_finite", b'{"version": 1, "num_examples": 10, "metrics": {"loss": NaN}}'),
        "overflow": (400, "non_finite", b'{"version": 1, "num_examples": 10, "metrics": {"loss": 1e400}}'),
        "huge_int": (400, "non_finite", j({**GOOD, "metrics": {"loss": 10**400}})),
        "string_value": (400, "non_finite", j({**GOOD, "metrics": {"loss": "0.5"}})),
        "no_metrics": (400, "malformed", j({**GOOD, "metrics": {}})),
        "too_many_metrics": (400, "malformed", j({**GOOD, "metrics": many})),
        "bad_name": (400, "malformed", j({**GOOD, "metrics": {"a b": 1.0}})),
        "reserved_name": (400, "malformed", j({**GOOD, "metrics": {"num_examples": 1.0}})),
        "deep": (400, "malformed", b"[" * 50_000),
        "oversized": (413, "too_large", b" " * (big + 1)),
        "newer_version": (409, "unknown_version", j({**GOOD, "version": 7})),
    }


def test_eval_reports_are_validated_and_weighted_by_examples(tmp_path):
    """Nodes asked to evaluate version 1 report it; every bad report is a 4xx that changes
    nothing; the example-weighted means land in metrics.jsonl and /v1/status."""
    from shoal.server.service import MAX_EVAL_BODY

    async def scenario():
        async with live_server(tmp_path, NODES, clients_per_round=2, min_nodes=3) as live:
            svc = live.service
            _open_round(svc)
            for node in sorted(svc.rounds.selected):
                svc.submit(node, _good(svc, node), time.monotonic())
            assert svc.tick(time.monotonic()) and svc.version == 1
            _open_round(svc)
            chosen = sorted(svc.rounds.selected)
            other = next(n for n in NODES if n not in chosen)
            for node in chosen:  # a node with test data says eval=1 and is asked to evaluate version 1
                async with live.session(node) as http:
                    async with http.get(live.url + "/v1/task", params={"wait": "0", "eval": "1"}) as resp:
                        work = await resp.json()
                assert work["status"] == "work" and work["version"] == 1 and work["evaluate"] is True
            async with live.session(other) as http:  # not selected: not asked
                async with http.get(live.url + "/v1/task", params={"wait": "0", "eval": "1"}) as resp:
                    assert (await resp.json())["status"] == "wait"
            post = live.url + "/v1/eval"
            for case, (status, code, body) in _bad_reports(MAX_EVAL_BODY).items():
                before = _fed_state(svc)
                async with live.session(chosen[0]) as http:
                    async with http.post(post, data=body, headers={"Content-Type": "application/json"}) as resp:
                        info = await resp.json()
                        assert (resp.status, info["error"]) == (status, code), (case, info)
                        assert info["detail"]
                assert _fed_state(svc) == before, case
            async with live.session(other) as http:
                async with http.post(post, json=GOOD) as resp:
                    assert (resp.status, (await resp.json())["error"]) == (409, "eval_not_open")
            reports = {chosen[0]: (10, 0.5, 0.75), chosen[1]: (30, 0.25, 0.25)}
            for node, (n, loss, acc) in reports.items():
                async with live.session(node) as http:
                    body = {"version": 1, "num_examples": n, "metrics": {"loss": loss, "accuracy": acc}}
                    async with http.post(post, json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    async with http.post(post, json=body) as resp:
                        assert (resp.status, (await resp.json())["error"]) == (409, "duplicate")
            for node in chosen:  # round 2 closes: version 2, and version 1's evaluation is written
                svc.submit(node, _good(svc, node), time.monotonic())
            assert svc.tick(time.monotonic()) and svc.version == 2
            async with live.session(chosen[0]) as http:
                async with http.post(post, json=GOOD) as resp:  # closed now
                    assert (resp.status, (await resp.json())["error"]) == (409, "eval_not_open")
            async with live.session(ADMIN) as admin, admin.get(live.url + "/v1/status") as resp:
                status = await resp.json()
            return status

    status = asyncio.run(asyncio.wait_for(scenario(), 40))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fed = [r for r in records if r.get("evaluation") == "federated"]
    assert [r["version"] for r in records] == [1, 1, 2]  # version 1, its federated evaluation, version 2
    assert len(fed) == 1
    (f,) = fed
    assert f["fed_num_examples"] == 40 and f["fed_nodes"] == 2
    assert f["fed_loss"] == pytest.approx((10 * 0.5 + 30 * 0.25) / 40)
    assert f["fed_accuracy"] == pytest.approx((10 * 0.75 + 30 * 0.25) / 40)
    assert status["last_federated"] == f


def test_a_node_with_another_model_is_refused_on_its_first_poll(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES) as live:
            svc = live.service
            async with live.session("n0") as http:
                async with http.get(
                    live.url + "/v1/task", params={"wait": "0"}, headers={SPEC_HASH_HEADER: "0123456789abcdef"}
                ) as resp:
                    info = await resp.json()
                    assert (resp.status, info["error"]) == (400, "spec_mismatch")
                assert "0123456789abcdef" in info["detail"] and svc.spec.hash in info["detail"]
                assert "same task" in info["detail"]
                assert "n0" not in svc.last_seen  # refused before it counts as connected
                async with http.get(
                    live.url + "/v1/task", params={"wait": "0"}, headers={SPEC_HASH_HEADER: svc.spec.hash}
                ) as resp:
                    assert resp.status == 200

    asyncio.run(asyncio.wait_for(scenario(), 30))


def _task_server(tmp_path, marks, monkeypatch, **args) -> ServerService:
    monkeypatch.setenv("REGTASK_MARKS", str(marks))
    task = write_task(tmp_path / "user")
    cfg = config_from_dict(
        {
            "task": {"app": f"{task}:Regression", "args": args},
            "simulation": {"seed": 3},
            "server": {
                "checkpoint_dir": str(tmp_path / "ck"),
                "db": str(tmp_path / "db.sqlite"),
                "out_dir": str(tmp_path / "run"),
                "rounds": 2,
                "eval": True,
            },
        }
    ).validate()
    return open_service(cfg)


@pytest.mark.parametrize("central", [False, True])
def test_server_of_a_user_task_evaluates_only_the_central_data_it_is_given(tmp_path, monkeypatch, central):
    marks = tmp_path / "marks"
    marks.mkdir()
    svc = _task_server(tmp_path, marks, monkeypatch, central=central)
    assert svc.spec.numel == 4 * 8 + 8 + 8 + 1
    now = time.monotonic()
    svc.seen("n0", now)
    assert svc.tick(now)
    svc.submit("n0", _good(svc, "n0"), now)
    assert svc.tick(now) and svc.version == 1
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    tested = sorted(k for k in record if k.startswith("test_"))
    assert tested == (["test_mae", "test_mse"] if central else [])
    if central:
        assert record["test_mse"] > 0
    # the server asked the task for its central test data, and for nothing else
    assert sorted(p.name.split("-")[0] for p in marks.iterdir()) == ["central_test_data"]


def test_async_nodes_with_test_data_report_federated_evaluations(tmp_path):
    """FedBuff (K = 2) with three in-process nodes of the built-in task, each with its own
    test split: evaluations of versions 1..3 and the final version 4 reach metrics.jsonl
    and /v1/status; the central evaluation goes on beside them."""
    import torch

    from shoal.client.node import Node
    from shoal.task import LocalData

    names = ["n0", "n1", "n2"]
    gen = torch.Generator().manual_seed(0)

    def data(n):
        return torch.randn(n, 60, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    async def scenario():
        async with live_server(
            tmp_path,
            names,
            clock=True,
            sections={"asynchronous": {"buffer_size": 2}},
            mode="async",
            rounds=4,
            poll_s=1.0,
            eval=True,
        ) as live:
            cfg = config_from_dict({"model": {"name": "logreg"}, "train": {"batch_size": 10, "lr": 0.05}})
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    LocalData(train=data(30), test=data(10 + 5 * i)),
                    cfg,
                    torch.device("cpu"),
                    None,
                    poll_s=1.0,
                    name=n,
                )
                for i, n in enumerate(names)
            ]
            assert await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 60) == [0, 0, 0]
            return live.service

    svc = asyncio.run(asyncio.wait_for(scenario(), 90))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    versions = [r for r in records if "evaluation" not in r]
    fed = [r for r in records if r.get("evaluation") == "federated"]
    assert [r["version"] for r in versions] == [1, 2, 3, 4]
    assert all(0 <= r["test_accuracy"] <= 1 for r in versions)  # the built-in task's central test split
    assert fed and fed[-1]["version"] == 4 and fed[-1]["fed_nodes"] == 3
    assert fed[-1]["fed_num_examples"] == 10 + 15 + 20
    for r in fed:
        assert 0 <= r["fed_accuracy"] <= 1 and r["fed_loss"] > 0 and 1 <= r["fed_nodes"] <= 3
    assert svc.status(time.monotonic())["last_federated"] == fed[-1]
    assert "shoal_fed_accuracy" in prometheus_text(svc, time.monotonic())


def test_a_node_stops_on_a_model_download_of_another_spec(tmp_path):
    """Should a server's model differ anyway, the download says both hashes and the first
    tensor that differs, in one NodeError line (never retried)."""
    import aiohttp
    import torch

    from shoal.client.node import Node, NodeError
    from shoal.shards import Shard

    async def scenario():
        async with live_server(tmp_path, NODES) as live:
            cfg = config_from_dict({"model": {"name": "logreg"}})
            shard = Shard("n0", torch.randn(8, 30), torch.randint(0, 10, (8,)), 10)  # 30 features, server 60
            node = Node.from_config(live.url, live.tokens["n0"], shard, cfg, torch.device("cpu"), None, poll_s=1.0)
            assert node.trainer.spec.hash != live.service.spec.hash
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {live.tokens['n0']}"}) as http:
                node.http = http
                with pytest.raises(NodeError) as err:
                    await node._get_model(0)
            return str(err.value), node.trainer.spec.hash, live.service.spec.hash

    msg, mine, theirs = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert mine in msg and theirs in msg and "[10, 60]" in msg and "[10, 30]" in msg and "same task" in msg
    assert "\n" not in msg
