"""The node registry, checkpoints on disk, and the server/data commands."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from shoal.cli import app
from shoal.errors import ConfigError
from shoal.server.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from shoal.server.registry import AuthError, Registry, hash_token
from shoal.shards import load_shard


def test_registry_add_authenticate_revoke(tmp_path):
    reg = Registry(tmp_path / "nodes.sqlite")
    token = reg.add("edge-1")
    assert len(token) >= 40 and reg.authenticate(token) == "edge-1"
    stored = reg.db.execute("SELECT token_hash FROM nodes").fetchone()[0]
    assert stored == hash_token(token) and token not in stored  # only the hash is kept
    with pytest.raises(ConfigError, match="already exists"):
        reg.add("edge-1")
    with pytest.raises(ConfigError, match="node name"):
        reg.add("bad name!")
    with pytest.raises(AuthError) as e:
        reg.authenticate("nope")
    assert e.value.status == 401
    reg.revoke("edge-1")
    with pytest.raises(AuthError) as e:
        reg.authenticate(token)
    assert e.value.status == 403 and e.value.code == "revoked"
    with pytest.raises(ConfigError, match="no node named"):
        reg.revoke("ghost")
    reg.close()


def test_checkpoints_are_whole_files_and_only_the_last_k_stay(tmp_path):
    for v in range(1, 6):
        save_checkpoint(tmp_path, v, {"params": torch.full((3,), float(v))}, {"version": v}, keep=3)
    (tmp_path / ".ckpt-00000006.safetensors.tmp").write_bytes(b"torn write")  # a crash mid-write
    names = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert names == ["ckpt-00000003.safetensors", "ckpt-00000004.safetensors", "ckpt-00000005.safetensors"]
    tensors, state = load_checkpoint(latest_checkpoint(tmp_path))
    assert state == {"version": 5} and torch.equal(tensors["params"], torch.full((3,), 5.0))


def test_cli_data_split_nodes_and_server_needs_tls(tmp_path):
    runner = CliRunner()
    db = str(tmp_path / "nodes.sqlite")
    res = runner.invoke(app, ["data", "split", "--set", "simulation.num_clients=4", "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    shard = load_shard(tmp_path / "s" / "client-00002.safetensors")
    assert shard.client_id == "client-00002" and shard.x.shape[1:] == (60,) and shard.num_classes == 10
    res = runner.invoke(app, ["server", "nodes", "add", "client-00002", "--db", db])
    token = res.output.strip()
    assert res.exit_code == 0 and len(token) >= 40
    res = runner.invoke(app, ["server", "nodes", "revoke", "client-00002", "--db", db])
    assert res.exit_code == 0
    res = runner.invoke(app, ["server", "nodes", "list", "--db", db])
    assert "client-00002\trevoked\tnever" in res.output
    res = runner.invoke(app, ["server", "--set", f"server.db={db}"])
    assert isinstance(res.exception, ConfigError) and "--insecure" in str(res.exception)
