"""Async mode (FedBuff / FedAsync via shoal.async_rounds) behind the HTTP server."""

from __future__ import annotations

import asyncio
import json
import time

import torch

from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.server.checkpoint import latest_checkpoint, load_checkpoint
from shoal.server.store import open_service
from shoal.shard_split import write_shards
from shoal.shards import load_shard
from shoal.update import Update
from shoal.wire import encode_update

from .live import live_server, small_config

ASYNC = {"mode": "async", "rounds": 4, "poll_s": 1.0}
FEDBUFF_K2 = {"asynchronous": {"algorithm": "fedbuff", "buffer_size": 2}}


def _nodes(live, tmp_path, epochs: list[int]) -> list[Node]:
    cfg = small_config(tmp_path)
    shards = write_shards(cfg, tmp_path / "shards")
    nodes = []
    for i, e in enumerate(epochs):
        ncfg = config_from_dict({"model": {"name": "logreg"}, "train": {"batch_size": 10, "lr": 0.05, "epochs": e}})
        name = f"client-{i:05d}"
        nodes.append(
            Node.from_config(
                live.url, live.tokens[name], load_shard(shards[i]), ncfg, torch.device("cpu"), None, poll_s=1.0
            )
        )
    return nodes


def test_fedbuff_with_nodes_of_different_speeds_completes(tmp_path):
    """Three nodes, one 30x slower; FedBuff with K = 2 makes 4 versions and stops them."""
    names = [f"client-{i:05d}" for i in range(3)]

    async def scenario():
        async with live_server(tmp_path, names, clock=True, sections=FEDBUFF_K2, **{**ASYNC, "eval": True}) as live:
            nodes = _nodes(live, tmp_path, [1, 1, 30])
            codes = await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 60)
            assert codes == [0, 0, 0]
            return live.service, nodes

    svc, nodes = asyncio.run(scenario())
    assert svc.version == 4 and svc.done
    stats = svc.rounds.stats
    assert stats.accepted >= 4
    assert sum(n.rounds_done for n in nodes) == stats.accepted
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    assert all(0 <= r["test_accuracy"] <= 1 for r in records)  # server-side evaluation on the held-out set


def test_async_checkpoint_restores_model_tasks_and_buffer(tmp_path):
    """A restarted async server holds the same model, version, open tasks and buffer."""
    names = ["n0", "n1", "n2"]

    async def scenario():
        async with live_server(tmp_path, names, sections=FEDBUFF_K2, **ASYNC) as live:
            svc = live.service
            now = time.monotonic()
            tasks = {n: svc.poll(n, now) for n in names}
            assert all(t["status"] == "work" and t["version"] == 0 for t in tasks.values())
            for n in names[:2]:  # fill FedBuff's buffer once: version 1
                body = encode_update(Update(torch.full((svc.spec.numel,), 0.01), 5, 0, n), svc.spec)
                svc.submit(n, body, now)
            return svc

    svc = asyncio.run(scenario())
    assert svc.version == 1 and latest_checkpoint(tmp_path / "ck") is not None
    again = open_service(small_config(tmp_path, FEDBUFF_K2, **ASYNC))
    assert again.version == 1 and torch.equal(again.rounds.global_params, svc.rounds.global_params)
    assert again.rounds.outstanding == svc.rounds.outstanding
    assert again.rounds.stats.accepted == svc.rounds.stats.accepted
    _, state = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    assert state["mode"] == "async" and state["rounds"]["version"] == 1
