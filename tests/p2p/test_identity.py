"""Peer certificates (`shoal pki peer-cert`) and what the TLS layer says of a caller's: one
certificate serves and calls, and its subjectAltName hosts are what a message's sender is bound to
(p2p/identity.py). The handshake runs in memory (ssl.MemoryBIO): no sockets."""

from __future__ import annotations

import asyncio
import ssl

import pytest
from typer.testing import CliRunner

from shoal.cli import app
from shoal.p2p.cli import is_peer_certificate
from shoal.p2p.identity import cert_hosts, sender_matches
from shoal.pki import issue_server_cert, make_ca
from shoal.tls import client_context, server_context


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, host: str) -> ssl.SSLObject:
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    cli = client.wrap_bio(c_in, c_out, server_hostname=host)
    done = {"s": False, "c": False}
    for _ in range(20):
        for name, obj in (("c", cli), ("s", srv)):
            if not done[name]:
                try:
                    obj.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            break
    assert all(done.values())
    return srv


def test_a_peer_certificate_serves_and_calls_and_names_its_hosts(tmp_path):
    make_ca(tmp_path / "pki", "test CA", 30)
    result = CliRunner().invoke(
        app,
        [
            "pki",
            "peer-cert",
            "--ca-dir",
            str(tmp_path / "pki"),
            "--name",
            "a",
            "--host",
            "127.0.0.1",
            "--host",
            "a.example",
            "--out",
            str(tmp_path / "a"),
        ],
    )
    assert result.exit_code == 0, result.output
    cert, key, ca = tmp_path / "a" / "a.pem", tmp_path / "a" / "a.key", tmp_path / "pki" / "ca.pem"
    assert is_peer_certificate(cert)
    server_only, _ = issue_server_cert(tmp_path / "pki", ["127.0.0.1"], tmp_path / "s", 30)
    assert not is_peer_certificate(server_only)  # a server certificate: no client use, no binding
    srv = _handshake(server_context(cert, key, client_ca=ca), client_context(ca, cert, key), "a.example")
    hosts = cert_hosts(srv.getpeercert())
    assert hosts == frozenset({"127.0.0.1", "a.example"})
    assert sender_matches("https://a.example:9000", hosts) and sender_matches("https://127.0.0.1:1", hosts)
    assert not sender_matches("https://b.example:9000", hosts)
    anonymous = _handshake(server_context(cert, key, client_ca=ca), client_context(ca), "a.example")
    assert cert_hosts(anonymous.getpeercert()) is None  # no client certificate: token identity only


async def _open(port: int, ctx: ssl.SSLContext | None, source: str):
    return await asyncio.wait_for(
        asyncio.open_connection(
            "127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1" if ctx else None, local_addr=(source, 0)
        ),
        10,
    )


async def _status_line(conn, request: bytes) -> bytes:
    reader, writer = conn
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0]


@pytest.mark.timeout(90)
def test_a_crowd_from_12_addresses_cannot_lock_out_certified_peers_or_status(tmp_path):
    """The peer's connection guard (p2p/connections.py over shoal/connection_guard.py), on
    loopback: 12 source addresses x 64 connections, 10 of each a TLS caller without a
    certificate that sends a request head and never its body (held: served), the rest silent
    sockets. One address holds at most 1/16 of the slots open to callers without a certificate
    (7 of 112 here, not 64), so the crowd holds 84 and a 13th address still gets /status; a
    peer with a client certificate has its own reserved slots and exchanges."""
    from aiohttp import web

    from shoal.p2p.connections import Connections, GuardedRunner, guarded_site

    make_ca(tmp_path / "pki", "test CA", 30)
    ca = tmp_path / "pki" / "ca.pem"
    cert, key = issue_server_cert(tmp_path / "pki", ["127.0.0.1"], tmp_path / "p", 30, client_auth=True)
    with_cert, without = client_context(ca, cert, key), client_context(ca)
    guard = Connections(64, header_timeout=60.0, idle_timeout=60.0, total=128)
    assert (guard.reserved, guard.per_address) == (16, 7)

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def gossip(request: web.Request) -> web.Response:
        return web.json_response({"bytes": len(await request.read())})  # a slow caller's body never comes

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/status", status)
        app.router.add_post("/gossip", gossip)
        runner = GuardedRunner(app, guard, access_log=None)
        await runner.setup()
        site = guarded_site(runner, "127.0.0.1", 0, server_context(cert, key, client_ca=ca), guard)
        await site.start()
        assert site.guard is not None
        port = site.guard.sockets[0].getsockname()[1]
        held: list = []
        slow_head = b"POST /gossip HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
        try:
            crowd = [f"127.0.0.{a}" for a in range(2, 14)]  # 12 source addresses
            for source in crowd:
                held += await asyncio.gather(*[_open(port, None, source) for _ in range(54)])  # silent
                for _ in range(10):  # slow: a head, then nothing
                    conn = await _open(port, without, source)
                    held.append(conn)
                    conn[1].write(slow_head)
                    await conn[1].drain()
            g = site.guard
            for _ in range(400):  # until every slow head is in (a bounded wait on the guard's counters)
                if g.refused >= 12 * 3:
                    break
                await asyncio.sleep(0.05)
            assert g.refused == 12 * 3  # per address, the 3 slow ones past its 7 got 503
            assert g.served_by_address == dict.fromkeys(crowd, 7) and g.served == 84
            get = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"
            conn = await _open(port, without, "127.0.0.1")
            held.append(conn)
            assert await _status_line(conn, get) == b"HTTP/1.1 200 OK"  # a 13th address: a slot is left
            body = b"x" * 10
            push = b"POST /gossip HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n" + body
            for source in ("127.0.0.2", "127.0.0.1"):  # a certified peer, from a crowded address too
                conn = await _open(port, with_cert, source)
                held.append(conn)
                assert await _status_line(conn, push) == b"HTTP/1.1 200 OK"
        finally:
            for _, w in held:
                w.close()
            await runner.cleanup()

    asyncio.run(main())
