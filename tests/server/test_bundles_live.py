"""Signed task bundles end to end, in one federation with node daemons (the test's event loop,
real sockets, real training, the nodes' task checks in worker processes): a researcher who has no
access to the nodes submits their task as a signed bundle with `shoal run submit --bundle` and the
run completes; a bundle signed by a key the nodes do not trust, and one whose code had one byte
changed (its manifest re-hashed to pass the server's checks), are refused by every node with the
reason in the run's status."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from shoal import bundle as fmt
from shoal.bundle_cli import app as bundle_app
from shoal.client.daemon import NodeDaemon
from shoal.client.node_config import load_node_config
from shoal.server.federation.run_cli import app as run_app
from tests.server.federation_live import live_federation
from tests.server.task_files import REGRESSION_TASK, write_node_data

NODE = """
[node]
server = "{url}"
token_file = "{tmp}/{name}.token"
name = "{name}"
device = "cpu"
state_dir = "{tmp}/{name}-state"
poll_s = 0.3
trusted_publishers = ["{publisher}"]
bundle_data = "{data}"
"""
RUN = """
[server]
rounds = 2
min_nodes = 2
deadline_s = 20.0
poll_s = 1.0
eval = false

[train]
batch_size = 16
lr = 0.05

[task.args]
hidden = 6
"""


def changed_code(blob: bytes) -> bytes:
    """One byte of the task's code changed, the manifest's hash of that file made to match (what a
    server or a link in the middle could do): the signature no longer holds."""
    manifest, sig, bundle = fmt.read(blob)
    files = dict(bundle.files)
    code = bytearray(files["regtask.py"])
    code[code.index(b"Tanh")] = ord("t")  # nn.tanh: another program
    files["regtask.py"] = bytes(code)
    digest = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    m = fmt.Manifest(
        manifest.publisher,
        manifest.entry,
        tuple(fmt.BundleFile(f.name, len(files[f.name]), digest[f.name]) for f in manifest.files),
    )
    return fmt.assemble(m, sig, files)


@pytest.mark.timeout(180)
def test_a_signed_bundle_runs_and_untrusted_or_changed_bundles_are_refused_by_every_node(tmp_path):
    runner = CliRunner()
    trusted = runner.invoke(bundle_app, ["keygen", "--out", str(tmp_path / "publisher.key")])
    assert trusted.exit_code == 0, trusted.output
    publisher = trusted.output.strip()
    assert (tmp_path / "publisher.key").stat().st_mode & 0o777 == 0o600
    assert runner.invoke(bundle_app, ["keygen", "--out", str(tmp_path / "stranger.key")]).exit_code == 0
    laptop = tmp_path / "laptop"  # the researcher's machine: their task and run config, nothing of the nodes'
    (laptop / "task").mkdir(parents=True)
    (laptop / "task" / "regtask.py").write_text(REGRESSION_TASK)
    (laptop / "run.toml").write_text(RUN)

    async def main():
        async with live_federation(tmp_path, ["n0", "n1"]) as f:
            for name in ("n0", "n1"):  # no [[tasks]]: the nodes have nothing of the researcher's installed
                data = write_node_data(tmp_path / f"{name}.pt", seed=int(name[-1]) + 1)
                toml = tmp_path / f"{name}.toml"
                toml.write_text(NODE.format(url=f.url, tmp=tmp_path, name=name, publisher=publisher, data=data))
                cfg = load_node_config(toml)
                d = NodeDaemon(cfg, (tmp_path / f"{name}.token").read_text().strip(), torch.device("cpu"), None)
                f.daemons[name] = d
                f.runners[name] = asyncio.ensure_future(d.run())
            cli = ["--server", f.url, "--token-file", str(tmp_path / "admin.token"), "-c", str(laptop / "run.toml")]

            def submit(*args: str) -> str:
                out = runner.invoke(run_app, ["submit", "--task", "regtask.py:Regression", *cli, *args])
                assert out.exit_code == 0, (out.output, out.exception)
                return out.output.strip()

            await asyncio.to_thread(submit, "--bundle", str(laptop / "task"), "--key", str(tmp_path / "publisher.key"))
            good = f"run-{f.fed.db.count()}"  # (its id is printed too; the CLI runs in a thread here)
            done = await f.wait_ended(good, 90)
            assert done["status"] == "finished" and done["version"] == 2, done
            assert {v["answer"] for v in done["nodes"].values()} == {"joined"}, done

            packed = laptop / "regtask.bundle"
            args = ["pack", str(laptop / "task"), "--task", "regtask.py:Regression", "-c", str(laptop / "run.toml")]
            out = runner.invoke(bundle_app, [*args, "--key", str(tmp_path / "stranger.key"), "--out", str(packed)])
            assert out.exit_code == 0, out.output
            await asyncio.to_thread(submit, "--bundle", str(packed))
            untrusted = f"run-{f.fed.db.count()}"
            out = runner.invoke(bundle_app, [*args, "--key", str(tmp_path / "publisher.key"), "--out", str(packed)])
            assert out.exit_code == 0, out.output
            packed.write_bytes(changed_code(packed.read_bytes()))
            await asyncio.to_thread(submit, "--bundle", str(packed))
            changed = f"run-{f.fed.db.count()}"
            for run, why in ((untrusted, "a key this node does not trust"), (changed, "signature does not verify")):
                st = await f.wait_ended(run, 60)
                assert st["status"] == "failed" and st["reason"].startswith("every node refused"), st
                assert {v["answer"] for v in st["nodes"].values()} == {"refused"}, st
                assert all(why in v["reason"] for v in st["nodes"].values()), st
                assert st["reason"].count(why) == 2, st

    asyncio.run(main())
    # the task was imported here only from the nodes' verified copies and the researcher's folder
    # (this test's process plays every part); the server's folder holds bundles as bytes, no code
    files = [str(getattr(m, "__file__", "")) for m in list(sys.modules.values())]
    # (another test in this worker may have imported a regtask.py of its own folder: only this test's count)
    places = {f for f in files if f.endswith("regtask.py") and f.startswith(str(tmp_path))}
    assert places and all("-state/bundles/" in p or p.startswith(str(laptop)) for p in places), places
    assert not [p for p in (tmp_path / "fed").rglob("*") if p.suffix == ".py"]
    assert json.loads((tmp_path / "fed" / "run-1" / "summary.json").read_text())["status"] == "finished"
