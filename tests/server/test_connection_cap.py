"""The connection guard in front of the server (shoal/connection_guard.py, server/connections.py).

server.max_connections: past the cap a connection that sends its request gets one 503 and is
closed, while the connections the server holds are still answered; a freed slot is taken again.
Plain and TLS. And silent sockets cannot lock anyone out: a crowd of them is dropped at the
handshake deadline (the oldest first when they overflow the pending bound), enrolled nodes'
connections go on being served and new connections with a client certificate are admitted, also
when strangers hold every slot outside the reserve."""

from __future__ import annotations

import asyncio

import pytest

from shoal.pki import issue_server_cert, make_ca
from shoal.server.app import serve
from shoal.server.registry import Registry
from shoal.server.store import open_service
from shoal.tls import client_context, server_context

from ..p2p.processes import free_ports
from .live import small_config


async def _connect(port: int, ssl_ctx) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ssl_ctx, server_hostname="127.0.0.1" if ssl_ctx else None), 10
    )


async def _get(conn, token: str) -> bytes:
    reader, writer = conn
    writer.write(f"GET /v1/task?wait=0 HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", [False, True])
def test_connections_past_the_cap_are_refused_and_the_others_still_answered(tmp_path, tls):
    (port,) = free_ports(1)
    cfg = small_config(tmp_path, port=port, max_connections=4)
    registry = Registry(cfg.server.db)
    token = registry.add("n0")
    ssl_server = ssl_client = None
    if tls:
        make_ca(tmp_path / "pki")
        cert, key = issue_server_cert(tmp_path / "pki", ["127.0.0.1"], tmp_path / "pki")
        ssl_server, ssl_client = server_context(cert, key), client_context(tmp_path / "pki" / "ca.pem")

    async def main():
        stop = asyncio.Event()
        server = asyncio.ensure_future(serve(open_service(cfg), registry, ssl_server, stop))
        try:
            held = []
            for _ in range(200):  # the server starts listening
                try:
                    held.append(await _connect(port, ssl_client))
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            while len(held) < 4:
                held.append(await _connect(port, ssl_client))
            for conn in held:  # served once its first request head is in
                assert await _get(conn, token) == b"HTTP/1.1 200 OK"
            # the fifth: one 503 line for its request, then closed
            reader, writer = await _connect(port, ssl_client)
            writer.write(f"GET /v1/task?wait=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
            answer = await asyncio.wait_for(reader.read(), 10)
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable"), answer
            assert b'"too_many_connections"' in answer and b"server.max_connections" in answer
            writer.close()
            # the held connections are served as before
            for conn in held:
                assert await _get(conn, token) == b"HTTP/1.1 200 OK"
            # one closed: its slot is taken by a new connection (once the server saw it go)
            held.pop()[1].close()
            for _ in range(100):
                conn = await _connect(port, ssl_client)
                try:
                    if await _get(conn, token) == b"HTTP/1.1 200 OK":
                        break
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass  # refused: the server has not yet seen the other one close
                conn[1].close()
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a freed connection slot was never taken again")
            held.append(conn)
            for _, w in held:
                w.close()
        finally:
            stop.set()
            await asyncio.wait_for(server, 20)

    try:
        asyncio.run(main())
    finally:
        registry.close()


async def _ask(conn, token: str | None = None) -> bytes:
    """One GET /v1/task?wait=0 on ``conn``: its status line (a token, or the client certificate)."""
    reader, writer = conn
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(f"GET /v1/task?wait=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}\r\n".encode())
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")).split(b":")[1])
    await asyncio.wait_for(reader.readexactly(length), 10)
    return head.split(b"\r\n", 1)[0]


async def _renew_silent(port: int, stop: asyncio.Event, into: list, most: int = 1500) -> None:
    """Open silent sockets from the same address, one after another, until ``stop`` (or ``most``)."""
    while not stop.is_set() and most > 0:
        into.append(await _connect(port, None))
        most -= 1
        await asyncio.sleep(0)


async def _closed_by_server(conn) -> bool:
    try:
        return await asyncio.wait_for(conn[0].read(), 10) == b""
    except ConnectionError:
        return True  # aborted (a reset)


@pytest.mark.timeout(90)
def test_silent_sockets_and_strangers_cannot_lock_out_enrolled_nodes(tmp_path):
    """300 TCP sockets that never send a byte, then strangers (TLS, no client certificate)
    holding every slot outside the reserve: an enrolled node's open connection is still served,
    new connections with a node certificate are admitted, a stranger past its share gets 503,
    and every silent socket is dropped by the handshake deadline (or earlier, to make room)."""
    from shoal.pki import fingerprint, make_node_key, read_node_csr, sign_node

    (port,) = free_ports(1)
    pki = tmp_path / "pki"
    make_ca(pki)
    cert, key = issue_server_cert(pki, ["127.0.0.1"], pki)
    made = make_node_key(tmp_path / "node", "k0")
    csr = read_node_csr(made.csr, "k0")
    node_cert = sign_node(pki, csr, "k0", tmp_path / "node" / "k0.pem")
    cfg = small_config(
        tmp_path,
        port=port,
        tls_cert=str(cert),
        tls_key=str(key),
        tls_client_ca=str(pki / "ca.pem"),
        max_connections=16,
        reserved_connections=8,
        handshake_timeout_s=1.5,
        max_pending_connections=64,
        pending_per_address=32,
    )
    registry = Registry(cfg.server.db)
    token = registry.add("n0")
    registry.add_key("k0", fingerprint(csr))
    mtls = server_context(cert, key, client_ca=pki / "ca.pem")
    with_cert = client_context(pki / "ca.pem", node_cert, made.key)
    without = client_context(pki / "ca.pem")

    async def main():
        stop = asyncio.Event()
        server = asyncio.ensure_future(serve(open_service(cfg), registry, mtls, stop))
        held = []
        try:
            for _ in range(200):  # the server starts listening
                try:
                    enrolled = await _connect(port, with_cert)
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            assert await _ask(enrolled) == b"HTTP/1.1 200 OK"  # served, by its certificate
            silent = await asyncio.gather(*[_connect(port, None) for _ in range(300)])
            assert await _ask(enrolled) == b"HTTP/1.1 200 OK"  # the crowd does not touch it
            crowd = asyncio.Event()
            renewing = asyncio.ensure_future(_renew_silent(port, crowd, silent))  # and more, as fast as it can
            await asyncio.sleep(0.2)
            for _ in range(5):  # new enrolled connections get through the crowd
                conn = await _connect(port, with_cert)
                held.append(conn)
                assert await _ask(conn) == b"HTTP/1.1 200 OK"
            crowd.set()
            await renewing
            # strangers (no certificate, a valid token) fill what is outside the reserve: 16 - 8
            answers = []
            for _ in range(9):
                conn = await _connect(port, without)
                held.append(conn)
                try:
                    answers.append(await _ask(conn, token))
                except (asyncio.IncompleteReadError, ConnectionError):
                    answers.append(b"closed")
            assert answers[:8] == [b"HTTP/1.1 200 OK"] * 8 and answers[8] == b"HTTP/1.1 503 Service Unavailable"
            conn = await _connect(port, with_cert)  # the reserve still admits a node certificate
            held.append(conn)
            assert await _ask(conn) == b"HTTP/1.1 200 OK"
            # every silent socket is dropped: most at once to make room, the rest at the deadline
            assert all(await asyncio.gather(*[_closed_by_server(c) for c in silent]))
            assert await _ask(enrolled) == b"HTTP/1.1 200 OK"
            # a socket that opens TLS and then sends nothing is dropped too
            quiet = await _connect(port, with_cert)
            assert await _closed_by_server(quiet)
            held.append(enrolled)
        finally:
            for _, w in held:
                w.close()
            stop.set()
            await asyncio.wait_for(server, 20)

    try:
        asyncio.run(main())
    finally:
        registry.close()
