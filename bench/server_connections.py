"""Server memory per open connection, plain and TLS: what server.max_connections bounds.

A real `shoal server` process on 127.0.0.1 (a small one-run config); this process opens N
connections to it (TLS handshakes done) and sends one request on each (so each holds aiohttp's
protocol, parser and buffers as an idle keep-alive connection does), then reads the server's
resident memory (VmRSS) before and after. Printed per transport: the growth divided by N.
Then it opens max_connections + 10 and counts the 503 answers of those past the cap.

With ``--attack``: the connection guard under a crowd of silent sockets. A TLS server with
``server.tls_client_ca`` and two `shoal client` nodes enrolled by key train (sync rounds of the
built-in logistic regression); versions per second are measured for ``--window`` seconds quiet,
then for ``--window`` seconds while another process holds ``--silent`` TCP sockets that never
send a byte (each reopened as soon as the server drops it), side by side. During both windows a new
enrolled connection (TLS with a node certificate, one request) is opened every 0.5 s: how many
were served and their median time to the answer.

    .venv/bin/python bench/server_connections.py [--n 1000] [--cap 1000]
    .venv/bin/python bench/server_connections.py --attack [--silent 1100] [--window 20]
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


def _versions(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    return sum(1 for line in metrics.read_text().splitlines() if '"train_loss"' in line)


async def _silent_crowd(port: int, n: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """``n`` TCP sockets that never send a byte; each reopened as soon as the server drops it."""

    async def one() -> None:
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                counts["connect_failed"] += 1
                await asyncio.sleep(0.05)
                continue
            counts["opened"] += 1
            try:
                while not stop.is_set():
                    try:
                        async with asyncio.timeout(0.5):
                            if not await reader.read(1024):
                                break  # dropped by the server
                    except TimeoutError:
                        continue
            except ConnectionError:
                pass
            finally:
                writer.close()

    await asyncio.gather(*(one() for _ in range(n)))


def _crowd_process(port: int, n: int, seconds: float, out) -> None:
    """The crowd in a process of its own (so that it does not slow this process's probes)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 200)), hard))
    counts = {"opened": 0, "connect_failed": 0}

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        await _silent_crowd(port, n, stop, counts)

    asyncio.run(main())
    out.put(counts)


async def _probe(port: int, ctx, stop: asyncio.Event, out: list[float | None]) -> None:
    """A new enrolled connection every 0.5 s: seconds to its 200 answer, None if refused or cut."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(10):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
                writer.write(b"GET /v1/task?wait=0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                first = await reader.readuntil(b"\r\n")
                writer.close()
            out.append(time.perf_counter() - t0 if first.startswith(b"HTTP/1.1 200") else None)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            out.append(None)
        await asyncio.sleep(0.5)


async def _attack_windows(port: int, metrics: Path, ctx, silent: int, window: float) -> list[tuple]:
    deadline = time.monotonic() + 180
    while _versions(metrics) < 3:  # the nodes are training
        if time.monotonic() > deadline:
            raise RuntimeError("the nodes did not train 3 versions in 180 s")
        await asyncio.sleep(0.5)
    rows = []
    for attacked in (False, True):
        stop = asyncio.Event()
        counts = {"opened": 0, "connect_failed": 0}
        probes: list[float | None] = []
        crowd = queue = None
        if attacked:
            import multiprocessing

            queue = multiprocessing.Queue()
            crowd = multiprocessing.Process(target=_crowd_process, args=(port, silent, window + 2.0, queue))
            crowd.start()
            await asyncio.sleep(1.0)  # the crowd is open
        tasks = [asyncio.ensure_future(_probe(port, ctx, stop, probes))]
        v0, t0 = _versions(metrics), time.monotonic()
        await asyncio.sleep(window)
        rate = (_versions(metrics) - v0) / (time.monotonic() - t0)
        stop.set()
        await asyncio.wait(tasks, timeout=15)
        if crowd is not None and queue is not None:
            counts = await asyncio.get_running_loop().run_in_executor(None, queue.get, True, 60)
            crowd.join(30)
        served = sorted(p for p in probes if p is not None)
        median = served[len(served) // 2] if served else float("nan")
        rows.append((attacked, rate, len(served), len(probes), median, counts["opened"], counts["connect_failed"]))
    return rows


def attack(silent: int, window: float) -> None:
    """Versions per second of two enrolled nodes, quiet and under ``silent`` silent sockets."""
    from shoal.pki import fingerprint, make_node_key, read_node_csr, sign_node

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        port = free_port()
        pki = make_private_ca(t / "pki")
        config = CONFIG.format(port=port, cap=1024, tmp=tmp).replace("rounds = 1\nmin_nodes = 1000000\n", "")
        config += (
            f"rounds = 100000\nmin_nodes = 2\nclients_per_round = 2\ndeadline_s = 30\n"
            f'tls_cert = "{pki.cert}"\ntls_key = "{pki.key}"\ntls_client_ca = "{pki.ca_cert}"\n'
        )
        (t / "server.toml").write_text(config)
        split = subprocess.run(
            [sys.executable, "-m", "shoal.cli", "data", "split", "-c", "server.toml", "--out", "shards"],
            cwd=tmp, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        if split.returncode:
            raise SystemExit(f"shoal data split failed:\n{split.stdout[-2000:]}{split.stderr[-2000:]}")
        shards = sorted((t / "shards").glob("*.safetensors"))
        reg = Registry(t / "nodes.sqlite")
        certs = []
        for i in range(3):  # two training nodes and the probe
            made = make_node_key(t / f"k{i}", f"k{i}")
            csr = read_node_csr(made.csr, f"k{i}")
            certs.append((sign_node(pki.ca_cert.parent, csr, f"k{i}", t / f"k{i}" / f"k{i}.pem"), made.key))
            reg.add_key(f"k{i}", fingerprint(csr))
        reg.close()
        cli = [sys.executable, "-m", "shoal.cli"]
        procs = [
            subprocess.Popen(
                [*cli, "server", "--config", f"{tmp}/server.toml"],
                cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(t / "server.log", "w"),
            )
        ]  # fmt: skip
        for i in range(2):
            procs.append(
                subprocess.Popen(
                    [*cli, "client", "--server", f"https://127.0.0.1:{port}", "--cert", str(certs[i][0]),
                     "--key", str(certs[i][1]), "--ca-cert", str(pki.ca_cert), "--data", str(shards[i]),
                     "-c", f"{tmp}/server.toml", "--name", f"k{i}", "--device", "cpu"],
                    cwd=tmp, stdout=subprocess.DEVNULL, stderr=open(t / f"k{i}.log", "w"),
                )
            )  # fmt: skip
        try:
            ctx = client_context(pki.ca_cert, certs[2][0], certs[2][1])
            try:
                rows = asyncio.run(_attack_windows(port, t / "run" / "metrics.jsonl", ctx, silent, window))
            except RuntimeError as e:
                tails = "".join(f"\n--- {n}:\n{(t / n).read_text()[-1500:]}" for n in ("server.log", "k0.log"))
                raise SystemExit(f"{e}{tails}") from None
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
    quiet = rows[0][1]
    for attacked, rate, served, probes, median, opened, failed in rows:
        what = f"{silent} silent sockets" if attacked else "quiet"
        crowd = f"; {opened} silent sockets opened in all, {failed} connects failed" if attacked else ""
        print(
            f"{what:>20}: {rate:.2f} versions/s ({rate / quiet if quiet else float('nan'):.2f}x quiet); "
            f"new enrolled connections served {served}/{probes}, median {median * 1000:.0f} ms{crowd}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="connections held open")
    ap.add_argument("--cap", type=int, default=1000, help="server.max_connections (>= --n)")
    ap.add_argument("--attack", action="store_true", help="versions/s quiet vs under silent sockets (see above)")
    ap.add_argument("--silent", type=int, default=1100, help="--attack: silent sockets held")
    ap.add_argument("--window", type=float, default=20.0, help="--attack: seconds measured each way")
    args = ap.parse_args()
    if args.cap < args.n:
        ap.error("--cap must be at least --n")
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(2 * args.cap, args.silent) + 200
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, want)), hard))
    t0 = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.attack:
        attack(args.silent, args.window)
        print(f"({time.perf_counter() - t0:.0f} s)")
        return
    for tls in (False, True):
        per_conn, served, refused = run(args.n, args.cap, tls)
        print(
            f"{'TLS' if tls else 'plain':>5}: {per_conn:.1f} KB of server RSS per open connection ({args.n} held); "
            f"{served} answered 200, {refused} of the {args.cap - args.n + 10} past or at the cap answered 503"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
