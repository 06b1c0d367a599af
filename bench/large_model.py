"""A model larger than one request through `shoal server` and 2 `shoal client` processes.

One linear layer of about ``--mb`` MB (float32) as the task's model, 8 training examples per
node (the cost is moving and summing the model, not training it). The server's requests are
capped at ``--request-mb`` (server.max_body_bytes), so every update travels in chunks
(docs/protocol.md, "/v1/uploads") and every model download by ranges of that size (resumable). One
round, K = 2.
Printed: the model's size, the wall time from the processes' start to the server's end (start-up
and training included) and the bytes moved per second over it (each node downloads the model and
uploads its update), and each process's peak RSS (VmHWM, sampled every 0.2 s) against the model
size (the target is <= 2x).

    .venv/bin/python bench/large_model.py [--mb 1024] [--request-mb 16] [--sum-dtype auto]

At --mb 1024 each process needs about 2.4 GB: the server the model and its float32 sum
(server.sum_dtype = "auto" from 512 MiB), each node its parameters and gradients, then its
parameters and the update (docs/deploy.md, "Large models"); each open request adds its bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_node import free_port  # bench/ is on sys.path when a script here runs

from shoal.server.registry import Registry

TASK = """
import math

import torch
from torch import nn

from shoal.task import LocalData, Task


class Big(Task):
    def __init__(self, side=1024):
        self.side = side

    def model(self):
        return nn.Linear(self.side, self.side, bias=False)

    def loss(self, model, x, y):
        return nn.functional.mse_loss(model(x), y)

    def metrics(self, model, x, y):
        return {"mse": nn.functional.mse_loss(model(x), y)}

    def local_data(self, path):
        g = torch.Generator().manual_seed(int(open(path).read()))
        x = torch.randn(8, self.side, generator=g)
        return LocalData(train=(x, x.flip(-1)), test=None)


def task(side=1024):
    return Big(side)
"""

CONFIG = """
[simulation]
seed = 0
[task]
app = "{task}:Big"
[task.args]
side = {side}
[train]
lr = 0.01
batch_size = 8
[server]
host = "127.0.0.1"
port = {port}
rounds = 1
min_nodes = 2
clients_per_round = 2
deadline_s = 3600
upload_timeout_s = 3600
poll_s = 5
eval = false
ingest_slots = 2
max_body_bytes = {request}
sum_dtype = "{sum_dtype}"
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
"""


def _hwm_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=1024.0, help="the model's size in MB (float32)")
    ap.add_argument("--request-mb", type=float, default=64.0, help="server.max_body_bytes in MB")
    ap.add_argument(
        "--sum-dtype",
        default="auto",
        choices=["auto", "float64", "float32"],
        help="server.sum_dtype (auto: float32 from 512 MiB)",
    )
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    side = int(math.sqrt(args.mb * 1e6 / 4))
    model_mb = side * side * 4 / 1e6
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "bigtask.py").write_text(TASK)
        port = free_port()
        (t / "server.toml").write_text(
            CONFIG.format(
                task=t / "bigtask.py",
                side=side,
                port=port,
                request=int(args.request_mb * 1e6),
                tmp=tmp,
                sum_dtype=args.sum_dtype,
            )
        )
        reg = Registry(t / "nodes.sqlite")
        for i in range(2):
            (t / f"n{i}.token").write_text(reg.add(f"n{i}") + "\n")
            os.chmod(t / f"n{i}.token", 0o600)
            (t / f"n{i}.data").write_text(str(i + 1))
        reg.close()
        start = time.perf_counter()
        cli = [sys.executable, "-m", "shoal.cli"]
        procs = {
            "server": subprocess.Popen(
                [*cli, "server", "-c", f"{tmp}/server.toml", "--insecure"],
                cwd=tmp,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=open(t / "server.log", "w"),
            )
        }
        for i in range(2):
            procs[f"node {i}"] = subprocess.Popen(
                [*cli, "client", "--server", f"http://127.0.0.1:{port}", "--token-file", f"{tmp}/n{i}.token",
                 "--data", f"{tmp}/n{i}.data", "-c", f"{tmp}/server.toml", "--name", f"n{i}", "--device", "cpu"],
                cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=open(t / f"n{i}.log", "w"),
            )  # fmt: skip
        peak = dict.fromkeys(procs, 0.0)
        try:
            while procs["server"].poll() is None and time.perf_counter() - start < args.timeout:
                for name, p in procs.items():
                    if p.poll() is None:
                        peak[name] = max(peak[name], _hwm_mb(p.pid))
                time.sleep(0.2)
            seconds = time.perf_counter() - start
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.terminate()
            for p in procs.values():
                p.wait(60)
        lines = (t / "run" / "metrics.jsonl").read_text().splitlines() if (t / "run" / "metrics.jsonl").exists() else []
        done = [json.loads(x) for x in lines if "train_loss" in json.loads(x)]
        log = (t / "server.log").read_text()
    moved = 2 * 2 * model_mb  # each node: the model down, its update up
    print(f"model: {side} x {side} float32 = {model_mb:.1f} MB; requests capped at {args.request_mb:g} MB (chunks)")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if not done:
        print("the round did not finish; the server's log ends:\n" + log[-2000:])
        sys.exit(1)
    print(f"round done: {done[-1].get('num_results')} updates; {seconds:.1f} s from start to the server's end "
          f"(start-up and training included): {moved / seconds:.1f} MB/s moved ({moved:.0f} MB)")  # fmt: skip
    base = _import_rss_mb()
    print(f"(a process that only imports shoal's server, client and torch: {base:.0f} MB)")
    for name, mb in peak.items():
        print(
            f"{name:>8}: peak RSS {mb:.0f} MB = {mb / model_mb:.2f}x the model; "
            f"{(mb - base) / model_mb:.2f}x above the imports"
        )


def _import_rss_mb() -> float:
    code = "import torch, shoal.server.app, shoal.client.node; print(open('/proc/self/status').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return next(int(x.split()[1]) for x in out.splitlines() if x.startswith("VmHWM:")) / 1024


if __name__ == "__main__":
    main()
