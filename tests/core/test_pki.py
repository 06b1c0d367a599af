"""`shoal pki`: the CA, the server's certificate and node keys, made through the CLI and
checked the way they are used: TLS served by a real aiohttp server on 127.0.0.1 and verified
by a client; file modes; refusals of bad input."""

from __future__ import annotations

import asyncio
import ssl
import stat
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography import x509
from typer.testing import CliRunner

from shoal.cli import app
from shoal.errors import ConfigError
from shoal.pki import fingerprint, issue_server_cert, make_ca, make_node_key, read_node_csr, subject_alt_name
from shoal.tls import client_context, server_context


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ok(args: list[str]) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    return res.output


async def _get(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, host: str) -> dict:
    """GET /whoami over TLS from a real server on 127.0.0.1, dialled as ``host``."""

    async def whoami(request: web.Request) -> web.Response:
        ssl_object = request.transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        return web.json_response({"client": fingerprint(x509.load_der_x509_certificate(der)) if der else None})

    application = web.Application()
    application.router.add_get("/whoami", whoami)
    runner = web.AppRunner(application)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    port = runner.addresses[0][1]
    try:
        resolver = aiohttp.ThreadedResolver()
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=10), connector=aiohttp.TCPConnector(resolver=resolver)
        ) as s:
            async with s.get(f"https://{host}:{port}/whoami", ssl=client_ctx) as r:
                return await r.json()
    finally:
        await runner.cleanup()


def test_cli_makes_a_ca_server_cert_and_node_key_that_serve_and_verify_tls(tmp_path):
    pki, node_dir = tmp_path / "pki", tmp_path / "node"
    _ok(["pki", "ca", "--out", str(pki)])
    out = _ok(["pki", "server-cert", "--ca-dir", str(pki), "--host", "localhost", "--host", "127.0.0.1"])
    assert "server.tls_cert" in out
    out = _ok(["pki", "node-key", "--name", "edge-1", "--out", str(node_dir)])
    key, csr = node_dir / "edge-1.key", node_dir / "edge-1.csr"
    assert fingerprint(read_node_csr(csr, "edge-1")) in out
    for secret in (pki / "ca.key", pki / "server.key", key):  # private keys: this user only
        assert _mode(secret) == 0o600, secret
    cert = x509.load_pem_x509_certificate((pki / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]

    server_ctx = server_context(pki / "server.pem", pki / "server.key")
    for host in ("127.0.0.1", "localhost"):  # both names of the certificate verify
        assert asyncio.run(_get(server_ctx, client_context(pki / "ca.pem"), host)) == {"client": None}

    # The node's certificate, signed at enrollment, proves its key to a server that asks for one.
    _ok(["server", "nodes", "add", "edge-1", "--csr", str(csr), "--ca-dir", str(pki), "--db", str(tmp_path / "n.db")])
    mtls = server_context(pki / "server.pem", pki / "server.key", client_ca=pki / "ca.pem")
    got = asyncio.run(_get(mtls, client_context(pki / "ca.pem", node_dir / "edge-1.pem", key), "127.0.0.1"))
    assert got == {"client": fingerprint(read_node_csr(csr, "edge-1"))}


def test_a_certificate_for_another_host_or_from_another_ca_is_refused(tmp_path):
    make_ca(tmp_path / "a")
    make_ca(tmp_path / "b", name="someone else's CA")
    cert, key = issue_server_cert(tmp_path / "a", ["example.org"], tmp_path / "a")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):  # 127.0.0.1 is not in its subjectAltName
        asyncio.run(_get(server_context(cert, key), client_context(tmp_path / "a" / "ca.pem"), "127.0.0.1"))
    cert, key = issue_server_cert(tmp_path / "b", ["127.0.0.1"], tmp_path / "b")
    with pytest.raises(aiohttp.ClientConnectorCertificateError):  # signed by a CA the client does not trust
        asyncio.run(_get(server_context(cert, key), client_context(tmp_path / "a" / "ca.pem"), "127.0.0.1"))
    # A node certificate of another CA fails the handshake of a server that asks for its own CA's.
    node = make_node_key(tmp_path / "node", "n1")
    from shoal.pki import sign_node

    foreign = sign_node(tmp_path / "b", read_node_csr(node.csr, "n1"), "n1", tmp_path / "n1.pem")
    a_cert, a_key = issue_server_cert(tmp_path / "a", ["127.0.0.1"], tmp_path / "a2")
    mtls = server_context(a_cert, a_key, client_ca=tmp_path / "a" / "ca.pem")
    with pytest.raises(aiohttp.ClientError):
        asyncio.run(_get(mtls, client_context(tmp_path / "a" / "ca.pem", foreign, node.key), "127.0.0.1"))


@pytest.mark.parametrize(
    "host, message",
    [
        ("", "host name or IP"),
        ("https://example.org", "not a URL"),
        ("example.org:8443", "without a port"),
        ("exa mple.org", "neither an IP address nor a DNS name"),
        ("-bad-.org", "neither an IP address nor a DNS name"),
        ("*.org", "wildcard"),
    ],
)
def test_bad_hosts_are_refused_with_the_fix(host, message):
    with pytest.raises(ConfigError, match=message):
        subject_alt_name(host)


def test_refusals_name_the_input_and_the_fix(tmp_path):
    make_ca(tmp_path / "pki")
    with pytest.raises(ConfigError, match="already holds a CA"):  # a CA is never replaced by accident
        make_ca(tmp_path / "pki")
    with pytest.raises(ConfigError, match="1 to 3650 days"):
        make_ca(tmp_path / "other", days=0)
    with pytest.raises(ConfigError, match="--host is needed"):
        issue_server_cert(tmp_path / "pki", [], tmp_path / "pki")
    with pytest.raises(ConfigError, match="ca.pem not found"):
        issue_server_cert(tmp_path / "nowhere", ["localhost"], tmp_path / "x")
    make_ca(tmp_path / "other")
    (tmp_path / "pki" / "ca.pem").write_bytes((tmp_path / "other" / "ca.pem").read_bytes())
    with pytest.raises(ConfigError, match="not the key of ca.pem"):
        issue_server_cert(tmp_path / "pki", ["localhost"], tmp_path / "x")
    with pytest.raises(ConfigError, match="node name"):
        make_node_key(tmp_path / "node", "bad name!")
    node = make_node_key(tmp_path / "node", "n1")
    with pytest.raises(ConfigError, match="made once"):
        make_node_key(tmp_path / "node", "n1")
    with pytest.raises(ConfigError, match="made for node 'n1', not 'n2'"):
        read_node_csr(node.csr, "n2")
    (tmp_path / "junk.csr").write_text("not a request")
    with pytest.raises(ConfigError, match="not a PEM certificate request"):
        read_node_csr(tmp_path / "junk.csr", "n1")
    res = CliRunner().invoke(app, ["server", "nodes", "add", "n1", "--csr", str(node.csr), "--db", str(tmp_path / "d")])
    assert res.exit_code != 0 and "--ca-dir" in str(res.exception)
