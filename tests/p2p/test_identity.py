"""Peer certificates (`shoal pki peer-cert`) and what the TLS layer says of a caller's: one
certificate serves and calls, and its subjectAltName hosts are what a message's sender is bound to
(p2p/identity.py). The handshake runs in memory (ssl.MemoryBIO): no sockets."""

from __future__ import annotations

import ssl

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
