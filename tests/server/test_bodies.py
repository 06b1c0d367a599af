"""server/bodies.py's bounded body reader through the routes that use it, on a live server at
127.0.0.1 over raw sockets: no Content-Length is a 411, one over the route's limit a 413 answered
at once (the body is never read, the connection is hung up on), a body that stalls a 408 after
server.body_timeout_s (a node's report too, which once waited for its body without a limit); the
relay routes for edge aggregators read no body from a caller that is not an edge; each refusal
of a report is counted, and nothing changes."""

from __future__ import annotations

import asyncio
import json
import time

from .live import live_server

NODES = ["n0", "n1"]
TIMEOUT_S = 1.0


async def _raw(
    url: str, head: str, body: bytes = b"", hold_s: float = 0.0, kept: bool = False
) -> tuple[int, dict, float, bool]:
    """Send ``head`` and ``body`` (then keep the connection open ``hold_s`` without sending more):
    the status, the JSON answer, seconds to the answer, and whether the server hung up after it
    (not looked at when ``kept``: the connection stays open for the next request)."""
    host, port = url.rsplit("/", 1)[-1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    t0 = time.monotonic()
    writer.write(head.encode() + b"\r\n" + body)
    await writer.drain()
    try:
        status_line = await asyncio.wait_for(reader.readline(), 10 + hold_s)
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        took = time.monotonic() - t0
        answer = json.loads(await reader.readexactly(int(headers["content-length"])))
        closed = not kept and await asyncio.wait_for(reader.read(1), 5) == b""
    finally:
        writer.close()
    return int(status_line.split()[1]), answer, took, closed


def test_bounded_bodies_refused_before_they_are_read_or_after_the_timeout(tmp_path) -> None:
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path) -> None:
    async with live_server(tmp_path, NODES, body_timeout_s=TIMEOUT_S, min_nodes=2) as live:
        svc = live.service
        token = live.tokens["n0"]

        def head(path: str, length: int | None, extra: str = "") -> str:
            size = f"Content-Length: {length}\r\n" if length is not None else ""
            return f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n{size}{extra}"

        before = (svc.version, svc.counters.accepted, dict(svc.counters.rejected))
        # a report (POST /v1/failed): no length, over the limit (2 of a claimed GiB sent), stalled
        status, answer, _, _ = await _raw(
            live.url, head("/v1/failed", None, "Transfer-Encoding: chunked\r\n"), b"0\r\n\r\n", kept=True
        )
        assert (status, answer["error"]) == (411, "length_required") and "report" in answer["detail"]
        status, answer, took, closed = await _raw(live.url, head("/v1/failed", 1 << 30), b"{}")
        assert (status, answer["error"], closed) == (413, "too_large", True) and took < TIMEOUT_S, (answer, took)
        status, answer, took, closed = await _raw(live.url, head("/v1/failed", 100), b'{"round"', hold_s=3 * TIMEOUT_S)
        assert (status, answer["error"], closed) == (408, "body_timeout", True), answer
        assert TIMEOUT_S <= took < TIMEOUT_S + 2.0, took
        rejected = svc.counters.rejected
        assert [rejected.get(k, 0) - before[2].get(k, 0) for k in ("length_required", "too_large", "body_timeout")] == [
            1,
            1,
            1,
        ]
        # a JSON body of the root's own routes (an edge's poll): the same refusals, the same codes
        status, answer, took, closed = await _raw(live.url, head("/v1/edge/poll?wait=0", 1 << 30), b"{}")
        assert (status, answer["error"], closed) == (413, "too_large", True) and took < TIMEOUT_S
        status, answer, took, _ = await _raw(live.url, head("/v1/edge/poll?wait=0", 50), b"{", hold_s=3 * TIMEOUT_S)
        assert (status, answer["error"]) == (408, "body_timeout") and took < TIMEOUT_S + 2.0
        # the relay routes of edge aggregators: a node's body (here 2 of a claimed MiB) is not read at all
        status, answer, took, closed = await _raw(live.url, head("/v1/edge/secagg/keys?node=n1", 1 << 20), b"{}")
        assert (status, answer["error"], closed) == (403, "not_an_edge", True) and took < TIMEOUT_S, (answer, took)
        assert (svc.version, svc.counters.accepted) == before[:2]
