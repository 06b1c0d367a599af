"""TLS contexts against a real aiohttp server on 127.0.0.1 with certificates made here."""

import asyncio
import ssl

import aiohttp
import pytest
from aiohttp import web

from shoal.errors import ConfigError
from shoal.tls import client_context, make_private_ca, server_context


async def _serve_and_get(server_ctx, client_ctx):
    app = web.Application()
    app.router.add_get("/ping", lambda r: web.json_response({"ok": True}))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(f"https://127.0.0.1:{port}/ping", ssl=client_ctx) as r:
                return await r.json()
    finally:
        await runner.cleanup()


def test_client_trusts_its_private_ca(tmp_path):
    pki = make_private_ca(tmp_path)
    got = asyncio.run(_serve_and_get(server_context(pki.cert, pki.key), client_context(pki.ca_cert)))
    assert got == {"ok": True}


def test_client_refuses_a_certificate_from_another_ca(tmp_path):
    pki = make_private_ca(tmp_path / "a")
    other = make_private_ca(tmp_path / "b")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(_serve_and_get(server_context(pki.cert, pki.key), client_context(other.ca_cert)))


def test_missing_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="tls.cert"):
        server_context(tmp_path / "nope.pem", tmp_path / "nope.key")
    with pytest.raises(ConfigError, match="--ca-cert"):
        client_context(tmp_path / "nope.pem")
    assert isinstance(client_context(), ssl.SSLContext)
