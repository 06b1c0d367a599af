"""Secure aggregation cost: server and client seconds and bytes per client, measured
side by side for the complete graph (Bonawitz et al. 2017) and the SecAgg+ graph
(Bell et al. 2020), next to Bonawitz et al.'s Fig. 8 numbers.

    .venv/bin/python bench/secagg.py                       # n = 100, 500; 0/10/30% dropout
    .venv/bin/python bench/secagg.py --clients 100 --entries 10000

Dropped clients leave after sharing their keys and before sending their masked input
(the server's worst case, as in Bonawitz's Fig. 8: it must rebuild their mask keys and
regenerate every pairwise mask they had with the survivors). The SecAgg+ degree k is
sized for the dropout rate (secagg.graph.auto_degree; at 30% it needs far more than
3 log2 n neighbours to keep a majority threshold alive). Seconds are CPU seconds of
each party's protocol work (process time: the machine may be shared): key agreement,
sharing, encryption, masking, unmasking for a client, everything but encoding.
Client seconds and bytes are means over the clients that completed the round; bytes
are protocol payload (keys, ciphertexts, the masked vector, shares), without framing.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from shoal.aggregation.secagg import SecAggAborted, SecAggParams, SecAggServer
from shoal.aggregation.secagg.memory import run_in_memory

# Bonawitz et al. 2017, Fig. 8 / Table 2: 100K entries, 500 clients (Java, one core)
PAPER = {
    ("server", 0.0): 2.0,
    ("server", 0.1): 62.0,
    ("client", None): 0.85,
}


def one(n: int, entries: int, dropout: float, graph: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    ids = [f"c{i:04d}" for i in range(n)]
    inputs = {c: rng.integers(0, 2**20, entries, dtype=np.uint32) for c in ids}
    dropped = rng.choice(n, size=round(dropout * n), replace=False)
    drop_at = {ids[i]: "masked" for i in dropped}
    params = SecAggParams(
        f"bench-{n}-{dropout}-{graph}".encode(), entries, graph, graph_seed=seed, expected_dropout=dropout
    )
    t = time.perf_counter()
    result, cost = run_in_memory(params, inputs, drop_at, seed=seed)
    wall = time.perf_counter() - t
    exact = (sum(inputs[c].astype(np.uint64) for c in result.included) % 2**32).astype(np.uint32)
    if not np.array_equal(result.total, exact):
        raise SystemExit(f"wrong sum: n={n} dropout={dropout} graph={graph}")
    server = SecAggServer(params, ids)
    return {
        "n": n,
        "dropout": dropout,
        "graph": graph,
        "degree": server.degree,
        "threshold": server.threshold,
        "wall_s": wall,
        "server_s": cost.server_s,
        "client_s": float(np.mean([cost.client_s[c] for c in result.included])),
        "sent_kb": float(np.mean([cost.sent[c] for c in result.included])) / 1e3,
        "recv_kb": float(np.mean([cost.received[c] for c in result.included])) / 1e3,
        "included": len(result.included),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 500])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1, 0.3])
    ap.add_argument("--graphs", nargs="+", default=["full", "secagg+"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"# secure aggregation, {args.entries} entries, {platform.processor() or platform.machine()}")
    head = f"{'n':>5} {'graph':>8} {'k':>4} {'t':>4} {'drop':>5} {'server s':>9} {'client s':>9} {'sent KB':>9} {'recv KB':>9} {'paper server s':>15}"
    print(head)
    rows = []
    for n in args.clients:
        for d in args.dropout:
            for g in args.graphs:
                try:
                    r = one(n, args.entries, d, g, args.seed)
                except SecAggAborted as e:
                    print(f"{n:>5} {g:>8} {d:>5.0%} aborted: {e}", flush=True)
                    continue
                rows.append(r)
                paper = PAPER.get(("server", d)) if n == 500 and g == "full" and args.entries == 100_000 else None
                print(
                    f"{n:>5} {g:>8} {r['degree']:>4} {r['threshold']:>4} {d:>5.0%} {r['server_s']:>9.3f} {r['client_s']:>9.3f} "
                    f"{r['sent_kb']:>9.1f} {r['recv_kb']:>9.1f} {paper if paper is not None else '':>15}",
                    flush=True,
                )
    print(
        f"# paper (Bonawitz et al. 2017, Fig. 8, 500 clients, 100K entries): server 2.0 s at 0% "
        f"dropout, 62 s at 10%; client {PAPER[('client', None)]} s"
    )
    for n in args.clients:
        for d in args.dropout:
            by = {r["graph"]: r for r in rows if r["n"] == n and r["dropout"] == d}
            if "full" in by and "secagg+" in by and by["secagg+"]["server_s"] > 0:
                print(
                    f"# n={n} dropout={d:.0%}: SecAgg+ server {by['full']['server_s'] / by['secagg+']['server_s']:.1f}x "
                    f"faster, client {by['full']['client_s'] / by['secagg+']['client_s']:.1f}x faster than the full graph"
                )


if __name__ == "__main__":
    main()
