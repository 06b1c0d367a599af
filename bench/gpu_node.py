"""A deployed node training on a GPU: `shoal server` + two `shoal client` processes over TLS on
127.0.0.1, the same run twice, the nodes on ``--device cpu`` and then on ``--device cuda``.

MNIST (the folder given with --data-dir), McMahan's CNN, two shards of ``--examples`` each (from
`shoal data split`), E = 1, B = 10, ``--rounds`` sync rounds with both nodes in each. While the
CUDA run trains, ``nvidia-smi`` is asked which processes hold GPU memory, and the client
processes must be among them (so "cuda" is not just a flag the node ignored). Prints, per
device: seconds from the first round's start to the last version, seconds per round, final
accuracy on the server's test set, and the ratio cpu / cuda.

    python bench/gpu_node.py --data-dir ../shared/datasets/mnist-reconstructed [--rounds 3]

Every wait is bounded and every process is killed at the end; loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIG = """
[simulation]
seed = 1
num_clients = {clients}
clients_per_round = 2
progress = false
[data]
dataset = "mnist"
dir = "{data_dir}"
partition = "iid"
[model]
name = "cnn"
[train]
epochs = 1
batch_size = 10
lr = 0.05
[server]
host = "127.0.0.1"
port = {port}
rounds = {rounds}
min_nodes = 2
clients_per_round = 2
poll_s = 0.5
deadline_s = 300.0
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
tls_cert = "{cert}"
tls_key = "{key}"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", *args],
        cwd=cwd,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def gpu_pids() -> set[int]:
    """PIDs holding memory on a GPU, as nvidia-smi lists them (empty if it cannot say)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {int(t) for t in out.split() if t.strip().isdigit()}


def run_once(device: str, args: argparse.Namespace, tmp: Path) -> dict:
    from shoal.metrics import read_jsonl
    from shoal.server.registry import Registry
    from shoal.tls import make_private_ca

    tmp.mkdir(parents=True)
    pki = make_private_ca(tmp / "pki")
    port = free_port()
    clients = max(2, round(60_000 / args.examples))
    (tmp / "cfg.toml").write_text(
        CONFIG.format(
            clients=clients,
            data_dir=args.data_dir,
            port=port,
            rounds=args.rounds,
            tmp=tmp,
            cert=pki.cert,
            key=pki.key,
        )
    )
    split = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "data", "split", "-c", "cfg.toml", "--out", "shards"],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if split.returncode:
        raise SystemExit(f"shoal data split failed:\n{split.stdout[-2000:]}{split.stderr[-2000:]}")
    shards = sorted((tmp / "shards").glob("*.safetensors"))[:2]
    reg = Registry(tmp / "nodes.sqlite")
    for i in range(2):
        (tmp / f"node{i}.token").write_text(reg.add(f"node{i}"))
    reg.close()
    logs = [tmp / "server.log"]
    procs = [spawn(["server", "-c", "cfg.toml"], tmp, logs[0])]
    for i, shard in enumerate(shards):
        logs.append(tmp / f"client{i}.log")
        procs.append(
            spawn(
                [
                    "client",
                    "-c",
                    "cfg.toml",
                    "--data",
                    str(shard),
                    "--server",
                    f"https://127.0.0.1:{port}",
                    "--token-file",
                    f"node{i}.token",
                    "--ca-cert",
                    str(pki.ca_cert),
                    "--device",
                    device,
                ],
                tmp,
                logs[-1],
            )
        )
    on_gpu: set[int] = set()
    deadline = time.monotonic() + args.timeout
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if device.startswith("cuda"):
                on_gpu |= gpu_pids()
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    codes = [p.returncode for p in procs]
    if codes != [0, 0, 0]:
        text = "\n".join(f"--- {f.name}\n{f.read_text()[-2500:]}" for f in logs if f.exists())
        raise SystemExit(f"{device}: exit codes {codes}\n{text}")
    records = [r for r in read_jsonl(tmp / "run" / "metrics.jsonl") if "elapsed_s" in r]
    last = records[-1]
    clients_on_gpu = sum(p.pid in on_gpu for p in procs[1:])
    return {
        "device": device,
        "rounds": len(records),
        "elapsed_s": float(last["elapsed_s"]),
        "accuracy": last.get("test_accuracy", float("nan")),
        "clients_on_gpu": clients_on_gpu,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True, help="the MNIST folder (idx .gz files)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--examples", type=int, default=3000, help="examples per node")
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds each run may take")
    args = ap.parse_args()
    args.data_dir = str(Path(args.data_dir).resolve())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for device in args.devices.split(","):
            results.append(run_once(device, args, Path(tmp) / device))
    print(
        f"shoal server + 2 shoal client nodes over TLS on 127.0.0.1: MNIST CNN, {args.examples} examples "
        f"per node, E = 1, B = 10, {args.rounds} sync rounds"
    )
    print(f"{'node device':<12} {'rounds':>6} {'run s':>7} {'s/round':>8} {'accuracy':>9} {'clients on GPU':>15}")
    for r in results:
        print(
            f"{r['device']:<12} {r['rounds']:>6} {r['elapsed_s']:>7.1f} {r['elapsed_s'] / max(r['rounds'], 1):>8.2f} "
            f"{r['accuracy']:>9.4f} {r['clients_on_gpu'] if r['device'] != 'cpu' else '-':>15}"
        )
    by = {r["device"]: r for r in results}
    if "cpu" in by and "cuda" in by:
        ratio = by["cpu"]["elapsed_s"] / by["cuda"]["elapsed_s"]
        print(f"cpu / cuda run time: {ratio:.2f}x")
        line = {"bench": "gpu_node", "cpu_s": by["cpu"]["elapsed_s"], "cuda_s": by["cuda"]["elapsed_s"]}
        print("RESULT " + json.dumps(line | {"cpu_over_cuda": ratio, "clients_on_gpu": by["cuda"]["clients_on_gpu"]}))
    if "cuda" in by and by["cuda"]["clients_on_gpu"] < 2:
        raise SystemExit("the CUDA nodes did not show up in nvidia-smi's compute processes")


if __name__ == "__main__":
    main()
