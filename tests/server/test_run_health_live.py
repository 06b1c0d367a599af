"""Runs that cannot proceed end failed with the reason, in one federation with node daemons (the
test's event loop, real sockets and training): a task whose loss raises on the nodes, a Dataset
with one unreadable item, a task no node has installed, a run short of server.min_nodes for
federation.run_stall_s; and submissions refused at once with the line the run would end with."""

from __future__ import annotations

import asyncio

import pytest
import torch
from typer.testing import CliRunner

from shoal.client.daemon import NodeDaemon
from shoal.client.node_config import load_node_config, source_sha256
from shoal.server.federation.run_cli import app as run_app
from shoal.server.task_registry import REGISTRY_FILE, add_task
from tests.server.federation_live import live_federation
from tests.server.task_files import REGRESSION_TASK, write_node_data

BROKEN = (
    REGRESSION_TASK
    + '''
from torch.utils.data import Dataset


class FiveLogits(Regression):
    """The two-example check passes; a full batch meets a label the model has no output for."""

    def loss(self, model, x, y):
        if x.shape[0] > 2:
            raise IndexError("Target 9 is out of bounds.")
        return super().loss(model, x, y)


class Rows(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if i == 7:
            raise OSError("cannot identify image file 'digits/7.png'")
        return self.x[i], self.y[i]


class BadItem(Regression):
    def local_data(self, path):
        d = torch.load(path)
        return LocalData(train=Rows(d["x"], d["y"]))
'''
)

NODE = """
[node]
server = "{url}"
token_file = "{tmp}/{name}.token"
name = "{name}"
device = "cpu"
state_dir = "{tmp}/{name}-state"
poll_s = 0.3
"""
TASK = """
[[tasks]]
name = "{name}"
ref = "{ref}"
sha256 = "{sha}"
data = "{data}"
"""


def run_config(min_nodes: int = 2, **extra) -> dict:
    return {
        "train": {"batch_size": 16, "lr": 0.05},
        "server": {"rounds": 3, "min_nodes": min_nodes, "deadline_s": 20.0, "poll_s": 1.0, "eval": False},
        **extra,
    }


@pytest.mark.timeout(120)
def test_runs_that_cannot_proceed_end_failed_with_the_reason(tmp_path):
    async def main():
        async with live_federation(tmp_path, ["n0", "n1"]) as f:
            folder = tmp_path / "tasks"
            (folder / "broken.py").write_text(BROKEN)
            good, five_ref, bad_ref = f.task_ref, f"{folder}/broken.py:FiveLogits", f"{folder}/broken.py:BadItem"
            five, bad_item = "five-logits", "bad-item"  # the operator registers them (`shoal server tasks add`)
            add_task(f.fed.dir / REGISTRY_FILE, five, five_ref)
            add_task(f.fed.dir / REGISTRY_FILE, bad_item, bad_ref)
            for name in ("n0", "n1"):  # both nodes install the two broken tasks, not the good one
                data = write_node_data(tmp_path / f"{name}.pt", seed=int(name[-1]) + 1)
                toml = tmp_path / f"{name}.toml"
                toml.write_text(
                    NODE.format(url=f.url, tmp=tmp_path, name=name)
                    + "".join(
                        TASK.format(name=n, ref=r, sha=source_sha256(r), data=data)
                        for n, r in ((five, five_ref), (bad_item, bad_ref))
                    )
                )
                cfg = load_node_config(toml)
                d = NodeDaemon(cfg, (tmp_path / f"{name}.token").read_text().strip(), torch.device("cpu"), None)
                f.daemons[name] = d
                f.runners[name] = asyncio.ensure_future(d.run())

            # the model's output does not fit the labels: every node reports it, the run fails in
            # its first round (no round deadline waited out) with the nodes' reasons
            f.task_ref = five
            a = await f.submit(run_config())
            sa = await f.wait_ended(a, 60)
            assert sa["status"] == "failed", sa
            assert sa["reason"].startswith("every node refused or failed the run"), sa
            line = "loss(model, x, y) failed: IndexError: Target 9 is out of bounds; the model gives"
            assert line in sa["reason"], sa
            assert {v["answer"] for v in sa["nodes"].values()} == {"failed"}, sa
            # `shoal run logs`: the server's events and each node's failure line; `shoal run wait` exits 1
            cli = ["--server", f.url, "--token-file", str(tmp_path / "admin.token")]
            logs = await asyncio.to_thread(CliRunner().invoke, run_app, ["logs", a, *cli])
            assert logs.exit_code == 0, logs.output
            assert f"server: submitted by admin: task {five}" in logs.stderr
            assert "n0: failed: task " in logs.stderr and "IndexError: Target 9 is out of bounds" in logs.stderr
            assert "n1: round 1: reports its task failed" in logs.stderr or "n0: round 1: reports" in logs.stderr
            assert "server: failed at version 0: every node refused or failed the run" in logs.stderr
            waited = await asyncio.to_thread(CliRunner().invoke, run_app, ["wait", a, *cli])
            assert waited.exit_code == 1 and f"{a} failed at version 0: every node" in waited.stderr

            # one unreadable item in a node's Dataset: the same, naming the data
            f.task_ref = bad_item
            b = await f.submit(run_config())
            sb = await f.wait_ended(b, 60)
            assert sb["status"] == "failed" and "data (dataset[i] / collate_fn) failed: OSError" in sb["reason"], sb

            # a task no node installed: every node refuses, the run fails with their reasons
            f.task_ref = good
            c = await f.submit(run_config())
            sc = await f.wait_ended(c, 30)
            assert sc["status"] == "failed" and "n0 refused" in sc["reason"] and "n1 refused" in sc["reason"], sc

            # more nodes than there are: the run says what it waits for, then fails after run_stall_s
            f.fed.cfg.federation.run_stall_s = 1.5
            f.task_ref = five
            d = await f.submit(run_config(min_nodes=3))
            while "waiting_for" not in (st := await f.status(d)) and st["status"] == "running":
                await asyncio.sleep(0.05)
            assert "waiting for server.min_nodes = 3" in st.get("waiting_for", ""), st
            sd = await f.wait_ended(d, 30)
            assert sd["status"] == "failed", sd
            assert "federation.run_stall_s" in sd["reason"] or "every node" in sd["reason"], sd
            logs = await asyncio.to_thread(CliRunner().invoke, run_app, ["logs", d, *cli])
            assert "server: waiting for server.min_nodes = 3" in logs.stderr, logs.stderr

            # refused at submission (400, nothing queued): a typo, and a config the run would fail to start with
            f.registry.add("n2")  # a secure round takes 3 inputs at least: 3 registered nodes for K = 3
            async with f.session() as s:
                for config, needle in [
                    (run_config() | {"server": {"min_nodess": 2}}, "unknown key 'server.min_nodess'"),
                    (
                        {
                            **run_config(),
                            "server": {**run_config()["server"], "clients_per_round": 3},
                            "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0},
                            "secure_aggregation": {"enabled": True, "clip": 1.0, "min_inputs": 3},
                        },
                        "would clip the distributed-DP noise",
                    ),
                ]:
                    async with s.post(f.url + "/v1/runs", json={"task": five, "config": config}) as r:
                        body = await r.json()
                        assert r.status == 400 and needle in body["detail"], body
            # `shoal run validate` makes the same checks here, before anything is sent
            toml = tmp_path / "run.toml"
            toml.write_text("[server]\nmin_nodess = 2\n")
            checked = CliRunner().invoke(run_app, ["validate", "-c", str(toml), "--task", five_ref])
            assert checked.exit_code != 0 and "unknown key 'server.min_nodess'" in str(checked.exception)
            toml.write_text("[server]\nrounds = 2\n[train]\nbatch_size = 8\n")
            checked = CliRunner().invoke(run_app, ["validate", "-c", str(toml), "--task", five_ref])
            assert checked.exit_code == 0 and checked.output.startswith(f"ok: {five_ref}"), checked.output

    asyncio.run(main())
