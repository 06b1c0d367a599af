"""Slow senders cannot hold the upload buffers: an upload must keep server.min_upload_rate after
server.upload_grace_s, and a buffer is never held past the open round's deadline (real HTTP on
127.0.0.1, in the test's event loop)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from .hostile import good_update
from .live import live_server


async def _drip(url: str, token: str, body: bytes, every_s: float, step: int) -> tuple[int, dict, float]:
    """POST ``body`` to /v1/update ``step`` bytes at a time, one step every ``every_s`` seconds, until
    the server answers; (status, JSON answer, seconds from the first byte to the answer)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"POST /v1/update HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode())
    t0 = time.monotonic()
    answer = asyncio.ensure_future(reader.read(65536))
    sent = 0
    try:
        while not answer.done() and sent < len(body) - step:
            writer.write(body[sent : sent + step])
            sent += step
            await asyncio.wait({answer}, timeout=every_s)
        raw = await asyncio.wait_for(answer, 30)
    finally:
        writer.close()
    status = int(raw.split(b" ", 2)[1])
    return status, json.loads(raw.split(b"\r\n\r\n", 1)[1]), time.monotonic() - t0


async def _post(live, node: str, body: bytes) -> tuple[int, dict]:
    async with live.session(node) as s, s.post(live.url + "/v1/update", data=body) as r:
        return r.status, await r.json()


@pytest.mark.timeout(60)
def test_a_slow_drip_is_cut_after_the_grace_and_frees_the_only_buffer(tmp_path):
    async def main():
        server = {"min_upload_rate": 2000.0, "upload_grace_s": 1.0, "ingest_slots": 1, "clients_per_round": 2}
        async with live_server(tmp_path, ["n0", "n1"], **server) as live:
            svc = live.service
            for n in ("n0", "n1"):
                svc.seen(n, time.monotonic())
            assert svc.tick(time.monotonic()) and set(svc.rounds.selected) == {"n0", "n1"}
            body0, body1 = good_update(svc, "n0"), good_update(svc, "n1")
            drip = asyncio.ensure_future(_drip(live.url, live.tokens["n0"], body0, every_s=0.25, step=8))
            await asyncio.sleep(0.3)  # the drip holds the one buffer now
            status1, out1 = await _post(live, "n1", body1)  # waits for the buffer, gets it when the drip is cut
            status, out, took = await drip
            assert (status, out["error"]) == (408, "too_slow") and 1.0 <= took < 3.0, (status, out, took)
            assert "server.min_upload_rate" in out["detail"]
            assert status1 == 200, out1
            assert svc.counters.rejected.get("too_slow") == 1 and svc.counters.accepted == 1
            assert (await _post(live, "n0", body0))[0] == 200  # the node's real upload still goes in

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_held_buffer_never_outlives_the_round_deadline(tmp_path):
    async def main():
        server = {"min_upload_rate": 0.0, "deadline_s": 2.0, "body_timeout_s": 30.0, "clients_per_round": 1}
        async with live_server(tmp_path, ["n0"], **server) as live:
            svc = live.service
            svc.seen("n0", time.monotonic())
            assert svc.tick(time.monotonic())
            body = good_update(svc, "n0")
            status, out, took = await _drip(live.url, live.tokens["n0"], body, every_s=0.3, step=1)
            # cut at the round's deadline (+ 1 s), not after server.body_timeout_s or upload_timeout_s
            assert (status, out["error"]) == (408, "upload_timeout") and took < 4.5, (status, out, took)
            assert svc.counters.accepted == 0 and svc.version == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_async_upload_that_cannot_finish_before_its_task_is_too_stale_is_cut(tmp_path):
    """Async rounds: an upload above server.min_upload_rate, but at a rate that ends after its task
    is asynchronous.max_staleness versions old at the recent pace of versions, is cut after the
    grace (it would hold a buffer for an update that will be refused)."""

    async def main():
        server = {"mode": "async", "min_upload_rate": 100.0, "upload_grace_s": 0.5, "min_nodes": 1}
        sections = {"asynchronous": {"algorithm": "fedbuff", "buffer_size": 2, "max_staleness": 2}}
        async with live_server(tmp_path, ["n0"], sections=sections, **server) as live:
            svc = live.service
            assert svc.poll("n0", time.monotonic())["status"] == "work"  # n0 holds a task
            assert svc.upload_horizon("n0", time.monotonic()) is None  # no version made yet: no pace known
            svc.clock.interval, svc.clock.last_version = 0.05, (time.monotonic(), 0.0)  # versions 20 a second
            body = good_update(svc, "n0")
            status, out, _ = await _drip(live.url, live.tokens["n0"], body, every_s=0.25, step=64)  # 256 B/s
            assert (status, out["error"]) == (408, "too_slow") and "max_staleness" in out["detail"], out
            assert svc.counters.rejected.get("too_slow") == 1 and svc.counters.accepted == 0

    asyncio.run(main())
