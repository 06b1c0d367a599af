"""The page of a central-DP run that its budget stops: epsilon against the target per version,
and the reason the run ended (three nodes in the test's event loop, real rounds over HTTP)."""

from __future__ import annotations

import asyncio

import torch

from shoal.client.node import Node
from shoal.metrics import read_jsonl
from shoal.shards import load_shard

from ..server.live import ADMIN, live_server
from ..server.test_deploy_privacy import CENTRAL, _node_cfg, _shards


def test_epsilon_against_the_target_and_why_the_run_ended(tmp_path):
    names = ["n0", "n1", "n2"]
    sections = {"privacy": {**CENTRAL["privacy"], "target_epsilon": 8.0}}

    async def scenario():
        server = {"min_nodes": 3, "clients_per_round": 3, "rounds": 10, "poll_s": 1.0, "deadline_s": 10.0}
        async with live_server(tmp_path, names, clock=True, sections=sections, **server) as live:
            shards = _shards(tmp_path, 3)
            cfg = _node_cfg(sections)
            nodes = [
                Node.from_config(
                    live.url, live.tokens[n], load_shard(shards[i]), cfg, torch.device("cpu"), None, 1.0, n
                )
                for i, n in enumerate(names)
            ]
            assert await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 40) == [0, 0, 0]
            async with live.session(ADMIN) as http:
                async with http.get(live.url + "/v1/dashboard/runs/run") as r:
                    return await r.json()

    run = asyncio.run(scenario())
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert run["status"] == "finished" and run["reason"].startswith("privacy budget reached")
    assert run["epsilon"]["target"] == 8.0 == run["target_epsilon"]
    assert run["epsilon"]["points"] == [[r["version"], r["epsilon"]] for r in records]
    assert all(eps <= 8.0 for _, eps in run["epsilon"]["points"])
