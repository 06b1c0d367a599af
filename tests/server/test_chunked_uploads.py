"""Chunked uploads: an update larger than server.max_body_bytes travels in chunks, each checked
(offset, size, SHA-256) with nothing changed by a bad one, the whole checked at the end; a
stalled upload is dropped at its deadline. Node loops through a server whose requests are
smaller than one update train to the same model, bit for bit, as through one without chunks."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import torch

from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.server.http_common import CHUNKS
from shoal.shards import Shard

from .hostile import good_update
from .live import live_server

NODES = ["n0", "n1", "n2", "n3", "n4"]
SMALL = 1000  # bytes a request may carry; the logreg update is ~2.8 KB


def _shard(i: int) -> Shard:
    g = torch.Generator().manual_seed(i)
    return Shard(f"n{i}", torch.randn(20, 60, generator=g), torch.randint(0, 10, (20,), generator=g), 10)


@pytest.mark.timeout(60)
def test_nodes_train_the_same_model_through_chunks(tmp_path):
    cfg = config_from_dict({"model": {"name": "logreg"}, "train": {"batch_size": 10, "lr": 0.05}})

    async def run(max_body: int) -> tuple[torch.Tensor, dict, int]:
        where = tmp_path / str(max_body)
        where.mkdir()
        server = {"rounds": 2, "min_nodes": 2, "clients_per_round": 2, "poll_s": 1.0, "max_body_bytes": max_body}
        async with live_server(where, ["n0", "n1"], clock=True, **server) as live:
            nodes = [
                Node.from_config(live.url, live.tokens[f"n{i}"], _shard(i), cfg, torch.device("cpu"), None, 1.0)
                for i in (0, 1)
            ]
            await asyncio.wait_for(asyncio.gather(*(n.run(signals=False) for n in nodes)), 40)
            svc = live.service
            return svc.rounds.global_params.clone(), dict(svc.counters.rejected), svc.counters.accepted

    whole, _, accepted = asyncio.run(run(0))
    chunked, rejected, accepted_chunked = asyncio.run(run(SMALL))
    assert accepted == accepted_chunked == 4 and not rejected, rejected
    assert torch.equal(whole, chunked)


@pytest.mark.timeout(60)
def test_hostile_chunks_change_nothing_and_a_stalled_upload_is_dropped(tmp_path):
    async def main():
        async with live_server(tmp_path, NODES, max_body_bytes=SMALL, upload_timeout_s=2.0, min_nodes=5) as live:
            svc, chunks = live.service, live.app[CHUNKS]
            now = time.monotonic()
            for n in NODES:
                svc.seen(n, now)
            assert svc.tick(now) and svc.rounds.open
            body = good_update(svc, "n0")
            assert len(body) > 2 * SMALL
            whole = hashlib.sha256(body).hexdigest()

            async def call(s, method, path, **kw):
                async with s.request(method, live.url + path, **kw) as r:
                    return r.status, await r.json()

            def put(s, upload, offset, data, digest=None):
                headers = {"X-Shoal-Chunk-Sha256": digest or hashlib.sha256(data).hexdigest()}
                return call(
                    s, "PUT", f"/v1/uploads/{upload}", params={"offset": str(offset)}, data=data, headers=headers
                )

            async with live.session("n0") as s, live.session("n1") as other:
                too_big = {"size": svc.update_limit + 1, "sha256": whole}
                assert (await call(s, "POST", "/v1/uploads", json=too_big))[0] == 413
                assert (await call(s, "POST", "/v1/uploads", json={"size": len(body)}))[0] == 400
                status, opened = await call(s, "POST", "/v1/uploads", json={"size": len(body), "sha256": whole})
                assert status == 201 and opened["chunk_bytes"] == SMALL, opened
                up = opened["upload"]
                status, info = await put(s, up, 5, body[5 : 5 + SMALL])  # not where the server is
                assert (status, info["error"], info["received"]) == (409, "bad_offset", 0)
                assert (await put(s, up, 0, body[: SMALL + 1]))[0] == 413  # over one request
                assert (await put(s, up, 0, body[:SMALL], digest="0" * 64))[1]["error"] == "bad_digest"
                async with s.put(live.url + f"/v1/uploads/{up}", params={"offset": "0"}, data=body[:SMALL]) as r:
                    assert r.status == 400 and (await r.json())["error"] == "bad_digest"  # no digest at all
                assert (await call(s, "GET", f"/v1/uploads/{up}"))[1]["received"] == 0  # nothing counted
                assert (await put(s, up, 0, body[:SMALL]))[1] == {"upload": up, "received": SMALL}
                refused = dict(svc.counters.rejected)
                status, info = await put(s, up, 0, body[:SMALL])  # the same chunk again (its answer was lost)
                assert (status, info) == (200, {"upload": up, "received": SMALL, "again": True})
                assert svc.counters.rejected == refused  # not a refusal, and nothing staged twice
                status, info = await put(s, up, 0, body[: SMALL - 1])  # another chunk over bytes taken: an overlap
                assert (status, info["error"], info["received"]) == (409, "bad_offset", SMALL)
                assert (await call(other, "GET", f"/v1/uploads/{up}"))[0] == 404  # not n1's upload
                assert (await put(other, up, SMALL, body[SMALL : 2 * SMALL]))[0] == 404
                version, accepted = svc.version, svc.counters.accepted
                offset = SMALL
                while offset < len(body):
                    status, answer = await put(s, up, offset, body[offset : offset + SMALL])
                    offset += SMALL
                assert status == 200 and answer["status"] == "accepted", answer
                assert svc.counters.accepted == accepted + 1 and not chunks.sessions

                # every chunk right, the whole not what the upload was opened with: refused, nothing added
                body1 = good_update(svc, "n1")
                opened = (await call(other, "POST", "/v1/uploads", json={"size": len(body1), "sha256": whole}))[1]
                for offset in range(0, len(body1), SMALL):
                    status, answer = await put(other, opened["upload"], offset, body1[offset : offset + SMALL])
                assert (status, answer["error"]) == (400, "bad_digest")
                assert svc.counters.accepted == accepted + 1 and svc.version == version and not chunks.sessions

                # at most server.ingest_slots (4) uploads open: the fifth node waits
                sessions = []
                for n in ("n1", "n2", "n3", "n4"):
                    async with live.session(n) as t:
                        sessions.append(
                            await call(t, "POST", "/v1/uploads", json={"size": len(body1), "sha256": whole})
                        )
                assert [st for st, _ in sessions] == [201] * 4
                # n0 reported its update: it holds no task, so it opens no upload (a session holds a buffer)
                status, info = await call(s, "POST", "/v1/uploads", json={"size": len(body), "sha256": whole})
                assert (status, info["error"]) == (409, "no_task")
                # stalled: past server.upload_timeout_s (2 s) an upload is gone and its buffer freed
                await asyncio.sleep(2.2)
                status, info = await put(other, sessions[0][1]["upload"], 0, body1[:SMALL])
                assert (status, info["error"]) == (410, "upload_expired")
                chunks.expire(time.monotonic())  # what the server's clock does
                assert not chunks.sessions
                assert svc.version == version

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_federation_run_larger_than_one_request_trains_in_chunks(tmp_path):
    """A run whose updates are larger than the federation's server.max_body_bytes is taken (not
    refused as too large) and its node daemons upload in chunks."""
    from .federation_live import live_federation
    from .test_federation import run_config

    async def main():
        async with live_federation(tmp_path, ["n0", "n1", "n2"], max_body_bytes=256) as f:
            for n in ("n0", "n1", "n2"):
                f.start_node(n)
            run = await f.submit(run_config(rounds=2))
            st = await f.wait_ended(run, 40)
            assert st["status"] == "finished", st
            return run

    run = asyncio.run(main())
    lines = [x for x in (tmp_path / "fed" / run / "metrics.jsonl").read_text().splitlines() if "train_loss" in x]
    assert len(lines) == 2 and all('"num_results": 3' in x for x in lines), lines
