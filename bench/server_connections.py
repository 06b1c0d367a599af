"""Server memory per open connection, plain and TLS: what server.max_connections bounds.

A real `shoal server` process on 127.0.0.1 (a small one-run config); this process opens N
connections to it (TLS handshakes done) and sends one request on each (so each holds aiohttp's
protocol, parser and buffers as an idle keep-alive connection does), then reads the server's
resident memory (VmRSS) before and after. Printed per transport: the growth divided by N.
Then it opens max_connections + 10 and counts the 503 answers of those past the cap.

    .venv/bin/python bench/server_connections.py [--n 1000] [--cap 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_node import free_port  # bench/ is on sys.path when a script here runs

from shoal.server.registry import Registry
from shoal.tls import client_context, make_private_ca

CONFIG = """
[simulation]
seed = 1
num_clients = 5
[data]
dataset = "synthetic"
[model]
name = "logreg"
[server]
host = "127.0.0.1"
port = {port}
rounds = 1
min_nodes = 1000000
eval = false
max_connections = {cap}
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
"""


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def _open(port: int, ssl_ctx, token: str) -> tuple[asyncio.StreamWriter, bytes]:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ssl_ctx, server_hostname="127.0.0.1" if ssl_ctx else None
    )
    writer.write(f"GET /v1/task?wait=0 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode())
    await writer.drain()
    first = await asyncio.wait_for(reader.readuntil(b"\r\n"), 30)
    return writer, first


async def _measure(port: int, pid: int, ssl_ctx, token: str, n: int, cap: int) -> tuple[float, int, int]:
    for _ in range(300):
        try:
            w, _first = await _open(port, ssl_ctx, token)
            w.close()
            break
        except OSError:
            await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    before = _rss_kb(pid)
    held = []
    for i in range(0, n, 50):  # in batches: the server's accept backlog is 128
        held += await asyncio.gather(*(_open(port, ssl_ctx, token) for _ in range(min(50, n - i))))
    await asyncio.sleep(0.5)
    per_conn = (_rss_kb(pid) - before) / n
    extra = []
    for _ in range(cap - n + 10):
        try:
            extra.append(await _open(port, ssl_ctx, token))
        except (OSError, asyncio.IncompleteReadError):
            extra.append((None, b"closed"))
    refused = sum(1 for _, first in extra if first.startswith(b"HTTP/1.1 503"))
    served = sum(1 for _, first in held + extra if first.startswith(b"HTTP/1.1 200"))
    for w, _ in held + extra:
        if w is not None:
            w.close()
    return per_conn, served, refused


def run(n: int, cap: int, tls: bool) -> tuple[float, int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = CONFIG.format(port=port, cap=cap, tmp=tmp)
        flags, ssl_ctx = ["--insecure"], None
        if tls:
            pki = make_private_ca(Path(tmp) / "pki")
            config += f'tls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\n'
            flags, ssl_ctx = [], client_context(pki.ca_cert)
        (Path(tmp) / "server.toml").write_text(config)
        reg = Registry(Path(tmp) / "nodes.sqlite")
        token = reg.add("n0")
        reg.close()
        server = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "server", "--config", f"{tmp}/server.toml", *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=tmp,
        )
        try:
            return asyncio.run(_measure(port, server.pid, ssl_ctx, token, n, cap))
        finally:
            server.terminate()
            server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="connections held open")
    ap.add_argument("--cap", type=int, default=1000, help="server.max_connections (>= --n)")
    args = ap.parse_args()
    if args.cap < args.n:
        ap.error("--cap must be at least --n")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * args.cap + 100)), hard))
    t0 = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    for tls in (False, True):
        per_conn, served, refused = run(args.n, args.cap, tls)
        print(
            f"{'TLS' if tls else 'plain':>5}: {per_conn:.1f} KB of server RSS per open connection ({args.n} held); "
            f"{served} answered 200, {refused} of the {args.cap - args.n + 10} past or at the cap answered 503"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
