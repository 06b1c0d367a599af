"""Server ingest: N nodes upload updates of the 1.66M-parameter MNIST CNN at once.

A real `shoal server` process on 127.0.0.1 runs one sync round with K = N; this process
plays the N nodes with aiohttp: each long-polls for its task, then all upload together.
Each N runs twice, side by side: plain HTTP (the server's own cost) and HTTPS (the same
with TLS, a certificate of a private CA made here). Printed per N and transport:
throughput (update bytes / time from the first upload to the last answer), the server's
CPU seconds, and its peak RSS (VmHWM) and the growth of it during the uploads, in model
sizes. Streaming aggregation means the peak should not grow with N: at most
``server.ingest_slots`` bodies are held at once, the rest wait in their sockets.

    .venv/bin/python bench/server_ingest.py [--n 20 200] [--transports plain tls]

``--against PYTHON`` also runs every case with a server started by another interpreter (another
checkout's .venv/bin/python, e.g. main's before a change), alternating with this one, and prints
this checkout's throughput and server CPU per MB against it: both measured in the same run, under
the same load (the load average is printed too).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
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
from shoal.tls import client_context, make_private_ca
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


# All N nodes of this bench connect from 127.0.0.1 without a client certificate: the crowd of
# sockets from one address that the server's per-address caps exist to stop. A deployment's nodes
# come from their own addresses (or hold a certificate); here the caps are lifted to N, for servers
# that have them.
ONE_ADDRESS = """connections_per_address = {cap}
max_pending_connections = {cap}
pending_per_address = {cap}
"""


@functools.cache
def _knows_address_caps(python: str) -> bool:
    """Whether the shoal under ``python`` has the per-address connection caps (older ones refuse the keys)."""
    probe = "from shoal.config import load_config; load_config(None, ['server.connections_per_address=8'])"
    # run outside any checkout: `-c` puts the working directory first on sys.path
    return subprocess.run([python, "-c", probe], capture_output=True, cwd=tempfile.gettempdir()).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mb(pid: int, field: str = "VmHWM") -> float:
    """The process's peak (VmHWM) or current (VmRSS) resident memory, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc status")


def _own_cpu_s() -> float:
    """User + system CPU seconds of this process (the N nodes) so far."""
    t = os.times()
    return t.user + t.system


async def _nodes(url: str, tokens: list[str], body: bytes, pid: int, ssl_ctx=None) -> tuple[float, float, float, float]:
    conn = aiohttp.TCPConnector(limit=0, ssl=ssl_ctx if ssl_ctx is not None else False)
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
        rss0 = _rss_mb(pid, "VmRSS")
        cpu0, mine0, t0 = _cpu_s(pid), _own_cpu_s(), time.perf_counter()

        async def upload(token: str) -> None:
            async with http.post(
                url + "/v1/update",
                data=body,
                expect100=True,
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream"},
            ) as r:
                assert r.status == 200, await r.text()

        await asyncio.gather(*(upload(t) for t in tokens))
        return time.perf_counter() - t0, _cpu_s(pid) - cpu0, _own_cpu_s() - mine0, rss0


def run(n: int, body: bytes, tls: bool = False, python: str = sys.executable) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        cfg_path = Path(tmp) / "server.toml"
        config = CONFIG.format(port=port, n=n, tmp=tmp)
        if _knows_address_caps(python):
            config += ONE_ADDRESS.format(cap=max(n + 16, 256))
        ssl_ctx, flags, scheme = None, ["--insecure"], "http"
        if tls:
            pki = make_private_ca(Path(tmp) / "pki")
            config += f'tls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n'
            ssl_ctx, flags, scheme = client_context(pki.ca_cert), [], "https"
        cfg_path.write_text(config)
        reg = Registry(Path(tmp) / "nodes.sqlite")
        tokens = [reg.add(f"node-{i:04d}") for i in range(n)]
        reg.close()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen(
            [python, "-m", "shoal.cli", "server", "--config", str(cfg_path), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=tmp,  # the interpreter's own checkout is imported, not a shoal/ folder in the caller's cwd
        )
        try:
            seconds, cpu, nodes_cpu, rss0 = asyncio.run(
                _nodes(f"{scheme}://127.0.0.1:{port}", tokens, body, server.pid, ssl_ctx)
            )
            peak = _rss_mb(server.pid)
            server.terminate()  # it would otherwise wait for the nodes to hear "done"
            server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    mb = n * len(body) / 1e6
    return {
        "n": n,
        "transport": "tls" if tls else "plain",
        "server": "this" if python == sys.executable else "against",
        "mb": mb,
        "rss_before_mb": rss0,
        "seconds": seconds,
        "mb_per_s": mb / seconds,
        "peak_rss_mb": peak,
        "server_cpu_s": cpu,
        "nodes_cpu_s": nodes_cpu,
        "mb_per_cpu_s": mb / max(cpu, 1e-9),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[20, 200])
    ap.add_argument("--transports", nargs="+", choices=["plain", "tls"], default=["plain", "tls"])
    ap.add_argument("--against", metavar="PYTHON", help="also run each case with this interpreter's shoal server")
    ap.add_argument("--repeat", type=int, default=1, help="run each case this many times (alternating servers)")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    spec = ParamSpec.of(model)
    delta = torch.randn(spec.numel) * 1e-3
    body = encode_update(Update(delta, num_examples=600, base_version=0), spec, {"round": 1})
    model_mb = spec.nbytes / 1e6
    print(f"model: {spec.numel:,} parameters, {model_mb:.2f} MB float32; update body {len(body) / 1e6:.2f} MB")
    servers = [sys.executable] + ([args.against] if args.against else [])
    loads = [os.getloadavg()[0]]
    results = []
    for n in args.n:
        for t in args.transports:
            for _ in range(args.repeat):
                for python in servers:
                    results.append(run(n, body, tls=t == "tls", python=python))
                    loads.append(os.getloadavg()[0])
    print(
        f"load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs "
        "(nodes and server share them)"
    )
    print(
        f"{'server':>8} {'N':>5} {'transport':>9} {'MB sent':>9} {'seconds':>8} {'MB/s':>8} {'nodes CPU s':>12} "
        f"{'server CPU s':>13} "
        f"{'MB per server CPU s':>20} {'server peak RSS MB':>19} {'growth (models)':>16}"
    )
    for r in results:
        growth = (r["peak_rss_mb"] - r["rss_before_mb"]) / model_mb
        print(
            f"{r['server']:>8} {r['n']:>5} {r['transport']:>9} {r['mb']:>9.1f} {r['seconds']:>8.2f} "
            f"{r['mb_per_s']:>8.1f} {r['nodes_cpu_s']:>12.2f} {r['server_cpu_s']:>13.2f} {r['mb_per_cpu_s']:>20.1f} {r['peak_rss_mb']:>19.1f} "
            f"{growth:>16.2f}"
        )

    def best(server: str, n: int, transport: str) -> dict | None:
        """The case's fastest repeat (the one least disturbed by the machine's other load)."""
        runs = [r for r in results if (r["server"], r["n"], r["transport"]) == (server, n, transport)]
        return max(runs, key=lambda r: r["mb_per_s"]) if runs else None

    for n in args.n:
        plain, tls = best("this", n, "plain"), best("this", n, "tls")
        if plain and tls:
            print(f"N={n}: TLS / plain throughput {tls['mb_per_s'] / plain['mb_per_s']:.2f}x")
        for t in args.transports:
            mine, other = best("this", n, t), best("against", n, t)
            if mine and other:
                print(
                    f"N={n} {t}: this / against: throughput {mine['mb_per_s'] / other['mb_per_s']:.2f}x, "
                    f"MB per server CPU s {mine['mb_per_cpu_s'] / other['mb_per_cpu_s']:.2f}x (best of {args.repeat})"
                )
    if "plain" in args.transports and len(args.n) >= 2:
        lo, hi = best("this", args.n[0], "plain"), best("this", args.n[-1], "plain")
        assert lo and hi
        grow = (hi["peak_rss_mb"] - lo["peak_rss_mb"]) / model_mb
        print(
            f"peak RSS growth N={lo['n']} -> N={hi['n']}: {hi['peak_rss_mb'] - lo['peak_rss_mb']:.1f} MB "
            f"= {grow:.2f} model sizes (target < 5); throughput ratio {hi['mb_per_s'] / lo['mb_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
