"""No secret in a log: a server is sent malformed requests that carry the admin token, a node's
token and a session cookie (in headers the parser refuses, in the request line, in a login form),
with every logger at DEBUG into a file; then no token appears in any file the test wrote, nor in
any answer the server gave."""

from __future__ import annotations

import asyncio
import logging
import secrets

import pytest

from shoal.pki import write_secret
from shoal.server.app import serve
from shoal.server.registry import Registry
from shoal.server.store import open_service

from ..p2p.processes import free_ports
from .live import small_config


async def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; what the server answers before it closes (or 2 s)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        try:
            async with asyncio.timeout(2):
                while chunk := await reader.read(65536):
                    out += chunk
        except (TimeoutError, ConnectionError):
            pass
        return out
    finally:
        writer.close()


@pytest.mark.timeout(60)
def test_no_token_reaches_a_log_line_or_an_answer(tmp_path):
    (port,) = free_ports(1)
    admin = secrets.token_urlsafe(32)
    write_secret(tmp_path / "admin.token", admin.encode())
    cfg = small_config(tmp_path, port=port, admin_token_file=str(tmp_path / "admin.token"))
    registry = Registry(cfg.server.db)
    node = registry.add("n0")
    cookie = secrets.token_urlsafe(24)
    unknown = secrets.token_urlsafe(32)  # a token the server never saw (a guess, a typo)
    tokens = {"admin": admin, "node": node, "cookie": cookie, "unknown": unknown}

    log_file = tmp_path / "server.log"
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    H = "Host: 127.0.0.1\r\n"
    probes = [
        # a header value with a control byte: aiohttp's parser quotes the raw line in its error
        f"GET /v1/task HTTP/1.1\r\n{H}Authorization: Bearer {node}\x01\r\n\r\n".encode(),
        f"GET /v1/status HTTP/1.1\r\n{H}Authorization: Bearer {admin}\x7f\r\nCookie: s={cookie}\x00\r\n\r\n".encode(),
        # a broken request line with the token in the query
        f"GET /v1/task?token={admin} HTTP/9.9 junk\r\n{H}\r\n".encode(),
        # a header line over aiohttp's limit, holding the token
        f"GET /v1/task HTTP/1.1\r\n{H}Authorization: Bearer {admin}{'A' * 9000}\r\n\r\n".encode(),
        # non-UTF-8 bytes around a token
        b"GET /v1/task HTTP/1.1\r\n" + H.encode() + b"Authorization: Bearer \xff\xfe" + unknown.encode() + b"\r\n\r\n",
        # well-formed requests with a wrong or right token where a log line might repeat it
        f"GET /v1/status HTTP/1.1\r\n{H}Authorization: Bearer {unknown}\r\nConnection: close\r\n\r\n".encode(),
        f"GET /v1/task?wait=0 HTTP/1.1\r\n{H}Authorization: Bearer {node}\r\nConnection: close\r\n\r\n".encode(),
        f"GET / HTTP/1.1\r\n{H}Cookie: __Host-shoal-session={cookie}\r\nConnection: close\r\n\r\n".encode(),
        (
            f"POST /login HTTP/1.1\r\n{H}Origin: http://evil.example\r\nContent-Type: application/x-www-form-urlencoded"
            f"\r\nContent-Length: {len(admin) + 6}\r\nConnection: close\r\n\r\ntoken={admin}"
        ).encode(),
        f"POST /v1/update HTTP/1.1\r\n{H}Authorization: Bearer {node}\r\nContent-Length: 5\r\n\r\n{{bad".encode(),
    ]

    async def main() -> list[bytes]:
        stop = asyncio.Event()
        server = asyncio.ensure_future(serve(open_service(cfg), registry, None, stop))
        try:
            for _ in range(200):
                try:
                    (await asyncio.open_connection("127.0.0.1", port))[1].close()
                    break
                except OSError:
                    await asyncio.sleep(0.05)
            answers = [await _raw(port, p) for p in probes]
            logging.getLogger("aiohttp.server").exception("a line that quotes %s", f"Authorization: Bearer {node}")
            return answers
        finally:
            stop.set()
            await asyncio.wait_for(server, 20)

    try:
        answers = asyncio.run(main())
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        handler.close()
        registry.close()
    statuses = [a.split(b" ", 2)[1] if a.startswith(b"HTTP/1.") else b"none" for a in answers]
    assert sum(s.startswith(b"4") for s in statuses) >= 7, statuses  # refused, not dropped silently
    text = log_file.read_text(errors="replace")
    assert "malformed HTTP request" in text and "[redacted]" in text  # the requests were logged, redacted
    for path in [p for p in tmp_path.rglob("*") if p.is_file()]:
        if path.name in ("admin.token",):
            continue  # the token file itself
        data = path.read_bytes()
        for what, token in tokens.items():
            assert token.encode() not in data, f"the {what} token appears in {path}"
    for answer in answers:
        for what, token in tokens.items():
            assert token.encode() not in answer, f"the {what} token is echoed in an answer: {answer[:300]!r}"
