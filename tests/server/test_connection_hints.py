"""One line, with the fix, for the ways a node's first connection goes wrong: a certificate
without subjectAltName, a certificate for another host, http:// against an HTTPS server,
https:// against a plain-HTTP one. Real servers on 127.0.0.1, certificates made here."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shoal.client.node import Node, NodeError
from shoal.config import config_from_dict
from shoal.pki import issue_server_cert, load_ca, make_ca
from shoal.shards import Shard
from shoal.tls import client_context, server_context

from .live import live_server


def _node(url: str, token: str, ctx) -> Node:
    cfg = config_from_dict({"model": {"name": "logreg"}})
    shard = Shard("n0", torch.randn(20, 60), torch.randint(0, 10, (20,)), 10)
    return Node.from_config(url, token, shard, cfg, torch.device("cpu"), ctx, poll_s=1.0)


def _cert_without_san(tmp_path, ca_dir):
    """What a hand-made openssl certificate often is: the host only in the common name."""
    ca_cert, ca_key = load_ca(ca_dir)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    (tmp_path / "nosan.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "nosan.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return tmp_path / "nosan.pem", tmp_path / "nosan.key"


async def _first_error(live, url: str, ctx) -> str:
    with pytest.raises(NodeError) as e:
        await asyncio.wait_for(_node(url, live.tokens["n0"], ctx).run(), 15)
    return str(e.value)


def test_certificate_hints_name_the_fix(tmp_path):
    make_ca(tmp_path / "pki")
    trust = client_context(tmp_path / "pki" / "ca.pem")

    async def scenario():
        nosan = server_context(*_cert_without_san(tmp_path, tmp_path / "pki"))
        async with live_server(tmp_path / "a", ["n0"], ssl_context=nosan) as live:
            msg = await _first_error(live, live.url, trust)
            assert "no subjectAltName" in msg and "shoal pki server-cert" in msg and "--host 127.0.0.1" in msg
            assert "--ca-cert" not in msg  # it was given: the old hint pointed the wrong way
        other = server_context(*issue_server_cert(tmp_path / "pki", ["example.org"], tmp_path / "other"))
        async with live_server(tmp_path / "b", ["n0"], ssl_context=other) as live:
            msg = await _first_error(live, live.url, trust)
            assert "is for example.org, not '127.0.0.1'" in msg
            msg = await _first_error(live, live.url, client_context())  # the system store: not our CA
            assert "not signed by a CA this node trusts" in msg and "--ca-cert" in msg

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_wrong_scheme_is_one_line_not_endless_retries(tmp_path):
    make_ca(tmp_path / "pki")
    tls = server_context(*issue_server_cert(tmp_path / "pki", ["127.0.0.1"], tmp_path / "pki"))

    async def scenario():
        async with live_server(tmp_path / "a", ["n0"], ssl_context=tls) as live:
            msg = await _first_error(live, live.url.replace("https://", "http://"), None)
            assert "speaks HTTPS" in msg and live.url in msg
        async with live_server(tmp_path / "b", ["n0"]) as live:  # plain HTTP (--insecure)
            msg = await _first_error(live, live.url.replace("http://", "https://"), client_context())
            assert "speaks plain HTTP" in msg and live.url in msg

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    asyncio.run(asyncio.wait_for(scenario(), 60))
