"""Edge restarts in a row, measured: `python -m tests.hierarchy.restarts [--restarts 10]`.

A root, two edge processes and four `shoal client` nodes (each given both edges) on 127.0.0.1.
The edges are SIGKILLed and started again in turn, one per root version: every kill takes the
nodes the killed edge held, mid-round, and they re-attach to the other edge. It prints, per round,
how long the root took and how the round closed, and the rounds that closed at the root's deadline
(none should: a node that no live edge holds is not selected, and one that re-attaches gets its
task or, when its new edge's partial is in already, is not waited for). Not part of the test suite: a
measurement (docs/hierarchy.md quotes it); every process is killed at the end."""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from .deploy import hierarchy

DEADLINE_S = 20.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--restarts", type=int, default=10)
    args = ap.parse_args()
    rounds = 10_000  # the run goes on through the restarts; it is stopped a few versions after the last
    with tempfile.TemporaryDirectory() as d, hierarchy(Path(d), n=4, edges=2, rounds=rounds, deadline=DEADLINE_S) as h:
        h.start_servers()
        h.start_nodes()
        h.wait_status(lambda s: s["version"] >= 1, 180)
        kills = []
        for k in range(args.restarts):
            name = h.edge_names[k % 2]
            v = h.status()["version"]  # type: ignore[index]
            h.wait_status(lambda s, v=v: s["version"] > v or s["done"], 180)  # one kill per version
            time.sleep(0.3)  # into the next round: nodes are training or uploading
            h.kill(name)
            kills.append((name, h.status()["version"]))  # type: ignore[index]
            h.edge(name)
            h.listening(120)
        v = h.status()["version"]  # type: ignore[index]
        h.wait_status(lambda s, v=v: s["version"] >= v + 3, 180)
        records = h.records()
        root_log = (Path(d) / "root.log").read_text()
    moved_late = len(re.findall(r"re-attached to edge \S+ after its partial", root_log))
    durations = [r["server_round_s"] for r in records[1:]]  # the first one includes the start-up
    waited = [r["version"] for r in records[1:] if r["server_round_s"] >= DEADLINE_S]
    print(f"{args.restarts} edge restarts (SIGKILL, then a new process) at versions {[v for _, v in kills]}")
    for r in records:
        print(f"  version {r['version']}: {r['num_results']} results, {r['server_round_s']:.2f} s")
    killed = [r for r in records if any(r["version"] == v + 1 for _, v in kills)]
    print(
        f"rounds that waited out the {DEADLINE_S:.0f} s deadline: {len(waited)} {waited}; longest round after "
        f"the first {max(durations):.2f} s; the rounds with a kill: "
        + ", ".join(f"v{r['version']} {r['num_results']}/4 in {r['server_round_s']:.2f} s" for r in killed)
        + f"; nodes that reached their new edge after its partial (answered, not waited for): {moved_late}"
    )


if __name__ == "__main__":
    main()
