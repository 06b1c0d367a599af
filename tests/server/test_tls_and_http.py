"""HTTPS with a CA the test makes, a node refusing a wrong certificate, ETag caching,
status JSON, Prometheus text and long-poll, against a live server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shoal.client.node import Node, NodeError
from shoal.config import config_from_dict
from shoal.shards import Shard
from shoal.tls import client_context, make_private_ca, server_context
from shoal.wire import decode_model

from .live import ADMIN, live_server


def _node(live, name: str, ctx) -> Node:
    cfg = config_from_dict({"model": {"name": "logreg"}})
    shard = Shard(name, torch.randn(20, 60), torch.randint(0, 10, (20,)), 10)
    return Node.from_config(live.url, live.tokens[name], shard, cfg, torch.device("cpu"), ctx, poll_s=1.0)


def test_tls_node_trusts_the_private_ca_and_refuses_another(tmp_path):
    good = make_private_ca(tmp_path / "pki")
    other = make_private_ca(tmp_path / "other", name="someone else's CA")

    async def scenario():
        async with live_server(tmp_path, ["n0"], ssl_context=server_context(good.cert, good.key), rounds=1) as live:
            live.service.rounds.version = 1  # already done: a trusting node is told so and stops
            assert await asyncio.wait_for(_node(live, "n0", client_context(good.ca_cert)).run(), 15) == 0
            with pytest.raises(NodeError, match="certificate"):
                await asyncio.wait_for(_node(live, "n0", client_context(other.ca_cert)).run(), 15)

    asyncio.run(asyncio.wait_for(scenario(), 40))


def test_model_etag_status_metrics_and_long_poll(tmp_path):
    async def scenario():
        async with live_server(tmp_path, ["n0", "n1"], clock=True, min_nodes=2, poll_s=5) as live:
            svc = live.service
            async with live.session("n0") as http:
                async with http.get(live.url + "/v1/model") as resp:
                    assert resp.status == 200
                    etag = resp.headers["ETag"]
                    params, header = decode_model(await resp.read(), svc.spec)
                assert header["version"] == 0 and torch.equal(params, svc.rounds.global_params)
                async with http.get(live.url + "/v1/model", headers={"If-None-Match": etag}) as resp:
                    assert resp.status == 304 and await resp.read() == b""
                # A long-poll returns the task as soon as the round opens.
                t0 = time.monotonic()
                poll = asyncio.ensure_future(http.get(live.url + "/v1/task", params={"wait": "5"}))
                await asyncio.sleep(0.2)
                assert not poll.done()
                svc.seen("n1", time.monotonic())  # the second node: the clock opens round 1
                resp = await poll
                task = await resp.json()
                assert task["status"] == "work" and task["round"] == 1 and task["version"] == 0
                assert time.monotonic() - t0 < 5
                async with http.get(live.url + "/v1/status") as resp:  # a node's token is not enough
                    assert resp.status == 401 and (await resp.json())["error"] == "unauthenticated"
            async with live.session(ADMIN) as http:
                async with http.get(live.url + "/v1/status") as resp:
                    st = await resp.json()
                assert st["round"] == 1 and st["version"] == 0 and st["round_open"]
                assert st["connected_nodes"] == ["n0", "n1"]
                async with http.get(live.url + "/metrics") as resp:
                    text = await resp.text()
                assert resp.headers["Content-Type"].startswith("text/plain")
                assert "shoal_version 0" in text and "shoal_connected_nodes 2" in text

    asyncio.run(asyncio.wait_for(scenario(), 30))
