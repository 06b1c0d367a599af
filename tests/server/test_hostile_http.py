"""Hostile HTTP against a live aggregator: every answer is JSON and never a 5xx for a known
fault; strict query parameters; slots and connections that a client cannot hold; the admin
routes behind their own token; no tracebacks when clients go away."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest
from aiohttp import web

from shoal.server.app import make_app
from shoal.server.http_common import CHANGED
from shoal.server.registry import Registry
from shoal.server.store import open_service

from .hostile import good_update
from .live import ADMIN, live_server, small_config

NODES = ["n0", "n1", "n2", "n3", "n4", "n5"]
FAST = {
    "body_timeout_s": 1.0,
    "upload_timeout_s": 3.0,
    "idle_timeout_s": 1.0,
    "ingest_slots": 2,
    "uploads_per_node": 1,
    "clients_per_round": 6,
    "min_nodes": 6,
}


async def raw_request(url: str, data: bytes, read_timeout: float = 5.0) -> tuple[int, dict | bytes]:
    """One request written as raw bytes; (status, JSON body or raw bytes)."""
    host, port = url.split("//")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        out = await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def get(path: str, token: str | bytes, extra: bytes = b"") -> bytes:
    tok = token.encode() if isinstance(token, str) else token
    return (
        f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n".encode()
        + b"Authorization: Bearer "
        + tok
        + b"\r\n"
        + extra
        + b"\r\n"
    )


def test_non_utf8_token_and_garbage_auth_are_401_json(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES[:1]) as live:
            for token in (b"\xff\xfe\xfd", b"\xc3\x28abc", "é" * 10, "a" * 300, "tok en", "tok!en"):
                status, body = await raw_request(live.url, get("/v1/task?wait=0", token))
                assert status == 401 and body["error"] == "unauthenticated", (token, status, body)
            status, body = await raw_request(live.url, get("/v1/task?wait=0", b"\x00\x7f"))
            assert status == 400  # refused by aiohttp's HTTP parser before any handler
            assert live.service.last_seen == {}

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_refused_caller_with_a_huge_body_is_answered_and_hung_up_on(tmp_path):
    """No token, a bad token or a node's token on an admin route, each claiming a 2 GiB body and
    sending 2 bytes: answered 401 at once and the connection closed, the body never waited for."""

    def post(path: str, auth: bytes) -> bytes:
        return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {2**31}\r\n".encode() + auth + b"\r\nab"

    async def scenario():
        async with live_server(tmp_path, NODES[:1]) as live:
            for path, auth in (
                ("/v1/update", b""),
                ("/v1/update", b"Authorization: Bearer " + b"x" * 43 + b"\r\n"),
                ("/v1/runs", b"Authorization: Bearer " + live.tokens["n0"].encode() + b"\r\n"),
            ):
                # read() returns at EOF: the server closed after its answer (8 s < its 10 s lingering)
                status, body = await raw_request(live.url, post(path, auth), read_timeout=8.0)
                assert status == 401 and body["error"] == "unauthenticated", (path, status, body)
            assert live.service.counters.accepted == 0 and live.service.last_seen == {}

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(
    "query",
    [
        "wait=nan",
        "wait=NaN",
        "wait=inf",
        "wait=-1",
        "wait=1e400",
        "wait=abc",
        "wait=1_0",
        "wait=0x10",
        "wait=" + "9" * 40,
        "wait=",
    ],
)
def test_query_seconds_are_parsed_strictly(tmp_path, query):
    async def scenario():
        async with live_server(tmp_path, NODES[:1], poll_s=30) as live:
            tok = live.tokens["n0"]
            t0 = time.monotonic()
            status, body = await raw_request(live.url, get(f"/v1/task?{query}", tok))
            assert (status, body["error"]) == (400, "bad_request"), body
            status, body = await raw_request(live.url, get(f"/v1/secagg/keys?round=1&{query}", tok))
            assert (status, body["error"]) == (400, "bad_request"), body
            assert time.monotonic() - t0 < 2  # answered, not held for poll_s
            for bad_round in ("x", "1_0", "-1", "1.0", "9" * 30, ""):
                status, body = await raw_request(live.url, get(f"/v1/secagg/keys?round={bad_round}&wait=0", tok))
                assert (status, body["error"]) == (400, "bad_request"), (bad_round, body)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_unknown_routes_and_methods_get_json_errors(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES[:1]) as live:
            async with live.session("n0") as http:
                async with http.get(live.url + "/v1/nothing") as resp:
                    assert resp.status == 404 and (await resp.json())["error"] == "not_found"
                async with http.delete(live.url + "/v1/task") as resp:
                    assert resp.status == 405 and (await resp.json())["error"] == "method_not_allowed"
                async with http.post(live.url + "/v1/update", data=b"x" * 10, chunked=True) as resp:
                    assert resp.status == 411 and (await resp.json())["error"] == "length_required"

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_unexpected_exception_is_a_500_json_and_the_server_goes_on(tmp_path, caplog):
    """The last line of defence: a handler that raises what nobody expected. The route is the
    test's own; the middleware around it is the server's."""

    async def boom(request):
        raise RuntimeError("a bug")

    async def scenario():
        cfg = small_config(tmp_path)
        registry = Registry(cfg.server.db)
        token = registry.add("n0")
        app = make_app(open_service(cfg), registry)
        app.router.add_get("/v1/boom", boom)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            with caplog.at_level(logging.ERROR, logger="shoal.server.http_common"):
                status, body = await raw_request(url, get("/v1/boom", token))
            assert status == 500 and body["error"] == "internal" and "nothing was applied" in body["detail"]
            assert [r for r in caplog.records if r.exc_info and "a bug" in str(r.exc_info[1])]
            status, body = await raw_request(url, get("/v1/task?wait=0", token))
            assert status == 200 and body["status"] == "wait"
        finally:
            await runner.cleanup()
            registry.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_status_and_metrics_need_the_admin_token(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES[:1]) as live:
            for who, status in ((None, 401), ("n0", 401), (ADMIN, 200)):
                async with live.session(who) as http:
                    for path in ("/v1/status", "/metrics"):
                        async with http.get(live.url + path) as resp:
                            assert resp.status == status, (who, path)
                            if status != 200:
                                assert (await resp.json())["error"] == "unauthenticated"
            async with live.session(ADMIN) as http:  # the admin is not a node
                async with http.get(live.url + "/v1/task", params={"wait": "0"}) as resp:
                    assert resp.status == 401
        async with live_server(tmp_path / "off", NODES[:1], admin_token_file="") as live:
            async with live.session("n0") as http:
                async with http.get(live.url + "/v1/status") as resp:
                    assert resp.status == 403 and (await resp.json())["error"] == "admin_disabled"

    (tmp_path / "off").mkdir()
    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_admin_token_file_is_checked_up_front(tmp_path):
    from shoal.errors import ConfigError

    (tmp_path / "short").write_text("abc")
    for path, why in ((tmp_path / "missing", "cannot be read"), (tmp_path / "short", "32 to 256")):
        cfg = small_config(tmp_path, admin_token_file=str(path))
        with pytest.raises(ConfigError, match=why):
            make_app(open_service(cfg), None)


def _upload_head(token: str, length: int, expect: bool) -> bytes:
    return (
        f"POST /v1/update HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n"
        + ("Expect: 100-continue\r\n" if expect else "")
        + "\r\n"
    ).encode()


def test_clients_that_send_no_body_hold_no_slot_and_are_timed_out(tmp_path, caplog):
    """Every node but one sends upload headers (with and without Expect: 100-continue) and
    then nothing or half a body: a good upload goes through once body_timeout_s frees a slot, each holder gets
    408 within body_timeout_s, every buffer is back, no traceback is logged."""

    async def scenario():
        async with live_server(tmp_path, NODES, **FAST) as live:
            svc = live.service
            now = time.monotonic()
            for n in NODES:
                svc.seen(n, now)
            assert svc.tick(now) and len(svc.rounds.selected) == 6
            body = good_update(svc, "n0")
            host, port = live.url.split("//")[1].rsplit(":", 1)
            held = []
            for i, n in enumerate(NODES[1:]):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(_upload_head(live.tokens[n], len(body), expect=i % 2 == 0))
                if i >= 3:
                    writer.write(body[: len(body) // 2])  # half a body, then silence
                await writer.drain()
                held.append((reader, writer))
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            async with live.session("n0") as http:
                async with http.post(live.url + "/v1/update", data=body, expect100=True) as resp:
                    assert resp.status == 200, await resp.text()
            # the two half-sent bodies hold both ingest slots until body_timeout_s (1 s) cuts them; the good
            # upload gets a slot then, not after upload_timeout_s (3 s), and the silent headers hold none
            assert time.monotonic() - t0 < 2.5
            for reader, writer in held:
                out = await asyncio.wait_for(reader.read(), 10)
                final = (
                    out.split(b"\r\n\r\n", 1)[0]
                    if not out.startswith(b"HTTP/1.1 100")
                    else out.split(b"\r\n\r\n", 1)[1]
                )
                assert final.startswith(b"HTTP/1.1 408"), out[:200]
                writer.close()
            assert live.app[CHANGED]["slots"].qsize() == svc.cfg.server.ingest_slots
            invites = live.app[CHANGED]["invites"]
            assert invites.qsize() == invites.maxsize and live.app[CHANGED]["uploads"] == {}
            assert svc.counters.accepted == 1 and svc.counters.rejected.get("body_timeout") == 5

    with caplog.at_level(logging.DEBUG):
        asyncio.run(asyncio.wait_for(scenario(), 30))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        (r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING
    ]


def test_one_node_cannot_hold_more_uploads_than_its_limit(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES, **FAST) as live:
            svc = live.service
            body = good_update(svc, "n1")
            host, port = live.url.split("//")[1].rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_upload_head(live.tokens["n1"], len(body), expect=False) + body[:10])
            await writer.drain()
            await asyncio.sleep(0.2)
            async with live.session("n1") as http:
                for expect in (True, False):
                    async with http.post(live.url + "/v1/update", data=body, expect100=expect) as resp:
                        assert resp.status == 429 and (await resp.json())["error"] == "too_many_uploads"
            writer.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_idle_and_half_sent_connections_are_closed(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES[:1], **FAST) as live:
            host, port = live.url.split("//")[1].rsplit(":", 1)
            for first in (b"", b"GET /v1/task?wait=0 HTTP/1.1\r\nHost: x\r\n"):  # nothing; headers never ended
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(first)
                await writer.drain()
                t0 = time.monotonic()
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
                assert time.monotonic() - t0 < 3
                writer.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_clients_that_go_away_leave_no_traceback(tmp_path, caplog):
    """Disconnects mid-body, while waiting for a slot, and during a long-poll."""

    async def scenario():
        server = {**FAST, "ingest_slots": 1, "body_timeout_s": 5.0, "poll_s": 5.0}
        async with live_server(tmp_path, NODES, **server) as live:
            svc = live.service
            now = time.monotonic()
            for n in NODES:
                svc.seen(n, now)
            assert svc.tick(now)
            body = good_update(svc, "n1")
            host, port = live.url.split("//")[1].rsplit(":", 1)
            conns = []
            for n in ("n1", "n2"):  # n1 takes the only slot mid-body; n2 waits for it with its first bytes
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(_upload_head(live.tokens[n], len(body), expect=False) + body[:100])
                await writer.drain()
                conns.append(writer)
                await asyncio.sleep(0.2)
            reader, writer = await asyncio.open_connection(host, int(port))  # a long-poll
            writer.write(get("/v1/task?wait=5", live.tokens["n0"]).replace(b"Connection: close", b"X: y"))
            await writer.drain()
            conns.append(writer)
            await asyncio.sleep(0.3)
            for w in conns:
                w.transport.abort()
            await asyncio.sleep(2.0)
            assert live.app[CHANGED]["slots"].qsize() == 1 and live.app[CHANGED]["uploads"] == {}
            assert live.app[CHANGED]["invites"].qsize() == live.app[CHANGED]["invites"].maxsize
            async with live.session("n3") as http:  # the server goes on
                async with http.post(live.url + "/v1/update", data=good_update(svc, "n3")) as resp:
                    assert resp.status == 200

    with caplog.at_level(logging.DEBUG):
        asyncio.run(asyncio.wait_for(scenario(), 30))
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING or (r.exc_info and r.levelno >= logging.INFO)]
    assert not bad, [(r.name, r.getMessage()) for r in bad]
