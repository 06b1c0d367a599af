"""Six real `shoal peer` processes on 127.0.0.1 (plain HTTP, a network token; Synthetic(1,1),
one client each, push-pull gossip), each joining through one bootstrap peer.

They converge; two are SIGKILLed and leave every live view while the others keep training;
one of them, restarted on its address with a fresh model and an empty view, rejoins through
bootstrap and catches up; every peer stops on SIGTERM with exit status 0 and its metrics.jsonl
reports the bytes it sent. Every wait is bounded. (tests/p2p/test_peer_churn.py runs the churn
of each round-based algorithm with ten peers in one event loop.)
"""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from .processes import free_ports, peer_status, start_peer, stop_peers, wait_for

N = 6
DEAD = (2, 4)
THRESHOLD = 0.85  # every live peer's accuracy on the split's global test set (the gossip
# simulation of this config: 0.852 mean / 0.518 worst peer after 10 rounds, 0.960 / 0.941 after 12)
TOKEN = "test-network-token"
SETTINGS = [
    "simulation.num_clients=6",
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
def test_six_peers_converge_survive_two_killed_and_one_rejoins(tmp_path):
    ports = free_ports(N)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = {i: _start(i, ports[i], urls[(i + 1) % N], tmp_path) for i in range(N)}
    live = list(range(N))
    try:

        def statuses(idx):
            out = {i: _status(ports[i]) for i in idx}
            return out if all(out.values()) else None

        def converged(idx):
            st = statuses(idx)
            ok = st and all(s["metrics"].get("test_accuracy", 0) >= THRESHOLD and s["steps"] >= 5 for s in st.values())
            return st if ok else None

        st = wait_for(lambda: converged(range(N)), 240, f"all {N} peers above {THRESHOLD}", procs.values())
        print({i: round(s["metrics"]["test_accuracy"], 3) for i, s in st.items()})
        assert all(s["algorithm"] == "gossip" and len(s["view"]) >= 2 for s in st.values())

        for i in DEAD:
            procs[i].send_signal(signal.SIGKILL)
            procs[i].wait(timeout=10)
        live = [i for i in range(N) if i not in DEAD]
        steps_at_kill = {i: st[i]["steps"] for i in live}
        dead_urls = {urls[i] for i in DEAD}

        def dropped():
            st = statuses(live)
            ok = st and all(not set(s["view"]) & dead_urls and s["steps"] > steps_at_kill[i] + 3 for i, s in st.items())
            return st if ok else None

        wait_for(dropped, 90, "the live peers to drop the killed ones and keep training", [procs[i] for i in live])

        back = DEAD[0]
        procs[back] = _start(back, ports[back], urls[0], tmp_path)  # a fresh model, an empty view
        live.append(back)

        def rejoined():
            st = statuses(live)
            if not st:
                return None
            known = sum(urls[back] in st[i]["view"] for i in live if i != back)
            return st if known >= 1 and st[back]["metrics"].get("test_accuracy", 0) >= THRESHOLD else None

        st = wait_for(rejoined, 120, f"peer {back} to rejoin and catch up", [procs[i] for i in live])
        print({i: round(s["metrics"]["test_accuracy"], 3) for i, s in st.items()})
    finally:
        stop_peers(procs.values())
    assert all(procs[i].returncode == 0 for i in live), {i: procs[i].returncode for i in live}
    for i in live:  # SIGTERM wrote a last record; it reports the bytes sent, in total and per round
        with open(tmp_path / f"peer{i}" / "metrics.jsonl") as f:
            last = [json.loads(line) for line in f][-1]
        assert last["final"] is True and last["bytes_sent"] > 0 and last["bytes_sent_per_round"] > 0, (i, last)
        assert "Traceback" not in (tmp_path / f"peer{i}.log").read_text()
