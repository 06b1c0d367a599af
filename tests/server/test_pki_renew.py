"""Certificate renewal (`shoal pki renew`) and the researcher tokens file (`shoal server
researcher-token`): what they write, the file modes, and that a renewed server certificate
serves TLS to a node trusting the same CA."""

from __future__ import annotations

import asyncio
import datetime as dt
import stat

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from typer.testing import CliRunner

from shoal.cli import app
from shoal.config import config_from_dict
from shoal.pki import fingerprint, issue_server_cert, make_ca, make_node_key, read_node_csr, sign_node
from shoal.server.app_base import researcher_tokens
from shoal.server.registry import hash_token
from shoal.tls import client_context, server_context


def _certs(path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def _sans(cert: x509.Certificate) -> list[str]:
    return sorted(str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _handshake(cert, key, ca) -> bool:
    """A real TLS handshake on 127.0.0.1 with the server's certificate, the client trusting ``ca``."""

    async def main() -> bool:
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=server_context(cert, key))
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", port, ssl=client_context(ca), server_hostname="127.0.0.1"), 10
            )
            writer.close()
            return True
        finally:
            server.close()
            await server.wait_closed()

    return asyncio.run(main())


def test_renew_a_server_certificate_keeping_or_rotating_its_key_and_a_node_certificate(tmp_path):
    cli = CliRunner()
    pki = tmp_path / "pki"
    make_ca(pki)
    cert, key = issue_server_cert(pki, ["127.0.0.1", "localhost"], pki, days=10)
    old = _certs(cert)[0]

    # same key, same hosts, a new validity; the chain still ends with the CA's certificate
    out = cli.invoke(app, ["pki", "renew", "--ca-dir", str(pki), "--cert", str(cert), "--days", "400"])
    assert out.exit_code == 0, out.output
    assert "server certificate renewed for 127.0.0.1, localhost" in out.output and "same key" in out.output
    chain = _certs(cert)
    new = chain[0]
    assert chain[1] == _certs(pki / "ca.pem")[0]
    assert new.serial_number != old.serial_number and _sans(new) == _sans(old) == ["127.0.0.1", "localhost"]
    assert fingerprint(new) == fingerprint(old) and new.subject == old.subject
    assert new.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=399)
    assert _mode(key) == 0o600 and _handshake(cert, key, pki / "ca.pem")

    # a rotated key: a new private key over the old file (0600), other hosts when told
    old_key = key.read_bytes()
    out = cli.invoke(
        app,
        ["pki", "renew", "--ca-dir", str(pki), "--cert", str(cert), "--rotate-key", str(key), "--host", "127.0.0.1"],
    )
    assert out.exit_code == 0, out.output
    rotated = _certs(cert)[0]
    assert key.read_bytes() != old_key and _mode(key) == 0o600
    private = serialization.load_pem_private_key(key.read_bytes(), None)
    assert fingerprint(private.public_key()) == fingerprint(rotated) != fingerprint(new)  # type: ignore[arg-type]
    assert _sans(rotated) == ["127.0.0.1"] and _handshake(cert, key, pki / "ca.pem")
    assert not list(pki.glob(".*.tmp"))  # written through a temporary file, renamed

    # a node's certificate: the node's key stays on the node, so its registry fingerprint still matches
    made = make_node_key(tmp_path / "node", "edge-1")
    node_pem = sign_node(pki, read_node_csr(made.csr, "edge-1"), "edge-1", tmp_path / "node" / "edge-1.pem", 5)
    before = _certs(node_pem)[0]
    out = cli.invoke(app, ["pki", "renew", "--ca-dir", str(pki), "--cert", str(node_pem)])
    assert out.exit_code == 0 and "node certificate renewed" in out.output, out.output
    after = _certs(node_pem)[0]
    assert fingerprint(after) == fingerprint(before) and after.subject == before.subject
    assert after.not_valid_after_utc > before.not_valid_after_utc
    for flags, says in (
        (["--rotate-key", str(tmp_path / "k")], "never leaves the node"),
        (["--host", "example.org"], "--host is for a server certificate"),
    ):
        out = cli.invoke(app, ["pki", "renew", "--ca-dir", str(pki), "--cert", str(node_pem), *flags])
        assert out.exit_code != 0 and says in out.output + str(out.exception), out
    assert _certs(node_pem)[0] == after  # refused: nothing written

    # another CA's certificate is not renewed by this one
    other = tmp_path / "other"
    make_ca(other)
    out = cli.invoke(app, ["pki", "renew", "--ca-dir", str(other), "--cert", str(cert)])
    assert out.exit_code != 0 and "was not issued by the CA" in str(out.exception), out


def test_researcher_tokens_file_is_made_0600_and_read_by_the_server(tmp_path):
    cli = CliRunner()
    tokens = tmp_path / "researchers"
    out = cli.invoke(
        app, ["server", "researcher-token", "ada", "--tokens-file", str(tokens), "--token-out", str(tmp_path / "ada")]
    )
    assert out.exit_code == 0, out.output
    out = cli.invoke(app, ["server", "researcher-token", "bob", "--tokens-file", str(tokens)])
    assert out.exit_code == 0, out.output
    bob = out.output.strip().splitlines()[-1]  # shown once
    assert _mode(tokens) == 0o600 and _mode(tmp_path / "ada") == 0o600
    ada = (tmp_path / "ada").read_text().strip()
    cfg = config_from_dict({"federation": {"enabled": True, "researcher_tokens_file": str(tokens)}})
    assert researcher_tokens(cfg) == {hash_token(ada): "ada", hash_token(bob): "bob"}

    out = cli.invoke(app, ["server", "researcher-token", "ada", "--tokens-file", str(tokens)])
    assert out.exit_code != 0 and "already has a researcher 'ada'" in str(out.exception)
    out = cli.invoke(app, ["server", "researcher-token", "admin", "--tokens-file", str(tokens)])
    assert out.exit_code != 0 and "not 'admin'" in str(out.exception)
    out = cli.invoke(app, ["server", "researcher-token", "ada", "--tokens-file", str(tokens), "--remove"])
    assert out.exit_code == 0, out.output
    assert researcher_tokens(cfg) == {hash_token(bob): "bob"} and _mode(tokens) == 0o600
