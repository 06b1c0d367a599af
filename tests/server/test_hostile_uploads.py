"""Hostile uploads over real HTTP, sync and async: each gets its own 4xx with the JSON error
body, and the model, version, open tasks and counters stay exactly as they were (in async the
refusal comes before the node's task is closed, so the node can still send its real update)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from .hostile import good_update, update_cases
from .live import live_server

NODES = ["n0", "n1", "n2"]
ASYNC = {"mode": "async", "rounds": 4, "poll_s": 1.0}
FEDBUFF_K2 = {"asynchronous": {"algorithm": "fedbuff", "buffer_size": 2}}


def snapshot(svc):
    r, c = svc.rounds, svc.counters
    common = (r.global_params.clone(), r.version, c.accepted, c.bytes_received, c.rounds_completed, c.rounds_abandoned)
    if svc.mode == "async":
        s = r.stats
        return common + (
            dict(r.outstanding),
            s.accepted,
            dict(s.rejected),
            s.examples,
            s.loss_sum,
            r.algorithm.state_dict()["count"] if hasattr(r.algorithm, "state_dict") else None,
        )
    return common + (r.round, set(r.received), r.strategy.num_accumulated, dict(r.rejected))


def same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1:] == b[1:]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_hostile_upload_gets_its_4xx_and_changes_nothing(tmp_path, mode):
    server = dict(ASYNC) if mode == "async" else {"clients_per_round": 2, "min_nodes": 3}
    sections = FEDBUFF_K2 if mode == "async" else None

    async def scenario():
        async with live_server(tmp_path, NODES, sections=sections, **server) as live:
            svc = live.service
            now = time.monotonic()
            if mode == "sync":
                for n in NODES:
                    svc.seen(n, now)
                assert svc.tick(now) and svc.rounds.open
                node = sorted(svc.rounds.selected)[0]
            else:
                node = "n0"
                assert svc.poll(node, now)["status"] == "work"
            before = snapshot(svc)
            cases = update_cases(svc, node)
            async with live.session(node) as http:
                for case, (body, status, code) in cases.items():
                    async with http.post(live.url + "/v1/update", data=body) as resp:
                        info = await resp.json()
                        assert (resp.status, info["error"]) == (status, code), (case, info)
                        assert isinstance(info["detail"], str) and 0 < len(info["detail"]) < 1000, case
                    same(snapshot(svc), before)
                assert sum(svc.counters.rejected.values()) == len(cases)
                # the node's task is still open: its real update is accepted
                async with http.post(live.url + "/v1/update", data=good_update(svc, node)) as resp:
                    assert resp.status == 200, await resp.text()
            assert svc.counters.accepted == 1

    asyncio.run(asyncio.wait_for(scenario(), 60))
