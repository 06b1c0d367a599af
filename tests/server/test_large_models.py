"""A model larger than one request (server.max_body_bytes): chunked downloads and uploads that go on
after a lost connection from the offset they had, each chunk checked as it arrives, the upload
summed from its staging file a block at a time; a bad chunk ends its upload with nothing summed;
half precision on the wire halves the bytes of an update."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
import torch

from shoal.aggregation.compression import Encoded, OutOfHalfRange, to_half
from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.server.http_common import CHUNKS
from shoal.shards import Shard
from shoal.update import Update
from shoal.wire import decode_model, encode_update

from .hostile import good_update
from .live import live_server

SMALL = 500  # bytes a request may carry; the logreg model is ~2.5 KB: 5 or 6 chunks each way


def _shard(i: int) -> Shard:
    g = torch.Generator().manual_seed(i)
    return Shard(f"n{i}", torch.randn(20, 60, generator=g), torch.randint(0, 10, (20,), generator=g), 10)


class CutOnce:
    """A TCP proxy to the server that cuts one connection, once: ``keep`` bytes after ``trigger``
    appears in what the node sends (``up``: the cut is in the node's request body) or in the
    server's answer that follows it (``down``)."""

    def __init__(self, port: int, trigger: bytes, keep: int, up: bool):
        self.port, self.trigger, self.keep, self.up = port, trigger, keep, up
        self.cut = False

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, node_r, node_w) -> None:
        srv_r, srv_w = await asyncio.open_connection("127.0.0.1", self.port)
        conn: dict = {"armed": False, "count": 0, "writers": (node_w, srv_w)}  # this connection's state
        await asyncio.gather(self._pipe(node_r, srv_w, True, conn), self._pipe(srv_r, node_w, False, conn))

    async def _pipe(self, r, w, upward: bool, conn: dict) -> None:
        try:
            while data := await r.read(65536):
                start = 0  # where this direction's counted bytes begin in ``data``
                if upward and not self.cut and not conn["armed"] and self.trigger in data:
                    conn["armed"] = True
                    start = data.index(self.trigger) + len(self.trigger) if self.up else 0
                if conn["armed"] and upward == self.up and not self.cut:
                    room = self.keep - conn["count"]
                    if len(data) - start > room:
                        w.write(data[: start + room])
                        await w.drain()
                        self.cut = True
                        for x in conn["writers"]:
                            x.close()
                        return
                    conn["count"] += len(data) - start
                w.write(data)
                await w.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            w.close()

    def close(self) -> None:
        self.server.close()


@pytest.mark.timeout(90)
def test_chunked_transfers_resume_after_lost_connections_and_train_the_same_model(tmp_path):
    cfg = config_from_dict({"model": {"name": "logreg"}, "train": {"batch_size": 10, "lr": 0.05}})

    async def run(max_body: int, cut: str | None, sum_dtype: str = "auto") -> tuple[torch.Tensor, dict]:
        where = tmp_path / f"{max_body}-{cut}-{sum_dtype}"
        where.mkdir()
        server = {"rounds": 2, "min_nodes": 2, "clients_per_round": 2, "poll_s": 1.0, "max_body_bytes": max_body}
        async with live_server(where, ["n0", "n1"], clock=True, sum_dtype=sum_dtype, **server) as live:
            assert live.service.sync is not None
            assert live.service.sync.strategy.aggregator.dtype == getattr(torch, sum_dtype, torch.float64)
            url0, proxy = live.url, None
            if cut is not None:
                port = int(live.url.rsplit(":", 1)[1])
                # download: the answer to the second range, cut in its body (~400 bytes of headers, 500 of
                # model); upload: the answer to the chunk at byte 500, cut: the server has the chunk, the
                # node does not know, asks where the upload stands and goes on from there
                trigger = b"Range: bytes=500-" if cut == "download" else b"offset=500 "
                proxy = CutOnce(port, trigger, 600 if cut == "download" else 20, up=False)
                url0 = await proxy.start()
            nodes = [
                Node.from_config(u, live.tokens[f"n{i}"], _shard(i), cfg, torch.device("cpu"), None, 1.0)
                for i, u in ((0, url0), (1, live.url))
            ]
            await asyncio.wait_for(asyncio.gather(*(n.run(signals=False) for n in nodes)), 60)
            if proxy is not None:
                proxy.close()
                assert proxy.cut, "the proxy never cut the connection"
            svc = live.service
            # a chunk sent again after the cut (aiohttp repeats an idempotent PUT) is answered, not refused
            assert svc.counters.accepted == 4 and not svc.counters.rejected, svc.counters
            assert not live.app[CHUNKS].sessions
            return svc.rounds.global_params.clone(), {**nodes[0].resumed, "repeats": live.app[CHUNKS].repeats}

    whole, _ = asyncio.run(run(0, None))
    for cut in ("download", "upload"):
        params, resumed = asyncio.run(run(SMALL, cut))
        # went on from its offset, not from the start: the node asked where the upload stands, or the
        # chunk whose answer was cut came again (aiohttp repeats an idempotent PUT) and was answered
        assert resumed[cut] >= 1 or (cut == "upload" and resumed["repeats"] >= 1), resumed
        assert torch.equal(whole, params), cut
    # a float32 sum (server.sum_dtype, for large models): the same model to float32 summation error
    params, _ = asyncio.run(run(SMALL, None, "float32"))
    torch.testing.assert_close(params, whole, rtol=1e-6, atol=1e-7)


@pytest.mark.timeout(60)
def test_a_bad_chunk_ends_its_upload_with_nothing_summed(tmp_path):
    async def main():
        async with live_server(tmp_path, ["n0", "n1"], max_body_bytes=SMALL, min_nodes=2) as live:
            svc = live.service
            now = time.monotonic()
            for n in ("n0", "n1"):
                svc.seen(n, now)
            assert svc.tick(now) and svc.rounds.open
            good = good_update(svc, "n0")
            bad = bytearray(good)
            bad[-8:-4] = torch.tensor([float("nan")]).numpy().tobytes()  # a NaN in the last chunk
            agg = svc.sync.strategy.aggregator

            async def upload(s, body: bytes) -> list[tuple[int, dict]]:
                async with s.post(
                    live.url + "/v1/uploads", json={"size": len(body), "sha256": hashlib.sha256(body).hexdigest()}
                ) as r:
                    up = (await r.json())["upload"]
                answers = []
                for offset in range(0, len(body), SMALL):
                    part = bytes(body[offset : offset + SMALL])
                    headers = {"X-Shoal-Chunk-Sha256": hashlib.sha256(part).hexdigest()}
                    async with s.put(
                        live.url + f"/v1/uploads/{up}", params={"offset": str(offset)}, data=part, headers=headers
                    ) as r:
                        answers.append((r.status, await r.json()))
                return answers

            async with live.session("n0") as s0, live.session("n1") as s1:
                answers = await upload(s0, bytes(bad))
                assert [a[0] for a in answers[:-1]] == [200] * (len(answers) - 1)
                assert answers[-1][0] == 400 and answers[-1][1]["error"] == "non_finite", answers[-1]
                assert agg.count == 0 and not live.app[CHUNKS].sessions  # nothing summed, the upload over
                assert svc.refused_task["n0"] == (svc.rounds.round, svc.version)  # not handed out again
                before = svc.rounds.global_params.clone()
                answers = await upload(s1, good_update(svc, "n1"))
                assert answers[-1][0] == 200 and answers[-1][1]["status"] == "accepted"
                # streamed from its staging file into the plain mean; the round closed with it (n0 was refused)
                assert svc.version == 1 and svc.counters.accepted == 1
                assert torch.allclose(svc.rounds.global_params, before + 0.01, rtol=0, atol=1e-7)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_half_precision_halves_the_update_and_refuses_what_it_cannot_hold(tmp_path):
    async def run(encoding: str) -> tuple[torch.Tensor, int]:
        where = tmp_path / encoding
        where.mkdir()
        cfg = config_from_dict(
            {
                "model": {"name": "logreg"},
                "train": {"batch_size": 10, "lr": 0.05},
                "compression": {"encoding": encoding},
            }
        )
        server = {"rounds": 2, "min_nodes": 2, "clients_per_round": 2, "poll_s": 1.0}
        async with live_server(where, ["n0", "n1"], clock=True, **server) as live:
            nodes = [
                Node.from_config(live.url, live.tokens[f"n{i}"], _shard(i), cfg, torch.device("cpu"), None, 1.0)
                for i in (0, 1)
            ]
            await asyncio.wait_for(asyncio.gather(*(n.run(signals=False) for n in nodes)), 40)
            svc = live.service
            assert svc.counters.accepted == 4 and not svc.counters.rejected
            return svc.rounds.global_params.clone(), svc.counters.bytes_received // 4

    dense, dense_bytes = asyncio.run(run("dense"))
    for encoding, tol in (("float16", 1e-3), ("bfloat16", 1e-2)):
        half, half_bytes = asyncio.run(run(encoding))
        numel = dense.numel()
        assert half_bytes - numel * 2 == pytest.approx(dense_bytes - numel * 4, abs=64)  # the header alone differs
        assert torch.allclose(half, dense, atol=tol), (encoding, (half - dense).abs().max())
    with pytest.raises(OutOfHalfRange, match="beyond float16"):
        to_half(torch.tensor([1.0, 70000.0]), "float16")
    assert torch.isfinite(to_half(torch.tensor([1.0, 70000.0]), "bfloat16").float()).all()


def test_a_float16_update_that_decodes_to_inf_is_refused(tmp_path):
    async def main():
        async with live_server(tmp_path, ["n0"], min_nodes=1, max_delta_abs=0.0) as live:
            svc = live.service
            now = time.monotonic()
            svc.seen("n0", now)
            assert svc.tick(now)
            delta = torch.zeros(svc.spec.numel, dtype=torch.float16)
            delta[3] = float("inf")  # what a node without the range check would send
            upd = Update(delta.float(), 10, svc.version, "n0")
            body = encode_update(
                upd, svc.spec, {"round": svc.rounds.round}, payload=Encoded("float16", {"delta": delta})
            )
            async with live.session("n0") as s, s.post(live.url + "/v1/update", data=body) as r:
                assert r.status == 400 and (await r.json())["error"] == "non_finite"
            assert svc.sync.strategy.aggregator.count == 0

    asyncio.run(main())


def test_model_ranges_digests_and_refusals(tmp_path):
    async def main():
        async with live_server(tmp_path, ["n0"]) as live:
            svc = live.service
            async with live.session("n0") as s:
                async with s.get(live.url + "/v1/model") as r:
                    whole, etag, digest = await r.read(), r.headers["ETag"], r.headers["X-Shoal-Sha256"]
                assert hashlib.sha256(whole).hexdigest() == digest
                params, header = decode_model(bytearray(whole), svc.spec, copy=False)  # the same model, in place
                assert torch.equal(params, svc.rounds.global_params) and header["version"] == svc.version
                async with s.get(live.url + "/v1/model", headers={"Range": "bytes=100-299", "If-Match": etag}) as r:
                    part = await r.read()
                    assert r.status == 206 and r.headers["Content-Range"] == f"bytes 100-299/{len(whole)}"
                    assert part == whole[100:300]
                    assert r.headers["X-Shoal-Chunk-Sha256"] == hashlib.sha256(part).hexdigest()
                    assert r.headers["X-Shoal-Sha256"] == digest
                async with s.get(live.url + "/v1/model", headers={"Range": f"bytes={len(whole) - 10}-"}) as r:
                    assert r.status == 206 and await r.read() == whole[-10:]
                for bad in (f"bytes={len(whole)}-", "bytes=5-2", "bytes=0-1,5-9", "items=0-9", "bytes=-5"):
                    async with s.get(live.url + "/v1/model", headers={"Range": bad}) as r:
                        assert r.status == 416 and (await r.json())["error"] == "bad_range", bad
                async with s.get(live.url + "/v1/model", headers={"Range": "bytes=0-9", "If-Match": '"x-v9"'}) as r:
                    assert r.status == 412 and (await r.json())["error"] == "version_changed"

    asyncio.run(main())


def test_the_round_sum_is_float32_from_a_512_mb_model_up_unless_the_config_says():
    from shoal.privacy_state import LARGE_MODEL_NUMEL, sum_dtype

    assert LARGE_MODEL_NUMEL * 4 == 512 * 2**20
    assert sum_dtype("auto", LARGE_MODEL_NUMEL) == torch.float32
    assert sum_dtype("auto", LARGE_MODEL_NUMEL - 1) == torch.float64
    assert sum_dtype("float64", 10 * LARGE_MODEL_NUMEL) == torch.float64
    assert sum_dtype("float32", 10) == torch.float32
