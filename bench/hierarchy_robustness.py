"""Edge aggregators as real processes on 127.0.0.1 at 100 nodes: the exactness check and the
robustness run (docs/hierarchy.md). Nodes run in a few node hosts (tests/hierarchy/nodehost.py:
the real node code, many nodes on one event loop per process; a `shoal client` per node would
import torch 100 times). Logistic regression on synthetic data, so rounds are short.

``exact``: a root, ``--edges`` edges and ``--n`` nodes, sync rounds, one edge round per root round,
every node in every round; the root's model after ``--rounds`` versions (its checkpoint) against
flat FedAvg's (the simulator's, the same config without edges): the largest difference.

    .venv/bin/python bench/hierarchy_robustness.py exact [--n 100] [--edges 4] [--hosts 4] [--rounds 3]

``robust``: the same tree for ``--rounds`` versions; each node drops out of each round with
probability ``--dropout`` (it trains and sends nothing: decided per node and round from a seed),
and one edge is SIGKILLed after version ``--kill-at`` is made, in the next round, once it took
``--kill-holding`` of its nodes' uploads (read from the hosts' events) (its nodes re-attach to the next edge
of their list). Edges close their part of a round at ``--quorum`` of the weight they expect, or
``edge_margin_s`` before the root's ``--deadline``. Printed: rounds opened and versions made, the
results per version, round latency p50/p95/p99, re-attach times, the root's RSS, and the proof from
the records that no update was counted twice or lost:

- each version's ``num_results`` at the root equals the nodes inside the partials the root took
  in that round (the edges' edge_metrics.jsonl), and no node is in two of them;
- every update an edge took from a node (the hosts' events: node, round, the edge it went to) is
  inside that edge's partial of that round, which the root took; the exceptions are listed by cause
  (the killed edge's round: its partial never left);
- no partial holds a node whose update its edge did not take.

    .venv/bin/python bench/hierarchy_robustness.py robust [--n 100] [--edges 4] [--hosts 4] [--rounds 200]
        [--dropout 0.3] [--kill-at 100] [--quorum 0.6] [--deadline 3.0]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's process harness

from tests.hierarchy.deploy import Hierarchy, hierarchy  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@contextmanager
def workdir(keep: str | None):
    """A fresh temporary folder, or ``keep`` (made, left for reading the logs afterwards)."""
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp
    else:
        Path(keep).mkdir(parents=True, exist_ok=False)
        yield keep


def start(h: Hierarchy, hosts: int, dropout: float = 0.0, seed: int = 0) -> list[str]:
    h.start_servers(180)
    return h.hosts(hosts, dropout, seed)


def exact(args: argparse.Namespace) -> None:
    from shoal.server.checkpoint import load_checkpoint
    from shoal.simulations.inprocess import InProcessSimulation

    with tempfile.TemporaryDirectory() as tmp, hierarchy(Path(tmp), args.n, args.edges, args.rounds, 60.0) as h:
        t0 = time.monotonic()
        hosts = start(h, args.hosts)
        assert h.wait("root", 600) == 0, h.dump()
        took = time.monotonic() - t0
        for t in hosts:
            assert h.wait(t, 60) == 0, h.dump()
        records = h.records()
        ck = sorted((Path(tmp) / "ck").iterdir())
        params = next(t for t, s in map(load_checkpoint, ck) if s["version"] == args.rounds)["params"]
        sim = InProcessSimulation.from_config(h.cfg)
        for _ in range(args.rounds):
            sim.run_round()
        diff = float((params - sim.global_params).abs().max())
    print(
        f"{args.n} nodes in {args.hosts} node hosts, {args.edges} edges, {args.rounds} sync rounds: "
        f"{took:.1f} s from the start of the processes to the root's exit"
    )
    print("per version (results, edges reporting, nodes via edges):")
    print(
        "  "
        + ", ".join(
            f"v{r['version']}: {r['num_results']}/{r['hier_edges_reporting']}/{r['hier_nodes_via_edges']}"
            for r in records
        )
    )
    print(f"largest difference from flat FedAvg (the simulator), version {args.rounds}: {diff:.3g}")
    print("EXACT (<= 1e-6)" if diff <= 1e-6 else "NOT EXACT")


def robust(args: argparse.Namespace) -> None:
    values = {"min_nodes": str(args.n // 2), "min_fraction": str(args.min_fraction)}
    add = {"hierarchy": f"edge_quorum = {args.quorum}"}
    victim = "edge-b"
    with workdir(args.keep) as tmp:
        secure = (
            f"[secure_aggregation]\nenabled = true\nbits = 24\nclip = 1.0\nstage_s = {args.stage_s}\n"
            if args.secure
            else ""
        )
        with hierarchy(Path(tmp), args.n, args.edges, args.rounds, args.deadline, secure, values, add) as h:
            rss: list[float] = []

            def sample() -> None:
                mb = h.rss_mb("root")
                if mb is not None:
                    rss.append(mb)

            t0 = time.monotonic()
            hosts = start(h, args.hosts, args.dropout, args.seed)
            killed = h.wait_status(lambda s: s["version"] >= args.kill_at, 1200, sample)["version"]
            url = h.edge_url(victim)
            after = max(e["round"] for e in h.events() if e["round"] is not None)
            taken = "masked" if args.secure else "accepted"
            end = time.monotonic() + 60
            held: list[dict] = []  # into the next round, once the edge took some of its nodes' uploads
            while len(held) < args.kill_holding and time.monotonic() < end:
                time.sleep(0.01)
                held = [
                    e for e in h.events() if e["server"] == url and e["outcome"] == taken and (e["round"] or 0) > after
                ]
            h.kill(victim)
            print(f"{victim} SIGKILLed after version {killed}, holding {len(held)} uploads", flush=True)
            assert h.wait("root", 1500, sample) == 0, h.dump()
            took = time.monotonic() - t0
            for t in hosts:
                assert h.wait(t, 60) == 0, h.dump()
            records = [r for r in h.records() if "num_results" in r]
            root_log = (Path(tmp) / "root.log").read_text()
            aborted = Counter(m[:160] for m in re.findall(r"secure aggregation aborted at (.*)", root_log))
            stops = [r for r in h.records() if "stopped" in r]
            partials = {e: h.edge_records(e) for e in h.edge_names}
            events = h.events()
            reattach = h.reattach_times()
            port_edge = {h.edge_url(e): e for e in h.edge_names}
    if args.secure:
        print(
            f"secure aggregation through the edges; {victim} killed after version {killed} holding {len(held)} masked inputs"
        )
        print(
            f"wall time {took:.0f} s; re-attach p50 {pct(reattach, 0.5) if reattach else float('nan'):.2f} s; root RSS peak {max(rss):.0f} MB"
        )
        for why, k in aborted.most_common():
            print(f"  aborted x{k}: {why}")
        root_figures(records)
        secure_proof(records, partials, events, port_edge, victim)
        return
    opened = max(r["round"] for r in records)
    made = len(records)
    print(
        f"{args.n} nodes in {args.hosts} hosts under {args.edges} edges, dropout {args.dropout}, {victim} killed "
        f"after version {killed} holding {len(held)} uploads; edge quorum {args.quorum}, root deadline {args.deadline} s, min_fraction {args.min_fraction}"
    )
    print(f"wall time {took:.0f} s; rounds opened {opened}, versions made {made} ({100 * made / opened:.1f}%)")
    if stops:
        print(f"the run stopped early: {stops[-1]['stopped']}")
    results = [r["num_results"] for r in records]
    print(
        f"results per version: min {min(results)}, median {pct(results, 0.5)}, max {max(results)} of {args.n} "
        f"(expected {args.n * (1 - args.dropout):.0f} with no late node)"
    )
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    print(
        f"round latency (between versions): p50 {pct(steps, 0.5):.3f} s, p95 {pct(steps, 0.95):.3f} s, p99 {pct(steps, 0.99):.3f} s, max {max(steps):.3f} s"
    )
    if reattach:
        print(f"re-attach: {len(reattach)} nodes, p50 {pct(reattach, 0.5):.2f} s, max {max(reattach):.2f} s")
    print(
        f"root RSS peak {max(rss):.0f} MB; root ingress from edges {sum(r.get('hier_bytes_edge_root_up', 0) for r in records) / 1e6:.2f} MB"
    )
    root_figures(records)

    lines = [p for ps in partials.values() for p in ps]
    closes = Counter(p["closed"] for p in lines)
    print(
        f"edges closed their part of a round: {dict(closes)}; closed after p50 "
        f"{pct([p['closed_after_s'] for p in lines], 0.5):.3f} s, partial answered after p50 "
        f"{pct([p['sent_after_s'] for p in lines], 0.5):.3f} s (from hearing of the round)"
    )

    # --- the proof from the records -------------------------------------------------------
    problems: list[str] = []
    by_round: dict[int, list[tuple[str, dict]]] = defaultdict(list)
    for e, lines in partials.items():
        for p in lines:
            by_round[p["round"]].append((e, p))
    for r in records:
        taken = [p for _, p in by_round[r["round"]] if p["answer"] == "accepted"]
        names = Counter(n for p in taken for n in p["nodes"])
        twice = [n for n, c in names.items() if c > 1]
        if twice:
            problems.append(f"round {r['round']}: counted twice {twice}")
        if r["num_results"] != sum(names.values()) or r["hier_nodes_via_edges"] != r["num_results"]:
            problems.append(
                f"round {r['round']}: root counted {r['num_results']}, partials taken hold {sum(names.values())}"
            )
    outcome: Counter[str] = Counter()
    root_rounds = {r["round"] for r in records}
    inside: dict[tuple[str, int], tuple[set[str], str]] = {
        (e, p["round"]): (set(p["nodes"]), p["answer"]) for e, lines in partials.items() for p in lines
    }
    for ev in events:
        if ev["outcome"] != "accepted":
            outcome[
                "dropped (the node's coin)"
                if ev["outcome"] == "dropped"
                else "refused by the edge (its part of the round had closed, or it was gone)"
            ] += 1
            continue
        edge = port_edge[ev["server"]]
        got = inside.get((edge, ev["round"]))
        if got is None:
            outcome[
                "taken by an edge that sent no partial of its round" + (" (the killed edge)" if edge == victim else "")
            ] += 1
        elif ev["node"] not in got[0]:
            outcome["taken by an edge, missing from its partial"] += 1
        elif got[1] != "accepted":
            outcome[f"in a partial the root answered {got[1]}"] += 1
        elif ev["round"] in root_rounds:
            outcome["counted at the root"] += 1
        else:
            outcome["in a partial taken by a round that failed"] += 1
    took_by = Counter(
        (port_edge[ev["server"]], ev["round"], ev["node"]) for ev in events if ev["outcome"] == "accepted"
    )
    invented = [(e, rd, n) for (e, rd), (names, _) in inside.items() for n in names if took_by[(e, rd, n)] != 1]
    if invented:
        problems.append(f"{len(invented)} partial members with no (or two) uploads taken, e.g. {invented[:3]}")
    print("uploads by outcome (hosts' events):")
    for k, v in sorted(outcome.items(), key=lambda kv: -kv[1]):
        print(f"  {v:>6}  {k}")
    counted = outcome["counted at the root"]
    print(f"root's total results {sum(results)}; uploads counted at the root per the events {counted}")
    if counted != sum(results):
        problems.append(f"root counted {sum(results)} results, the events show {counted}")
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems))
    else:
        print(
            "checked: no node counted twice in a round; each version's count equals the nodes in the partials the "
            "root took; every node in a partial had one upload taken by that edge in that round; every taken upload "
            "was counted at the root, but those listed above"
        )


def root_figures(records: list[dict]) -> None:
    """The root's own per-version figures from its metrics.jsonl (what the dashboard charts)."""
    cpu = [r["server_cpu_s"] for r in records if "server_cpu_s" in r]
    took = [r["server_round_s"] for r in records if "server_round_s" in r]
    moved = [r for r in records if r.get("hier_nodes_reattached")]
    if cpu and took:
        print(
            f"root per version (metrics.jsonl): CPU p50 {pct(cpu, 0.5):.3f} s, p99 {pct(cpu, 0.99):.3f} s; "
            f"round p50 {pct(took, 0.5):.3f} s, p95 {pct(took, 0.95):.3f} s, p99 {pct(took, 0.99):.3f} s; "
            f"RSS max {max(r['server_rss_mb'] for r in records):.0f} MB"
        )
    if moved:
        print(
            f"root saw {sum(r['hier_nodes_reattached'] for r in moved)} nodes move to another edge, "
            f"longest {max(r['hier_reattach_s'] for r in moved):.2f} s after their old edge last named them"
        )


def secure_proof(records: list[dict], sums: dict[str, list[dict]], events: list[dict], port_edge, victim) -> None:
    """Secure rounds: the edges' records name how many masked inputs each masked sum holds (not whose:
    the edge relays the protocol and adds masked vectors it cannot read)."""
    opened = max([r["round"] for r in records] + [s["round"] for ss in sums.values() for s in ss])
    print(f"rounds opened {opened}, versions made {len(records)} ({100 * len(records) / opened:.1f}%)")
    results = [r["num_results"] for r in records]
    print(f"results per version: min {min(results)}, median {pct(results, 0.5)}, max {max(results)}")
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    print(f"round latency: p50 {pct(steps, 0.5):.3f} s, p95 {pct(steps, 0.95):.3f} s, p99 {pct(steps, 0.99):.3f} s")
    problems = []
    for r in records:
        taken = [s for ss in sums.values() for s in ss if s["round"] == r["round"] and s["answer"] == "accepted"]
        if r["num_results"] != sum(s["nodes_in"] for s in taken):
            problems.append(
                f"round {r['round']}: root {r['num_results']}, masked sums taken hold {sum(s['nodes_in'] for s in taken)}"
            )
    masked = Counter((port_edge[e["server"]], e["round"]) for e in events if e["outcome"] == "masked")
    sent = {(edge, s["round"]): s for edge, ss in sums.items() for s in ss}
    outcome: Counter[str] = Counter()
    version_rounds = {r["round"] for r in records}
    for (edge, rd), k in masked.items():
        s = sent.get((edge, rd))
        if s is None:
            outcome[
                "masked inputs taken by an edge that sent no sum of the round"
                + (" (the killed edge)" if edge == victim else "")
            ] += k
        elif s["nodes_in"] != k:
            problems.append(f"{edge} round {rd}: {k} masked inputs taken, its sum holds {s['nodes_in']}")
        elif s["answer"] != "accepted":
            outcome[f"in a masked sum the root answered {s['answer']}"] += k
        elif rd in version_rounds:
            outcome["counted at the root"] += k
        else:
            outcome["in a masked sum of a round that aborted"] += k
    outcome["dropped (the node's coin, before its masked input)"] = sum(e["outcome"] == "dropped" for e in events)
    print("masked inputs by outcome (hosts' events):")
    for key, v in sorted(outcome.items(), key=lambda kv: -kv[1]):
        print(f"  {v:>6}  {key}")
    print(f"root's total results {sum(results)}")
    if problems:
        print("PROBLEMS:\n  " + "\n  ".join(problems[:20]))
    else:
        print(
            "checked: each version's count equals the masked inputs in the sums the root took; every edge's "
            "sum holds exactly the masked inputs it took in that round; those taken were counted at the root "
            "but those listed above"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["exact", "robust"])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--edges", type=int, default=4)
    ap.add_argument("--hosts", type=int, default=4, help="node host processes")
    ap.add_argument("--rounds", type=int, default=None, help="versions (exact: 3, robust: 200)")
    ap.add_argument("--dropout", type=float, default=0.3)
    ap.add_argument("--kill-at", type=int, default=None, help="SIGKILL edge-b at this version (robust: rounds / 2)")
    ap.add_argument("--kill-holding", type=int, default=5, help="kill once the edge took this many uploads of a round")
    ap.add_argument("--quorum", type=float, default=0.6, help="hierarchy.edge_quorum")
    ap.add_argument("--deadline", type=float, default=2.0, help="server.deadline_s")
    ap.add_argument("--min-fraction", type=float, default=0.3, help="server.min_fraction")
    ap.add_argument("--seed", type=int, default=1, help="the drop-outs' seed")
    ap.add_argument("--keep", default=None, help="run in this new folder and keep it (the processes' logs)")
    ap.add_argument("--secure", action="store_true", help="secure aggregation through the edges")
    ap.add_argument("--stage-s", type=float, default=1.5, help="secure_aggregation.stage_s")
    args = ap.parse_args()
    args.rounds = args.rounds or (3 if args.mode == "exact" else 200)
    args.kill_at = args.kill_at if args.kill_at is not None else args.rounds // 2
    print(f"load average (1 min) at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    (exact if args.mode == "exact" else robust)(args)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
