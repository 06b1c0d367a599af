"""The root's ingress and CPU per round: 100 nodes straight to the root vs the same 100 under 4 edges.

Both sides run the root's own request handling without the HTTP layer, in this process, side
by side: a ServerService (server/service.py) with the 1.66M-parameter MNIST CNN (6.65 MB)
opens a sync round of K = N nodes; flat, each node's update body goes through
``ServerService.submit`` (decode in place, validate, stream into the sum); hierarchical, each
edge's partial body (its nodes' sum, aggregation/partial.py) goes through
``PartialIntake.submit`` (server/edge/intake.py: decode, validate, dedup, SyncRounds.submit_sum). Then
``tick`` closes the round (the strategy divides, the optimizer steps, the checkpoint event is
made). Root CPU is this process's CPU time over a round's submits and its close; ingress is the
sum of the bodies the root read. One edge's own CPU for its part of the round (decode its nodes'
updates, sum, encode the partial) is printed beside it: the work moves to the edges, it does not
vanish. HTTP, TLS and the socket reads are left out on both sides (each costs per byte and per
request, of which the tree has N/E times fewer at the root).

    .venv/bin/python bench/hierarchy.py [--n 100] [--edges 4] [--rounds 3] [--model cnn|2nn]

``--processes``: real processes on 127.0.0.1 instead (tests/hierarchy/deploy.py): a root with
``--n`` `shoal client` nodes straight to it, then a root with the same nodes under ``--edges``
`shoal server --parent` edges, one after the other, logistic regression on synthetic data; with
``--kill-after K`` one edge is SIGKILLed once version K is made. Printed side by side: the root's
round latency p50/p95 (between consecutive versions in its metrics.jsonl, the first round left
out: it waits for the processes to start), the root's peak RSS (sampled from /proc every 0.1 s),
the edges' close and send latency (their edge_metrics.jsonl), and the nodes' re-attach times.

    .venv/bin/python bench/hierarchy.py --processes [--n 8] [--edges 2] [--rounds 10] [--kill-after 5]

``--secure``: secure aggregation of ``--n`` nodes' vectors of the model's size, flat against
through ``--edges`` edges (aggregation/secagg/tiers.py), in memory, the same inputs, alternating:
the root's ingress (every protocol byte it reads) and its CPU (the protocol's server side, sealed
answers opened, plus decoding the masked bodies it ingests), and the bytes on each link.

    .venv/bin/python bench/hierarchy.py --secure [--n 100] [--edges 4] [--rounds 3] [--model 2nn] [--graph secagg+]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from shoal.aggregation.partial import Accumulator, encode_partial
from shoal.config import config_from_dict
from shoal.server.edge.intake import PartialIntake
from shoal.server.service import ServerService
from shoal.update import Update
from shoal.wire import decode_update, encode_update


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def service(tmp: Path, n: int, model: str) -> ServerService:
    cfg = config_from_dict(
        {
            "simulation": {"seed": 0},
            "data": {"dataset": "mnist", "dir": "unused: the server does not evaluate here", "partition": "iid"},
            "model": {"name": model},
            "hierarchy": {"edge_names": [f"edge-{e}" for e in range(64)]},
            "server": {
                "rounds": 1000,
                "min_nodes": n,
                "clients_per_round": n,
                "deadline_s": 600,
                "eval": False,
                "checkpoint_dir": str(tmp / "ck"),
                "db": str(tmp / "nodes.sqlite"),
                "out_dir": str(tmp / "run"),
            },
        }
    ).validate()
    # events dropped: no disk writes in the timing; the root takes edge partials (its tier)
    svc = ServerService.from_config(cfg, emit=lambda e: None, tier=PartialIntake)
    return svc


def node_ids(n: int) -> list[str]:
    return [f"node-{i:04d}" for i in range(n)]


def open_round(svc: ServerService, nodes: list[str], now: float) -> list[dict]:
    for node in nodes:
        svc.seen(node, now)
    assert svc.tick(now)
    return [dict(svc.poll(node, now) or {}, node=node) for node in nodes]


def flat_round(svc: ServerService, nodes: list[str], delta: torch.Tensor, now: float) -> tuple[float, int]:
    works = open_round(svc, nodes, now)
    bodies = [
        bytearray(encode_update(Update(delta, 600, w["version"], w["node"]), svc.spec, {"round": w["round"]}))
        for w in works
    ]
    c0 = cpu_s()
    for w, body in zip(works, bodies):
        svc.submit(w["node"], memoryview(body), now)
    assert svc.tick(now + 1)
    return cpu_s() - c0, sum(map(len, bodies))


def edge_part(svc: ServerService, works: list[dict], delta: torch.Tensor, name: str, dtype: str) -> tuple[bytes, float]:
    """One edge's partial body, and the CPU the edge spent on it (its nodes' bodies decoded, summed, encoded)."""
    bodies = [
        bytearray(encode_update(Update(delta, 600, w["version"], w["node"]), svc.spec, {"round": w["round"]}))
        for w in works
    ]
    c0 = cpu_s()
    acc = Accumulator(works[0]["round"], works[0]["version"], svc.spec.numel)
    for w, body in zip(works, bodies):
        update, _ = decode_update(memoryview(body), svc.spec, len(body), copy=False)
        update.sender = w["node"]
        acc.add_update(update)
    out = encode_partial(acc.partial().sealed(name), svc.spec.hash, dtype)
    return out, cpu_s() - c0


def tree_round(
    svc: ServerService, nodes: list[str], edges: int, delta: torch.Tensor, now: float, dtype: str
) -> tuple[float, int, float]:
    intake = svc.tier
    assert isinstance(intake, PartialIntake), "the root is made with tier=PartialIntake"
    for e in range(edges):  # each edge names its nodes (POST /v1/edge/poll) before the round opens
        intake.poll(f"edge-{e}", {"nodes": nodes[e::edges]}, lambda n: True, now)
    works = open_round(svc, nodes, now)
    groups = [works[e::edges] for e in range(edges)]
    parts = [edge_part(svc, g, delta, f"edge-{e}", dtype) for e, g in enumerate(groups)]
    c0 = cpu_s()
    for e, (body, _) in enumerate(parts):
        intake.submit(f"edge-{e}", body, now)
    assert svc.tick(now + 1)
    return cpu_s() - c0, sum(len(b) for b, _ in parts), max(c for _, c in parts)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of ``values``."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def deployed(tmp: Path, n: int, edges: int, rounds: int, kill_after: int) -> dict:
    """One deployment of processes run to its end; its per-tier figures."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's process harness
    from tests.hierarchy.deploy import hierarchy

    rss: list[float] = []
    with hierarchy(tmp, n=n, edges=edges, rounds=rounds, deadline=6.0) as h:

        def sample() -> None:
            mb = h.rss_mb("root")
            if mb is not None:
                rss.append(mb)

        h.start_servers()
        h.start_nodes()  # the hierarchy's n nodes
        killed = None
        if edges and kill_after:
            killed = h.wait_status(lambda s: s["version"] >= kill_after, 300, sample)["version"]
            h.kill(h.edge_names[0])
        assert h.wait("root", 600, sample) == 0, h.dump()
        records = h.records()
        edge_lines = [line for e in h.edge_names for line in h.edge_records(e)]
        reattach = h.reattach_times()
    steps = [(b["version"], b["elapsed_s"] - a["elapsed_s"]) for a, b in zip(records, records[1:])]
    calm = [d for v, d in steps if killed is None or v != killed + 1]
    return {
        "versions": len(records),
        "p50": pct(calm, 0.5),
        "p95": pct(calm, 0.95),
        "kill_round": next((d for v, d in steps if killed is not None and v == killed + 1), None),
        "rss": max(rss),
        "results": [r["num_results"] for r in records],
        "edge_close_p50": pct([e["closed_after_s"] for e in edge_lines], 0.5) if edge_lines else None,
        "edge_sent_p50": pct([e["sent_after_s"] for e in edge_lines], 0.5) if edge_lines else None,
        "reattach": reattach,
    }


def processes(args: argparse.Namespace) -> None:
    print(
        f"processes on 127.0.0.1: {args.n} nodes, {args.rounds} rounds, logistic regression on synthetic data; "
        f"flat, then {args.edges} edges"
        + (f" (one SIGKILLed after version {args.kill_after})" if args.kill_after else "")
    )
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        flat = deployed(Path(tmp) / "flat", args.n, 0, args.rounds, 0)
        loads.append(os.getloadavg()[0])
        tree = deployed(Path(tmp) / "tree", args.n, args.edges, args.rounds, args.kill_after)
        loads.append(os.getloadavg()[0])
    print(f"load average (1 min): {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs")
    print(f"{'root':>22} {'round p50 s':>12} {'round p95 s':>12} {'root RSS MB':>12} {'results per version':>24}")
    for label, f in ((f"flat ({args.n} nodes)", flat), (f"{args.edges} edges", tree)):
        print(f"{label:>22} {f['p50']:>12.3f} {f['p95']:>12.3f} {f['rss']:>12.0f} {str(f['results']):>24}")
    if tree["kill_round"] is not None:
        print(f"the round the killed edge held: {tree['kill_round']:.3f} s (closed at the root's deadline)")
    if tree["edge_close_p50"] is not None:
        print(
            f"edges: part of a round closed {tree['edge_close_p50']:.3f} s (p50) after hearing of it, partial "
            f"answered {tree['edge_sent_p50']:.3f} s after"
        )
    if tree["reattach"]:
        r = tree["reattach"]
        print(
            f"re-attach (node's first failure to its first answer from the next edge): {len(r)} nodes, "
            f"p50 {pct(r, 0.5):.3f} s, max {max(r):.3f} s"
        )


def secure_round(args: argparse.Namespace, dim: int, seed: int, tiered: bool) -> dict:
    """One secure aggregation of ``args.n`` nodes' vectors of ``dim`` words, flat or through
    ``args.edges`` edges (aggregation/secagg: run_in_memory / run_through_edges), the same inputs.
    Root CPU: the protocol's server side (SecAggCost.server_s: taking the messages as objects,
    opening the sealed answers, unmasking; other messages' decoding is the same on both sides and
    left out) plus decoding the masked bodies it ingests (MaskedInput x n flat, MaskedSum x
    edges tiered; encoded before the clock starts). Ingress: every protocol byte the root reads."""
    from shoal.aggregation.secagg import MaskedInput, SecAggParams
    from shoal.aggregation.secagg.memory import run_in_memory
    from shoal.aggregation.secagg.tiers import EdgeMaskedSum, run_through_edges
    from shoal.aggregation.secagg.wire import decode_message, encode_message

    g = np.random.default_rng(seed)
    ids = node_ids(args.n)
    inputs = {c: g.integers(0, 2**20, dim, dtype=np.uint32) for c in ids}
    params = SecAggParams(session=f"bench/{seed}".encode(), vector_size=dim, graph=args.graph)
    edge_of = {c: f"edge-{i * args.edges // args.n}" for i, c in enumerate(ids)}
    if tiered:
        result, cost = run_through_edges(params, inputs, edge_of, seed=seed)
        sums = {e: EdgeMaskedSum(e, dim, [c for c in ids if edge_of[c] == e]) for e in sorted(set(edge_of.values()))}
        for c in ids:  # the edges' sums, the size of the bodies the root decodes
            sums[edge_of[c]].add(MaskedInput(c, inputs[c]))
        bodies = [encode_message(part) for s in sums.values() if (part := s.sealed()) is not None]
        ingress = cost.links["edge_root_up"]
    else:
        result, cost = run_in_memory(params, inputs, seed=seed)
        bodies = [encode_message(MaskedInput(c, inputs[c])) for c in ids]
        ingress = sum(cost.sent.values())
    assert result.included == ids
    t = time.process_time()
    for b in bodies:
        decode_message(b, dim)
    decode_s = time.process_time() - t
    return {"root_cpu": cost.server_s + decode_s, "ingress": ingress, "links": dict(getattr(cost, "links", {}))}


def secure(args: argparse.Namespace) -> None:
    dim = {"cnn": 1_663_370, "2nn": 199_210}[args.model] + 1  # the model and the weight entry
    print(
        f"secure aggregation, {args.graph} graph: {args.n} nodes, vectors of {dim:,} words ({args.model}); flat vs "
        f"{args.edges} edges that relay and add masked vectors; {args.rounds} rounds each, alternating, medians"
    )
    loads = [os.getloadavg()[0]]
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.rounds):
        for tiered in (False, True):
            runs[tiered].append(secure_round(args, dim, 100 + r, tiered))
        loads.append(os.getloadavg()[0])
    print(f"load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs")
    flat_in = statistics.median(x["ingress"] for x in runs[False])
    flat_cpu = statistics.median(x["root_cpu"] for x in runs[False])
    print(f"{'root':>30} {'ingress MB/round':>17} {'root CPU s/round':>17} {'ingress ratio':>14} {'CPU ratio':>10}")
    for tiered, label in ((False, f"flat ({args.n} nodes)"), (True, f"{args.edges} edges")):
        ing = statistics.median(x["ingress"] for x in runs[tiered])
        cpu = statistics.median(x["root_cpu"] for x in runs[tiered])
        print(f"{label:>30} {ing / 1e6:>17.2f} {cpu:>17.3f} {flat_in / ing:>13.1f}x {flat_cpu / cpu:>9.2f}x")
    links = runs[True][-1]["links"]
    print("bytes per link, tiered (MB/round): " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(links.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100, help="nodes in a round")
    ap.add_argument("--edges", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind (alternating); medians printed")
    ap.add_argument("--model", default="cnn", choices=["cnn", "2nn"])
    ap.add_argument("--processes", action="store_true", help="real processes on 127.0.0.1 (see above)")
    ap.add_argument("--kill-after", type=int, default=0, help="--processes: SIGKILL an edge after this version")
    ap.add_argument("--secure", action="store_true", help="secure aggregation: flat vs through edges (see above)")
    ap.add_argument("--graph", default="secagg+", choices=["full", "secagg+"], help="--secure: the mask graph")
    args = ap.parse_args()
    if args.secure:
        secure(args)
        return
    if args.processes:
        processes(args)
        return
    torch.manual_seed(0)
    nodes = node_ids(args.n)
    with tempfile.TemporaryDirectory() as tmp:
        flat_svc = service(Path(tmp) / "flat", args.n, args.model)
        trees = {d: service(Path(tmp) / d, args.n, args.model) for d in ("float32", "float64")}
        spec = flat_svc.spec
        delta = torch.randn(spec.numel) * 1e-3
        print(
            f"model: {args.model}, {spec.numel:,} parameters ({spec.nbytes / 1e6:.2f} MB float32); "
            f"{args.n} nodes per round, {args.edges} edges of {args.n // args.edges}; {args.rounds} rounds each"
        )
        loads = [os.getloadavg()[0]]
        flat_cpu, flat_in = [], 0
        tree: dict[str, tuple[list[float], int, list[float]]] = {d: ([], 0, []) for d in trees}
        now = time.monotonic()
        for r in range(args.rounds):  # alternate, so that the machine's other load falls on both alike
            c, flat_in = flat_round(flat_svc, nodes, delta, now + 10 * r)
            flat_cpu.append(c)
            for d, svc in trees.items():
                c, ingress, edge_cpu = tree_round(svc, nodes, args.edges, delta, now + 10 * r, d)
                tree[d][0].append(c)
                tree[d][2].append(edge_cpu)
                tree[d] = (tree[d][0], ingress, tree[d][2])
            loads.append(os.getloadavg()[0])
        for svc in trees.values():
            torch.testing.assert_close(svc.rounds.global_params, flat_svc.rounds.global_params, atol=1e-6, rtol=0)
        print(f"load average (1 min) during the runs: {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs")
        print("every tree's global model equals the flat root's to 1e-6 after the rounds")
        fc = statistics.median(flat_cpu)
        print(
            f"{'root':>28} {'ingress MB/round':>17} {'root CPU s/round':>17} {'ingress ratio':>14} "
            f"{'CPU ratio':>10} {'one edge CPU s':>15}"
        )
        print(
            f"{'flat (' + str(args.n) + ' nodes)':>28} {flat_in / 1e6:>17.2f} {fc:>17.3f} {'1.0x':>14} {'1.0x':>10} {'':>15}"
        )
        for d, (cpus, ingress, edge_cpus) in tree.items():
            tc = statistics.median(cpus)
            label = f"{args.edges} edges, {d} partials"
            print(
                f"{label:>28} {ingress / 1e6:>17.2f} {tc:>17.3f} {flat_in / ingress:>13.1f}x "
                f"{fc / max(tc, 1e-9):>9.1f}x {statistics.median(edge_cpus):>15.3f}"
            )


if __name__ == "__main__":
    main()
