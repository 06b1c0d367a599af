"""Real processes on 127.0.0.1: `shoal server` and `shoal client` nodes.

Bounded: every wait has a timeout and every process is killed at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from shoal.config import load_config
from shoal.pki import write_secret
from shoal.server.checkpoint import latest_checkpoint, load_checkpoint
from shoal.server.registry import Registry
from shoal.shard_split import write_shards
from shoal.simulations.inprocess import InProcessSimulation
from shoal.tls import make_private_ca
from tests.ports import free_port
from tests.spawn import kill_group, python_process

_free_port = free_port  # the name other test modules import

CONFIG = """
[simulation]
seed = 7
num_clients = {n}
clients_per_round = {n}
progress = false
[data]
dataset = "synthetic"
[model]
name = "logreg"
[train]
batch_size = 10
lr = 0.05
[server]
host = "127.0.0.1"
port = {port}
rounds = {rounds}
min_nodes = {min_nodes}
poll_s = 2.0
deadline_s = {deadline}
min_fraction = 0.5
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
eval = false
admin_token_file = "{tmp}/admin.token"
"""


def _shoal(args: list[str], log: Path, entry: Path | None = None) -> subprocess.Popen:
    """``shoal ARGS`` in a new process; ``entry``: a test-side script that wraps the CLI (fault injection)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}  # no spin-waiting threads on a shared CPU
    return python_process(args, log, script=entry, env=env)


class Deployment:
    def __init__(self, tmp: Path, n: int, rounds: int, deadline: float = 30.0, min_nodes: int | None = None):
        self.tmp, self.port = tmp, free_port()
        self.config = tmp / "cfg.toml"
        self.admin = secrets.token_urlsafe(32)
        write_secret(tmp / "admin.token", self.admin.encode())
        self.config.write_text(
            CONFIG.format(n=n, port=self.port, rounds=rounds, deadline=deadline, tmp=tmp, min_nodes=min_nodes or n)
        )
        self.cfg = load_config(self.config)
        self.shards = write_shards(self.cfg, tmp / "shards")
        reg = Registry(self.cfg.server.db)
        self.tokens = {}
        for p in self.shards:
            write_secret(tmp / f"{p.stem}.token", reg.add(p.stem).encode())
            self.tokens[p.stem] = (tmp / f"{p.stem}.token").read_text()
        reg.close()
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.url = f"http://127.0.0.1:{self.port}"

    def server(self, *extra: str, tag: str = "server") -> subprocess.Popen:
        log = self.tmp / f"{tag}.log"
        self.logs.append(log)
        p = _shoal(["server", "--config", str(self.config), *extra], log)
        self.procs.append(p)
        return p

    def client(self, i: int, *extra: str, entry: Path | None = None) -> subprocess.Popen:
        name = self.shards[i].stem
        log = self.tmp / f"{name}.log"
        self.logs.append(log)
        p = _shoal(
            [
                "client",
                "--server",
                self.url,
                "--token-file",
                str(self.tmp / f"{name}.token"),
                "--data",
                str(self.shards[i]),
                "--config",
                str(self.config),
                "--device",
                "cpu",
                *extra,
            ],
            log,
            entry,
        )
        self.procs.append(p)
        return p

    def status(self) -> dict | None:
        req = urllib.request.Request(self.url + "/v1/status", headers={"Authorization": f"Bearer {self.admin}"})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def wait_status(self, pred, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if st is not None and pred(st):
                return st
            time.sleep(0.1)
        raise AssertionError(f"status condition not met in {timeout} s; last {self.status()}\n{self.dump()}")

    def dump(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in self.logs if p.exists())

    def stop(self) -> None:
        for p in self.procs:
            kill_group(p, 5)


@contextmanager
def deployment(tmp: Path, n: int, rounds: int, deadline: float = 30.0, min_nodes: int | None = None):
    d = Deployment(tmp, n, rounds, deadline, min_nodes)
    try:
        yield d
    finally:
        d.stop()


def _wait(p: subprocess.Popen, d: Deployment, timeout: float) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"process did not exit in {timeout} s\n{d.dump()}") from None


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tls_sync_rounds_match_the_simulator(tmp_path):
    """5 nodes, 3 FedAvg rounds over HTTPS: the server's model is the simulator's (1e-6)."""
    with deployment(tmp_path, n=5, rounds=3) as d:
        pki = make_private_ca(tmp_path / "pki")
        d.url = d.url.replace("http://", "https://")
        server = d.server(
            "--set",
            f"server.tls_cert={json.dumps(str(pki.cert))}",
            "--set",
            f"server.tls_key={json.dumps(str(pki.key))}",
        )
        clients = [d.client(i, "--ca-cert", str(pki.ca_cert)) for i in range(5)]
        assert _wait(server, d, 120) == 0, d.dump()
        for c in clients:
            assert _wait(c, d, 30) == 0, d.dump()
    tensors, state = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    assert state["version"] == 3 and state["round"] == 3
    sim = InProcessSimulation.from_config(d.cfg)
    for _ in range(3):
        sim.run_round()
    assert torch.allclose(tensors["params"], sim.global_params, atol=1e-6, rtol=0), float(
        (tensors["params"] - sim.global_params).abs().max()
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2, 3]
    assert all(r["num_results"] == 5 for r in records)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_client_and_killed_server(tmp_path):
    """SIGKILL a node mid-round: the round closes at its deadline with the others.
    SIGKILL the server mid-round and start it again: it resumes from its checkpoint,
    finishes every round, and no completed version is lost or repeated."""
    slow_name = "client-00002"
    with deployment(tmp_path, n=3, rounds=6, deadline=8.0, min_nodes=2) as d:
        server = d.server("--insecure")
        # the slow node connects first, so it is in round 1 (min_nodes = 2) however fast the others are
        slow = d.client(2, "--set", "train.epochs=100000")  # still training when killed
        d.wait_status(lambda s: slow_name in s["connected_nodes"], 60)
        # ~1 s of training a round, so the test can see a round open and kill the server in it
        fast = [d.client(i, "--set", "train.epochs=40") for i in (0, 1)]
        st = d.wait_status(
            lambda s: s["round_open"] and slow_name in s["selected"] and s["received"] == len(s["selected"]) - 1, 60
        )
        os.killpg(slow.pid, signal.SIGKILL)
        killed_round, others = st["round"], len(st["selected"]) - 1
        st = d.wait_status(lambda s: s["version"] >= 2 and s["round_open"] and s["round"] > killed_round, 40)
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(5)
        saved = load_checkpoint(latest_checkpoint(tmp_path / "ck"))[1]["version"]
        assert saved >= st["version"]
        server = d.server("--insecure", tag="server-restarted")
        assert _wait(server, d, 90) == 0
        for c in fast:
            assert _wait(c, d, 30) == 0, d.dump()
        log = (tmp_path / "server-restarted.log").read_text()
        assert "resumed from" in log and f"version {saved}," in log, log
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2, 3, 4, 5, 6], records
    # the round the node died in closed at its deadline with the others' results
    assert [r["num_results"] for r in records if r["round"] == killed_round] == [others]
    assert load_checkpoint(latest_checkpoint(tmp_path / "ck"))[1]["version"] == 6


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_client_retries_an_absent_server_and_exits_cleanly_on_sigterm(tmp_path):
    with deployment(tmp_path, n=1, rounds=1) as d:
        client = d.client(0)  # no server: connection refused, backoff with jitter
        log = tmp_path / "client-00000.log"
        end = time.monotonic() + 40
        while "retrying in" not in (log.read_text() if log.exists() else "") and time.monotonic() < end:
            time.sleep(0.1)
        assert "retrying in" in log.read_text(), d.dump()
        client.send_signal(signal.SIGTERM)
        assert _wait(client, d, 15) == 0
        assert "stops after 0 rounds" in log.read_text()
