"""Compressed uploads over HTTP: a good one is taken; one whose header lies is a 400
with a JSON error naming the fault, and the round is left exactly as it was; client
nodes configured with [compression] upload top-k and the server finishes its rounds."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.aggregation.compression import Compressor, quantize_q8
from shoal.client.node import Node
from shoal.config import CompressionConfig, config_from_dict
from shoal.shards import Shard
from shoal.update import Update
from shoal.wire import encode, encode_update

from .live import live_server
from .test_validation import NODES, _open_round, _same, _selected_unselected, _snapshot


def _header(svc, node):
    return {
        "kind": "update",
        "spec_hash": svc.spec.hash,
        "base_version": svc.version,
        "num_examples": 10,
        "sender": node,
        "metrics": {},
        "round": svc.rounds.round,
    }


def _lie(case: str, svc, node: str) -> bytes:
    n, h = svc.spec.numel, _header(svc, node)
    q, scale = quantize_q8(torch.randn(n), 16)
    idx = torch.arange(0, 8, 2, dtype=torch.int32)
    match case:
        case "topk_wrong_k":
            return encode({"indices": idx, "values": torch.ones(4)}, {**h, "encoding": "topk", "k": 5})
        case "topk_index_out_of_range":
            return encode({"indices": idx + n, "values": torch.ones(4)}, {**h, "encoding": "topk", "k": 4})
        case "topk_unsorted":
            return encode({"indices": idx.flip(0), "values": torch.ones(4)}, {**h, "encoding": "topk", "k": 4})
        case "q8_wrong_length":
            return encode({"q": q[:-1], "scale": scale}, {**h, "encoding": "q8", "chunk": 16})
        case "q8_wrong_chunk":
            return encode({"q": q, "scale": scale}, {**h, "encoding": "q8", "chunk": 8})
        case "q8_bad_scale":
            return encode({"q": q, "scale": -scale}, {**h, "encoding": "q8", "chunk": 16})
    raise AssertionError(case)


CASES = {
    "topk_wrong_k": "spec_mismatch",
    "topk_index_out_of_range": "malformed",
    "topk_unsorted": "malformed",
    "q8_wrong_length": "spec_mismatch",
    "q8_wrong_chunk": "spec_mismatch",
    "q8_bad_scale": "malformed",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lying_compressed_header_is_a_400_and_changes_nothing(tmp_path, case):
    async def scenario():
        async with live_server(tmp_path, NODES, clients_per_round=2, min_nodes=3) as live:
            svc = live.service
            _open_round(svc)
            chosen, _ = _selected_unselected(svc)
            before = _snapshot(svc)
            async with live.session(chosen) as http:
                async with http.post(live.url + "/v1/update", data=_lie(case, svc, chosen)) as resp:
                    status, info = resp.status, await resp.json()
            assert (status, info["error"]) == (400, CASES[case]), info
            assert info["detail"]
            _same(_snapshot(svc), before)
            # The same node's honest top-k upload is then taken.
            delta = torch.randn(svc.spec.numel)
            payload = Compressor(CompressionConfig(encoding="topk", topk_fraction=0.25)).encode(delta, chosen)
            upd = Update(delta, num_examples=10, base_version=svc.version, sender=chosen)
            body = encode_update(upd, svc.spec, {"round": svc.rounds.round}, payload=payload, zstd_level=3)
            async with live.session(chosen) as http:
                async with http.post(live.url + "/v1/update", data=body) as resp:
                    assert resp.status == 200, await resp.text()
            assert svc.counters.accepted == before[5] + 1

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_nodes_upload_top_k_and_the_server_finishes_its_rounds(tmp_path):
    async def scenario():
        async with live_server(
            tmp_path, ["n0", "n1"], clock=True, min_nodes=2, clients_per_round=2, rounds=2, poll_s=1
        ) as live:
            cfg = config_from_dict(
                {"model": {"name": "logreg"}, "compression": {"encoding": "topk", "topk_fraction": 0.1}}
            ).validate()
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    Shard(n, torch.randn(20, 60), torch.randint(0, 10, (20,)), 10),
                    cfg,
                    torch.device("cpu"),
                    None,
                    poll_s=1.0,
                )
                for n in ("n0", "n1")
            ]
            assert await asyncio.gather(*(n.run() for n in nodes)) == [0, 0]
            svc = live.service
            assert svc.version == 2 and svc.counters.accepted == 4
            dense = len(encode_update(Update(torch.zeros(svc.spec.numel), 1), svc.spec))
            assert svc.counters.bytes_received < 0.5 * 4 * dense  # 61 of 610 coordinates + header

    asyncio.run(asyncio.wait_for(scenario(), 40))
