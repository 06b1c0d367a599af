"""Eight real `shoal peer` processes on 127.0.0.1 (Synthetic(1,1), one client each).

They converge, survive two SIGKILLed peers (which leave every live view), and a
restarted peer rejoins through bootstrap and catches up. Every wait is bounded.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from .processes import free_ports, peer_status, start_peer, stop_peers, wait_for

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


def _start(i: int, port: int, bootstrap: str, tmp) -> subprocess.Popen:
    args = ["--insecure", "--listen", f"127.0.0.1:{port}", "--bootstrap", bootstrap, "--data", f"client:{i}"]
    args += ["--out", str(tmp / f"peer{i}")]
    for s in SETTINGS:
        args += ["--set", s]
    return start_peer(args, TOKEN, tmp / f"peer{i}.log")


def _status(port: int) -> dict | None:
    return peer_status(f"http://127.0.0.1:{port}", TOKEN)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_eight_peers_converge_survive_kills_and_rejoin(tmp_path):
    ports = free_ports(N)
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

        st = wait_for(lambda: converged(range(N)), 240, f"all {N} peers above {THRESHOLD}")
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

        wait_for(dropped, 90, "the live peers to drop the killed ones and keep training")

        procs[2] = _start(2, ports[2], urls[0], tmp_path)  # restart: a fresh model, an empty view

        def rejoined():
            st = statuses(live + [2])
            if not st:
                return None
            known = sum(urls[2] in st[i]["view"] for i in live)
            return st if known >= 1 and st[2]["metrics"].get("test_accuracy", 0) >= THRESHOLD else None

        st = wait_for(rejoined, 120, "peer 2 to rejoin and catch up")
        print({i: round(s["metrics"]["test_accuracy"], 3) for i, s in st.items()})
    finally:
        stop_peers(procs.values())
