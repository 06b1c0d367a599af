"""Rounds to a target accuracy, flat FedAvg vs edge aggregators, from the runs' metrics.jsonl.

    python examples/hierarchy_report.py --target 0.89 0.90 -- runs/flat runs/edges

For each run: the first root round whose test accuracy reaches each target, the first round whose
5-round moving mean reaches it (the curves of non-IID data are noisy), the mean of the last 10
evaluated rounds, and the root's ingress per round (``hier_bytes_edge_root_up``, or a flat run's
``bytes_up``). The first run is the reference the speed-up is counted against.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def records(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("test_accuracy") is not None]


def first(rows: list[dict], target: float, window: int = 1) -> int | None:
    accs = [r["test_accuracy"] for r in rows]
    for i in range(window - 1, len(accs)):
        if sum(accs[i - window + 1 : i + 1]) / window >= target:
            return int(rows[i]["round"])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, nargs="+", default=[0.9])
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    table = []
    for run in args.runs:
        rows = records(run)
        summary = json.loads((run / "summary.json").read_text())
        kappa = summary.get("hierarchy_edge_rounds", 0)
        last = [r["test_accuracy"] for r in rows[-10:]]
        ingress = [r.get("hier_bytes_edge_root_up", r.get("bytes_up", 0)) for r in rows]
        table.append(
            {
                "run": run.name,
                "edges": summary.get("hierarchy_edges", 0),
                "kappa": kappa,
                "rounds": len(rows),
                "reach": {t: (first(rows, t), first(rows, t, 5)) for t in args.target},
                "last10": sum(last) / len(last),
                "best": max(r["test_accuracy"] for r in rows),
                "ingress_mb": sum(ingress) / len(ingress) / 1e6,
            }
        )
    ref = table[0]
    for t in args.target:
        print(f"target {t}: first root round reaching it (5-round moving mean), speed-up vs {ref['run']}")
        for row in table:
            one, five = row["reach"][t]
            r1, r5 = ref["reach"][t]
            ratio = f"{r1 / one:.1f}x / {r5 / five:.1f}x" if one and five and r1 and r5 else "-"
            print(f"  {row['run']:>12}: {one} ({five})  {ratio}")
    head = f"{'run':>12} {'edges':>5} {'kappa_2':>7} {'rounds':>6} {'last-10 mean':>12} {'best':>6}"
    print(f"{head} {'root MB/round':>13}")
    for row in table:
        print(
            f"{row['run']:>12} {row['edges']:>5} {row['kappa']:>7} {row['rounds']:>6} {row['last10']:>12.4f} "
            f"{row['best']:>6.4f} {row['ingress_mb']:>13.2f}"
        )


if __name__ == "__main__":
    main()
