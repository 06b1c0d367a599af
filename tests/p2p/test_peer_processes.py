"""Eight real `shoal peer` processes on 127.0.0.1 (Synthetic(1,1), one client each).

They converge, survive two SIGKILLed peers (which leave every live view), and a
restarted peer rejoins through bootstrap and catches up. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

N = 8
THRESHOLD = 0.85  # every live peer's accuracy on the split's global test set (the gossip
# simulation of this config reaches 0.926 mean / 0.908 min peer accuracy in 10 rounds)
TOKEN = "test-network-token"
SETTINGS = [
    "simulation.num_clients=8",
    "simulation.seed=3",
    'model.name="logreg"',
    "train.lr=0.01",
    "train.batch_size=20",
    "gossip.period=0.3",
    "gossip.timeout=5.0",
    "gossip.view_size=4",
    "gossip.shuffle_length=2",
    "gossip.max_failures=2",
    "gossip.max_age_gap=20",
]


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _start(i: int, port: int, bootstrap: str, tmp) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "shoal.cli",
        "peer",
        "--insecure",
        "--listen",
        f"127.0.0.1:{port}",
        "--bootstrap",
        bootstrap,
        "--data",
        f"client:{i}",
        "--token",
        TOKEN,
        "--out",
        str(tmp / f"peer{i}"),
    ]
    for s in SETTINGS:
        cmd += ["--set", s]
    log = open(tmp / f"peer{i}.log", "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _status(port: int) -> dict | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=3) as r:
            return json.load(r)
    except OSError:
        return None


def _wait(pred, deadline: float, what: str):
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_eight_peers_converge_survive_kills_and_rejoin(tmp_path):
    ports = _free_ports(N)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = {i: _start(i, ports[i], urls[(i + 1) % N] if i else urls[1], tmp_path) for i in range(N)}
    try:

        def statuses(idx):
            out = {i: _status(ports[i]) for i in idx}
            return out if all(out.values()) else None

        def converged(idx):
            st = statuses(idx)
            ok = st and all(s["metrics"].get("test_accuracy", 0) >= THRESHOLD and s["steps"] >= 5 for s in st.values())
            return st if ok else None

        t_end = time.monotonic() + 240
        st = _wait(lambda: converged(range(N)), t_end, f"all {N} peers above {THRESHOLD}")
        print({i: round(s["metrics"]["test_accuracy"], 3) for i, s in st.items()})
        assert all(len(s["view"]) >= 2 for s in st.values())

        dead = {2, 5}
        for i in dead:
            procs[i].send_signal(signal.SIGKILL)
            procs[i].wait(timeout=10)
        live = [i for i in range(N) if i not in dead]
        steps_at_kill = {i: st[i]["steps"] for i in live}
        dead_urls = {urls[i] for i in dead}

        def dropped():
            st = statuses(live)
            return (
                st
                if st
                and all(not (set(s["view"]) & dead_urls) and s["steps"] > steps_at_kill[i] + 3 for i, s in st.items())
                else None
            )

        _wait(dropped, time.monotonic() + 90, "the live peers to drop the killed ones and keep training")

        procs[2] = _start(2, ports[2], urls[0], tmp_path)  # restart: a fresh model, an empty view

        def rejoined():
            st = statuses(live + [2])
            if not st:
                return None
            known = sum(urls[2] in st[i]["view"] for i in live)
            return st if known >= 1 and st[2]["metrics"].get("test_accuracy", 0) >= THRESHOLD else None

        st = _wait(rejoined, time.monotonic() + 120, "peer 2 to rejoin and catch up")
        print({i: round(s["metrics"]["test_accuracy"], 3) for i, s in st.items()})
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
