"""Node enrollment by key against a live server on 127.0.0.1 (no token on the wire), and
the modes of the files that hold secrets: token files and the node registry."""

from __future__ import annotations

import asyncio
import logging
import stat

import pytest
import torch
from typer.testing import CliRunner

from shoal.cli import app
from shoal.client.node import Node, NodeError
from shoal.config import config_from_dict
from shoal.pki import fingerprint, issue_server_cert, make_ca, make_node_key, read_node_csr, sign_node
from shoal.server.registry import Registry
from shoal.shards import Shard
from shoal.tls import client_context, server_context

from .live import live_server


def _node(url: str, ctx, token: str = "") -> Node:
    cfg = config_from_dict({"model": {"name": "logreg"}})
    shard = Shard("edge-1", torch.randn(20, 60), torch.randint(0, 10, (20,)), 10)
    return Node.from_config(url, token, shard, cfg, torch.device("cpu"), ctx, poll_s=1.0)


def test_a_node_enrolled_by_key_logs_in_with_its_certificate_until_revoked(tmp_path):
    pki = tmp_path / "pki"
    make_ca(pki)
    cert, key = issue_server_cert(pki, ["127.0.0.1"], pki)
    made = make_node_key(tmp_path / "node", "edge-1")
    csr = read_node_csr(made.csr, "edge-1")
    node_cert = sign_node(pki, csr, "edge-1", tmp_path / "node" / "edge-1.pem")
    mtls = server_context(cert, key, client_ca=pki / "ca.pem")

    async def scenario():
        async with live_server(tmp_path, ["token-node"], ssl_context=mtls, rounds=1) as live:
            live.registry.add_key("edge-1", fingerprint(csr))
            live.service.rounds.version = 1  # already done: an authenticated node is told so and stops
            with_key = client_context(pki / "ca.pem", node_cert, made.key)
            assert await asyncio.wait_for(_node(live.url, with_key).run(), 15) == 0
            assert "edge-1" in live.service.told_done  # the server knew it by its key's name
            # Token nodes still work beside key nodes (the server asks for a certificate, optionally).
            plain = client_context(pki / "ca.pem")
            assert await asyncio.wait_for(_node(live.url, plain, live.tokens["token-node"]).run(), 15) == 0
            with pytest.raises(NodeError, match="401"):  # neither a token nor a certificate
                await asyncio.wait_for(_node(live.url, plain).run(), 15)
            live.registry.revoke("edge-1")
            with pytest.raises(NodeError, match="403 revoked"):
                await asyncio.wait_for(_node(live.url, with_key).run(), 15)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_token_files_and_the_registry_are_private(tmp_path):
    db = tmp_path / "srv" / "nodes.sqlite"
    res = CliRunner().invoke(
        app, ["server", "nodes", "add", "n1", "--db", str(db), "--token-file", str(tmp_path / "n1.token")]
    )
    assert res.exit_code == 0, res.output
    token = (tmp_path / "n1.token").read_text().strip()
    assert token not in res.output and _mode(tmp_path / "n1.token") == 0o600
    assert _mode(db) == 0o600
    reg = Registry(db)
    assert reg.authenticate(token) == "n1"
    for side in (db.with_name("nodes.sqlite-wal"), db.with_name("nodes.sqlite-shm")):
        assert not side.exists() or _mode(side) == 0o600
    reg.close()
    # An existing token file is never overwritten, and then no node is registered.
    res = CliRunner().invoke(
        app, ["server", "nodes", "add", "n2", "--db", str(db), "--token-file", str(tmp_path / "n1.token")]
    )
    assert res.exit_code != 0 and "exists" in str(res.exception)
    assert [n.name for n in Registry(db).list()] == ["n1"]
    # A registry left world-readable (by an older version) is made private when opened.
    db.chmod(0o644)
    Registry(db).close()
    assert _mode(db) == 0o600


def test_a_secret_readable_by_others_is_one_warning_naming_the_fix(tmp_path, caplog):
    from shoal.pki import read_secret
    from shoal.tls import client_context

    token = tmp_path / "n1.token"
    token.write_text("x" * 43 + "\n")
    token.chmod(0o644)  # what `nodes add NAME > n1.token` gave under a usual umask
    with caplog.at_level(logging.WARNING, logger="shoal.pki"):
        assert read_secret(token, "--token-file") == "x" * 43
    assert [r.getMessage() for r in caplog.records] == [
        f"--token-file {token} is readable by other users (mode 644): chmod 600 {token}"
    ]
    caplog.clear()
    made = make_node_key(tmp_path / "node", "edge-1")  # 0600: no warning
    make_ca(tmp_path / "pki")
    cert = sign_node(tmp_path / "pki", read_node_csr(made.csr, "edge-1"), "edge-1", tmp_path / "edge-1.pem")
    with caplog.at_level(logging.WARNING, logger="shoal.pki"):
        client_context(tmp_path / "pki" / "ca.pem", cert, made.key)
        assert not caplog.records
        made.key.chmod(0o640)
        client_context(tmp_path / "pki" / "ca.pem", cert, made.key)
    assert len(caplog.records) == 1 and "this node's private key" in caplog.records[0].getMessage()
