"""server.max_connections: past the cap a new connection gets one 503 and is closed, while the
connections the server holds are still answered; a freed slot is taken again. Plain and TLS
(a TLS handshake in flight counts as a connection)."""

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
            # the fifth: one 503 line, then closed, without a request being read
            reader, writer = await _connect(port, ssl_client)
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
