"""Server ingest: N nodes upload updates of the 1.66M-parameter MNIST CNN at once.

A real `shoal server` process (plain HTTP on 127.0.0.1, so the number is the server's
own cost, not TLS's) runs one sync round with K = N; this process plays the N nodes
with aiohttp: each long-polls for its task, then all upload together. Printed per N:
throughput (update bytes / time from the first upload to the last answer) and the
server's peak RSS (VmHWM). Streaming aggregation means the peak should not grow
with N: at most ``server.ingest_slots`` bodies are held at once, the rest wait in
their sockets.

    .venv/bin/python bench/server_ingest.py [--n 20 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.server.registry import Registry
from shoal.update import Update
from shoal.wire import encode_update

CONFIG = """
[simulation]
seed = 0
[data]
dataset = "mnist"
dir = "unused: the server does not evaluate here"
partition = "iid"
[model]
name = "cnn"
[server]
host = "127.0.0.1"
port = {port}
rounds = 1
min_nodes = {n}
clients_per_round = {n}
deadline_s = 600
poll_s = 60
eval = false
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


async def _nodes(url: str, tokens: list[str], body: bytes, pid: int) -> tuple[float, float]:
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def wait_for_server():
            for _ in range(600):
                try:
                    async with http.get(
                        url + "/v1/task", params={"wait": "0"}, headers={"Authorization": f"Bearer {tokens[0]}"}
                    ) as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.1)
            raise RuntimeError("server did not start")

        await wait_for_server()

        async def poll(token: str) -> None:
            async with http.get(
                url + "/v1/task", params={"wait": "60"}, headers={"Authorization": f"Bearer {token}"}
            ) as r:
                task = await r.json()
                assert task["status"] == "work", task

        await asyncio.gather(*(poll(t) for t in tokens))
        cpu0, t0 = _cpu_s(pid), time.perf_counter()

        async def upload(token: str) -> None:
            async with http.post(
                url + "/v1/update",
                data=body,
                expect100=True,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"},
            ) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(upload(t) for t in tokens))
        return time.perf_counter() - t0, _cpu_s(pid) - cpu0


def run(n: int, body: bytes) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        cfg_path = Path(tmp) / "server.toml"
        cfg_path.write_text(CONFIG.format(port=port, n=n, tmp=tmp))
        reg = Registry(Path(tmp) / "nodes.sqlite")
        tokens = [reg.add(f"node-{i:04d}") for i in range(n)]
        reg.close()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "server", "--config", str(cfg_path), "--insecure"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        try:
            seconds, cpu = asyncio.run(_nodes(f"http://127.0.0.1:{port}", tokens, body, server.pid))
            peak = _peak_rss_mb(server.pid)
            server.terminate()  # it would otherwise wait for the nodes to hear "done"
            server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    mb = n * len(body) / 1e6
    return {
        "n": n,
        "mb": mb,
        "seconds": seconds,
        "mb_per_s": mb / seconds,
        "peak_rss_mb": peak,
        "server_cpu_s": cpu,
        "mb_per_cpu_s": mb / max(cpu, 1e-9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[20, 200])
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    spec = ParamSpec.of(model)
    delta = torch.randn(spec.numel) * 1e-3
    body = encode_update(Update(delta, num_examples=600, base_version=0), spec, {"round": 1})
    model_mb = spec.nbytes / 1e6
    print(f"model: {spec.numel:,} parameters, {model_mb:.2f} MB float32; update body {len(body) / 1e6:.2f} MB")
    results = [run(n, body) for n in args.n]
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (nodes and server share them)")
    print(
        f"{'N':>5} {'MB sent':>9} {'seconds':>8} {'MB/s':>8} {'server CPU s':>13} {'MB per server CPU s':>20} "
        f"{'server peak RSS MB':>19}"
    )
    for r in results:
        print(
            f"{r['n']:>5} {r['mb']:>9.1f} {r['seconds']:>8.2f} {r['mb_per_s']:>8.1f} {r['server_cpu_s']:>13.2f} "
            f"{r['mb_per_cpu_s']:>20.1f} {r['peak_rss_mb']:>19.1f}"
        )
    if len(results) >= 2:
        lo, hi = results[0], results[-1]
        grow = (hi["peak_rss_mb"] - lo["peak_rss_mb"]) / model_mb
        print(
            f"peak RSS growth N={lo['n']} -> N={hi['n']}: {hi['peak_rss_mb'] - lo['peak_rss_mb']:.1f} MB "
            f"= {grow:.2f} model sizes (target < 5); throughput ratio {hi['mb_per_s'] / lo['mb_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
