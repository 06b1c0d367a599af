"""Run a task for real in tests: `shoal server` + client processes over TLS, or peer processes.

Every process runs from the task's folder (a user's folder, outside the repository), every
wait is bounded, every process is killed at the end, and a failure shows the logs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shoal.metrics import read_jsonl
from shoal.pki import write_secret
from shoal.server.registry import Registry
from shoal.tls import make_private_ca
from tests.p2p.processes import free_ports
from tests.spawn import kill_group, python_process

SERVER_TOML = """
[server]
host = "127.0.0.1"
port = {port}
rounds = {rounds}
min_nodes = {nodes}
clients_per_round = {nodes}
poll_s = 2.0
deadline_s = 120.0
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
tls_cert = "{cert}"
tls_key = "{key}"
"""


def _spawn(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return python_process(args, log, env=env, cwd=cwd)


def _finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float) -> None:
    try:
        for p in procs:
            p.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            kill_group(p, 10)
    text = "\n".join(f"--- {f.name}\n{f.read_text()[-2500:]}" for f in logs if f.exists())
    assert [p.returncode for p in procs] == [0] * len(procs), text
    assert "Traceback" not in text, text


def run_server_and_clients(
    folder: Path, task: str, data: list[str], extra_toml: str = "", rounds: int = 3, timeout: float = 240
) -> list[dict]:
    """`shoal server` and one `shoal client` per data path, over TLS; returns metrics.jsonl."""
    from tests.ports import free_port

    pki = make_private_ca(folder / "pki")
    port = free_port()
    (folder / "server.toml").write_text(
        SERVER_TOML.format(port=port, rounds=rounds, nodes=len(data), tmp=folder, cert=pki.cert, key=pki.key)
        + extra_toml
    )
    reg = Registry(folder / "nodes.sqlite")
    for i in range(len(data)):
        write_secret(folder / f"node{i}.token", reg.add(f"node{i}").encode())
    reg.close()
    logs = [folder / "server.log"]
    procs = [_spawn(["server", "--task", task, "-c", "server.toml"], folder, logs[0])]
    for i, path in enumerate(data):
        logs.append(folder / f"client{i}.log")
        procs.append(
            _spawn(
                [
                    "client",
                    "--task",
                    task,
                    "--data",
                    path,
                    "-c",
                    "server.toml",
                    "--server",
                    f"https://127.0.0.1:{port}",
                    "--token-file",
                    f"node{i}.token",
                    "--ca-cert",
                    str(pki.ca_cert),
                    "--device",
                    "cpu",
                ],
                folder,
                logs[-1],
            )
        )
    _finish(procs, logs, timeout)
    return read_jsonl(folder / "run" / "metrics.jsonl")


def run_peers(
    folder: Path, task: str, data: list[str], extra_toml: str = "", steps: int = 6, timeout: float = 240
) -> list[list[dict]]:
    """One `shoal peer` per data path over TLS, in a ring of bootstraps, ``steps`` local steps
    each; returns every peer's metrics.jsonl records."""
    pki = make_private_ca(folder / "pki")
    (folder / "peer.toml").write_text(f"[gossip]\nperiod = 0.3\nrounds = {steps}\n" + extra_toml)
    ports = free_ports(len(data))
    urls = [f"https://127.0.0.1:{p}" for p in ports]
    tls = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--ca-cert", str(pki.ca_cert)]
    procs, logs = [], []
    for i, path in enumerate(data):
        logs.append(folder / f"peer{i}.log")
        procs.append(
            _spawn(
                [
                    "peer",
                    "--task",
                    task,
                    "--data",
                    path,
                    "-c",
                    "peer.toml",
                    "--listen",
                    f"127.0.0.1:{ports[i]}",
                    "--bootstrap",
                    urls[(i + 1) % len(urls)],
                    "--token",
                    "test-network-token",
                    "--out",
                    f"peer{i}",
                    *tls,
                ],
                folder,
                logs[-1],
            )
        )
    _finish(procs, logs, timeout)
    return [read_jsonl(folder / f"peer{i}" / "metrics.jsonl") for i in range(len(data))]
