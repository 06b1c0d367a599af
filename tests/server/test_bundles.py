"""Signed task bundles on the server and in a node's config, protocol-level (Federation without
HTTP, NodeConfig, the node's install step): the server stores a bundle and runs its initial model
as data, never compiling or importing a byte of its code; every malformed, unsigned or changed
bundle is refused with its reason; researchers run only their own bundles; a node's config names
the publishers it trusts."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal import bundle as fmt
from shoal.bundle_model import initial_state
from shoal.client.bundle_tasks import admit_bundle, install
from shoal.client.node_config import load_node_config
from shoal.config import config_from_dict
from shoal.errors import ConfigError
from shoal.server.federation import bundle_store
from shoal.server.federation.runs import Federation, RunError
from shoal.server.federation.runs_db import RunsDB

MARK = "bundled_code_never_runs_on_the_server"
CODE = f"import {MARK}\nraise SystemExit('{MARK}')\n".encode()
KEY = fmt.new_private_key()
RUN = {"server": {"rounds": 2, "min_nodes": 1, "poll_s": 1.0, "eval": False}, "train": {"batch_size": 8}}
_SEEN: list[tuple[str, str]] | None = None


def _audit(event: str, args: tuple) -> None:
    if _SEEN is not None and event in ("compile", "import", "exec", "open") and args:
        _SEEN.append((event, str(args[0])[:2000]))


sys.addaudithook(_audit)


def blob(code: bytes = CODE, key=KEY) -> bytes:
    torch.manual_seed(0)
    return fmt.pack({"task.py": code}, "task.py:task", key, initial_state(nn.Linear(4, 2)))


def federation(tmp: Path, **federation) -> Federation:
    cfg = config_from_dict({"federation": {"enabled": True, "dir": str(tmp / "fed"), **federation}}).validate()
    return Federation(cfg, RunsDB(tmp / "fed" / "runs.sqlite"))


def test_the_server_stores_a_bundle_and_runs_its_model_without_its_code(tmp_path):
    global _SEEN
    fed = federation(tmp_path)
    data = blob()
    _SEEN = []
    try:
        task = fed.upload_bundle("alice", data, fed.bundles_in_use())["task"]
        sub = fed.prepare(task, RUN, "alice")
        fed.check_task(sub)
        run = fed.enqueue(sub)["run"]
        fed.tick(0.0)
        seen = list(_SEEN)
    finally:
        _SEEN = None
    assert fed.service(run) is not None and fed.service(run).spec.numel == 4 * 2 + 2  # type: ignore[union-attr]
    assert not [s for s in seen if MARK in s[1]], [s for s in seen if MARK in s[1]]  # never compiled nor imported
    assert MARK not in sys.modules
    assert not [p for p in (tmp_path / "fed").rglob("*") if p.suffix == ".py"]
    stored = tmp_path / "fed" / "bundles" / "alice" / f"{task.removeprefix('bundle:')}.bundle"
    assert stored.read_bytes() == data and stored.stat().st_mode & 0o777 == 0o600
    offer = fed.offers("n0")[0]
    assert offer["task"] == task and "bundle:" + offer["task_sha256"] == task
    assert fed.bundle(run, "n0") == data
    fed.answer(run, "n1", {"answer": "refused", "reason": "not this one"})
    with pytest.raises(RunError) as e:  # a node that left the run gets no more of it
        fed.bundle(run, "n1")
    assert e.value.status == 403
    with pytest.raises(RunError) as e:  # bob names alice's bundle: it is not his
        fed.prepare(task, RUN, "bob")
    assert e.value.code == "unknown_bundle"
    for name in ("bundle:" + "A" * 64, "bundle:../../x", "bundle:"):
        with pytest.raises(RunError) as e:
            fed.prepare(name, RUN, "alice")
        assert e.value.code == "bad_task"
    fed.close()


def test_a_malformed_unsigned_or_changed_bundle_is_refused_at_upload_and_nothing_is_kept(tmp_path):
    fed = federation(tmp_path, max_parameters=5)
    data = blob()
    m, sig, b = fmt.read(data)
    flipped = bytearray(data)
    flipped[-len(b.model) - 3] ^= 4  # a byte of the code
    cases = {
        bytes(flipped): "does not have the SHA-256",
        fmt.assemble(m, b"", b.files): "unsigned",
        data[:-1]: "bytes of files",
        b"PK\x03\x04 a zip": "not a shoal task bundle",
        data: "over the limit of 5",  # the federation's max_parameters
    }
    for body, why in cases.items():
        with pytest.raises(RunError) as e:
            fed.upload_bundle("alice", body, set())
        assert e.value.code == "bad_bundle" and why in str(e.value), e.value
    assert not list((tmp_path / "fed").rglob("*.bundle"))
    fed.close()


def test_a_submitters_bundles_are_capped_and_those_in_use_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(bundle_store, "MAX_PER_SUBMITTER", 3)
    fed = federation(tmp_path)
    names = [fed.upload_bundle("alice", blob(CODE + b"#%d\n" % i), set())["task"] for i in range(3)]
    fourth = fed.upload_bundle("alice", blob(CODE + b"#3\n"), {names[0]})["task"]  # names[1] made room
    kept = {"bundle:" + p.stem for p in (tmp_path / "fed" / "bundles" / "alice").glob("*.bundle")}
    assert kept == {names[0], names[2], fourth}
    with pytest.raises(RunError) as e:
        fed.upload_bundle("alice", blob(CODE + b"#4\n"), kept)
    assert e.value.status == 429
    fed.close()


NODE = """
[node]
server = "http://127.0.0.1:1"
token_file = "t"
name = "n0"
state_dir = "{state}"
"""


def test_a_node_config_names_the_publishers_it_trusts_and_refuses_the_others(tmp_path):
    path = tmp_path / "node.toml"
    public = fmt.public_key_text(KEY)
    path.write_text(NODE.format(state=tmp_path / "state"))
    cfg = load_node_config(path)
    offer = {"run": "run-1", "task": "bundle:" + "0" * 64, "task_sha256": "0" * 64, "config": RUN}
    why = asyncio.run(admit_bundle(cfg, offer, None, "", None))  # type: ignore[arg-type]  # no request is made
    assert why == "node n0 takes no task bundles (its config lists no [node] trusted_publishers)"
    for extra, needle in [
        (f'trusted_publishers = ["{public}"]', "give node.bundle_data"),
        ('trusted_publishers = ["ed25519:xyz"]', "node.trusted_publishers: 'ed25519:xyz'"),
        (f'trusted_publishers = "{public}"', "is a list"),
        (f'trusted_publishers = ["{public}"]\nbundle_data = "d"\nbundle_check_mb = 100', "bundle_check_mb = 100"),
        ("bundle_typo = 1", "unknown key node.bundle_typo"),
    ]:
        path.write_text(NODE.format(state=tmp_path / "state") + extra + "\n")
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
            load_node_config(path)
    path.write_text(
        NODE.format(state=tmp_path / "state") + f'trusted_publishers = ["{public}", "{public}"]\nbundle_data = "d"\n'
    )
    cfg = load_node_config(path)
    assert cfg.bundles.trusted_publishers == [public] and cfg.bundles.data == Path("d")
    # the install step: a bundle of another key, or bytes other than the run's pin, never reach the disk
    stranger = blob(key=fmt.new_private_key())
    for data, sha, needle in [
        (stranger, fmt.read(stranger)[2].sha256, "does not trust"),
        (blob(), "0" * 64, "the run names 0000"),
    ]:
        with pytest.raises(fmt.BundleError, match=needle):
            install(cfg, {**offer, "task": "bundle:" + sha, "task_sha256": sha}, data)
    assert not (tmp_path / "state" / "bundles").exists() and not cfg.tasks
