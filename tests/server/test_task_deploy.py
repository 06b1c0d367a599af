"""A user's task file (outside the repository) deployed for real: `shoal server` and three
`shoal client` processes over TLS, each node reading its own .pt file; and the one-line
errors of a node with another model, a --data path the task cannot read, a task file
that does not import.

Bounded: every wait has a timeout and every process is killed at the end.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from shoal.params import ParamSpec
from shoal.pki import write_secret
from shoal.server.registry import Registry
from shoal.task import load_task, make_model
from shoal.tls import make_private_ca
from shoal.update import Update
from shoal.wire import encode_update
from tests.spawn import kill_group, python_process

from ..ports import free_port
from .task_files import BROKEN_TASK, write_node_data, write_task

CONFIG = """
[simulation]
seed = 3
eval_every = 1
[train]
batch_size = 16
lr = 0.05
epochs = 2
[server]
host = "127.0.0.1"
port = {port}
rounds = {rounds}
min_nodes = {nodes}
clients_per_round = {nodes}
poll_s = 2.0
deadline_s = 30.0
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
tls_cert = "{cert}"
tls_key = "{key}"
admin_token_file = "{tmp}/admin.token"
"""


class TaskDeployment:
    """A config, TLS certificates, node tokens and .pt data for ``nodes`` nodes of the task."""

    def __init__(self, tmp: Path, nodes: int, rounds: int):
        self.tmp, self.port = tmp, free_port()
        self.marks = tmp / "marks"
        self.marks.mkdir()
        self.task = write_task(tmp / "user")  # the user's own folder, outside the repository
        self.pki = make_private_ca(tmp / "pki")
        self.config = tmp / "cfg.toml"
        self.config.write_text(
            CONFIG.format(port=self.port, rounds=rounds, nodes=nodes, tmp=tmp, cert=self.pki.cert, key=self.pki.key)
        )
        write_secret(tmp / "admin.token", ("admin-" + "x" * 40).encode())  # GET /v1/status and /metrics
        reg = Registry(tmp / "nodes.sqlite")
        self.names = [f"node{i}" for i in range(nodes)]
        for i, name in enumerate(self.names):
            write_secret(tmp / f"{name}.token", reg.add(name).encode())
            write_node_data(tmp / "user" / f"{name}.pt", seed=i)
        reg.close()
        self.url = f"https://127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    def _run(self, args: list[str], tag: str) -> subprocess.Popen:
        log = self.tmp / f"{tag}.log"
        self.logs.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "REGTASK_MARKS": str(self.marks)}
        p = python_process(args, log, env=env)
        self.procs.append(p)
        return p

    def server(self, task: str = "Regression") -> subprocess.Popen:
        return self._run(["server", "-c", str(self.config), "--task", f"{self.task}:{task}"], "server")

    def client(self, i: int, task: str = "Regression") -> subprocess.Popen:
        name = self.names[i]
        return self._run(
            [
                "client",
                "--server",
                self.url,
                "--token-file",
                str(self.tmp / f"{name}.token"),
                "--task",
                f"{self.task}:{task}",
                "--data",
                str(self.tmp / "user" / f"{name}.pt"),
                "-c",
                str(self.config),
                "--ca-cert",
                str(self.pki.ca_cert),
                "--device",
                "cpu",
            ],
            f"{name}-{task}",
        )

    def request(self, path: str, body: bytes | None = None, node: str = "node0") -> tuple[int, dict]:
        token = (self.tmp / f"{node}.token").read_text()
        req = urllib.request.Request(self.url + path, data=body, headers={"Authorization": f"Bearer {token}"})
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        try:
            with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_up(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                self.request("/v1/status", node="admin")
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"server not up in {timeout} s\n{self.dump()}")

    def wait(self, p: subprocess.Popen, timeout: float) -> int:
        try:
            return p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process did not exit in {timeout} s\n{self.dump()}") from None

    def dump(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs if p.exists())

    def stop(self) -> None:
        for p in self.procs:
            kill_group(p, 5)


@pytest.fixture
def deploy(tmp_path, request):
    nodes, rounds = request.param
    d = TaskDeployment(tmp_path, nodes, rounds)
    yield d
    d.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("deploy", [(3, 3)], indirect=True)
def test_user_task_server_and_three_clients_over_tls(deploy):
    """The server has only the model; nodes train on their .pt files and evaluate each
    global version on their own test data; metrics.jsonl holds the weighted means."""
    d = deploy
    server = d.server()
    clients = [d.client(i) for i in range(3)]
    assert d.wait(server, 150) == 0, d.dump()
    for c in clients:
        assert d.wait(c, 30) == 0, d.dump()
    records = [json.loads(line) for line in (d.tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    versions = [r for r in records if "evaluation" not in r]
    fed = [r for r in records if r.get("evaluation") == "federated"]
    assert [r["version"] for r in versions] == [1, 2, 3] and all(r["num_results"] == 3 for r in versions)
    assert not any(k.startswith("test_") for r in versions for k in r)  # the task has no central test data
    # versions 1 and 2 evaluated before the nodes trained on them, version 3 after the server said done
    assert [r["version"] for r in fed] == [1, 2, 3], d.dump()
    assert all(r["fed_nodes"] == 3 and r["fed_num_examples"] == 60 for r in fed)
    assert fed[-1]["fed_mse"] < fed[0]["fed_mse"], fed  # the model learns
    # the server called no data part of the task; each node read its own file
    marks = sorted(p.name for p in d.marks.iterdir())
    assert not [m for m in marks if m.endswith(f"-{d.procs[0].pid}") and not m.startswith("central_test_data")]
    assert sorted(int(m.split("-")[1]) for m in marks if m.startswith("local_data")) == sorted(c.pid for c in clients)
    log = (d.tmp / "node0-Regression.log").read_text()
    assert "on 20 local test examples" in log, log


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("deploy", [(1, 1)], indirect=True)
def test_node_with_another_model_is_refused_naming_both_spec_hashes(deploy):
    d = deploy
    seed = 3
    ours = ParamSpec.of(make_model(load_task(f"{d.task}:Regression"), seed)).hash
    wide_spec = ParamSpec.of(make_model(load_task(f"{d.task}:wide"), seed))
    assert wide_spec.hash != ours
    server = d.server()
    d.wait_up(60)
    wrong = d.client(0, task="wide")
    assert d.wait(wrong, 60) == 2, d.dump()
    out = (d.tmp / "node0-wide.log").read_text()
    (line,) = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert ours in line and wide_spec.hash in line and "same task" in line, out
    assert "Traceback" not in out, out
    # An upload made with the other model is a 400 naming both hashes, and changes nothing.
    body = encode_update(Update(torch.zeros(wide_spec.numel), num_examples=5), wide_spec, {"round": 1})
    status, info = d.request("/v1/update", body)
    assert (status, info["error"]) == (400, "spec_mismatch"), info
    assert ours in info["detail"] and wide_spec.hash in info["detail"]
    status, st = d.request("/v1/status", node="admin")
    assert st["version"] == 0 and st["updates_accepted"] == 0 and st["connected_nodes"] == ["node0"]
    assert server.poll() is None


@pytest.mark.timeout(90)
def test_unreadable_data_and_a_task_that_does_not_import_are_one_line(tmp_path):
    task = write_task(tmp_path / "user")
    broken = tmp_path / "user" / "broken.py"
    broken.write_text(BROKEN_TASK)
    token = tmp_path / "t.token"
    write_secret(token, b"x")  # private, as `shoal server nodes add --token-file` writes it
    missing = tmp_path / "user" / "no-such-node.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def shoal(*args: str) -> tuple[int, str]:
        """The exit status and what the process wrote (stdout and stderr: only stderr has anything)."""
        log = tmp_path / f"run-{len(list(tmp_path.glob('run-*.log')))}.log"
        return python_process(list(args), log, env=env).wait(120), log.read_text()

    client = ["client", "--server", "https://127.0.0.1:9", "--token-file", str(token)]
    cases = {
        "data": (
            shoal(*client, "--task", f"{task}:Regression", "--data", str(missing)),
            ["task ", ":Regression", "local_data(", str(missing)],
        ),
        "client_import": (
            shoal(*client, "--task", f"{broken}:T", "--data", str(missing)),
            ["broken.py:T", "shoal_no_such_module_for_tests"],
        ),
        "server_import": (
            shoal(
                "server",
                "--insecure",
                "--task",
                f"{broken}:T",
                "--set",
                f'server.db="{tmp_path}/db.sqlite"',
                "--set",
                f'server.checkpoint_dir="{tmp_path}/ck"',
            ),
            ["broken.py:T", "shoal_no_such_module_for_tests"],
        ),
    }
    for case, ((rc, out), words) in cases.items():
        lines = out.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), (case, out)
        assert all(w in lines[0] for w in words), (case, lines[0])
