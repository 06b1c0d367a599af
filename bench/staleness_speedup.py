"""Test accuracy against virtual time for sync FedAvg, FedAsync and FedBuff; the
virtual time each needs to reach a target accuracy, and the speed-up over sync.

Reads the metrics.jsonl of runs made with examples/mnist_fedbuff.toml (docs/results.md
lists the commands), prints a Markdown table and writes a plot:

    python bench/staleness_speedup.py --target 0.90 sync=runs/sync fedbuff=runs/fedbuff \
        fedasync=runs/fedasync --plot docs/img/staleness_accuracy_vs_virtual_time.png

Time-to-target is the first evaluation at or above the target, so it is resolved to
the evaluation interval (``heterogeneity.eval_interval_s``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.metrics import read_jsonl
from shoal.simulations.report import plot_compare

LABELS = {
    "sync": "sync FedAvg",
    "sync_over": "sync FedAvg, 30% over-selection",
    "fedbuff": "FedBuff",
    "fedasync": "FedAsync",
}


def time_to(records: list[dict], target: float) -> float | None:
    for r in records:
        if r["test_accuracy"] >= target:
            return r["virtual_time_s"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="name=RUN_DIR; the first is the baseline of the speed-ups")
    ap.add_argument("--target", type=float, action="append", required=True)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    runs = dict(r.split("=", 1) for r in args.runs)
    recs = {name: read_jsonl(Path(d) / "metrics.jsonl") for name, d in runs.items()}
    base = next(iter(recs))
    head = "| run | final acc | best acc | virtual time (s) | accepted | rejected | staleness mean / max |"
    for t in args.target:
        head += f" time to {t:.0%} (s) | speed-up vs {LABELS.get(base, base)} |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for name, rs in recs.items():
        last = rs[-1]
        n = sum(r.get("num_results") or 0 for r in rs)
        stale = [(int(t), k) for r in rs for t, k in (r.get("staleness_hist") or {}).items()]
        tot = sum(k for _, k in stale)
        smean = f"{sum(t * k for t, k in stale) / tot:.2f} / {max(t for t, _ in stale)}" if tot else "0 / 0 (sync)"
        row = (
            f"| {LABELS.get(name, name)} | {last['test_accuracy']:.4f} | {max(r['test_accuracy'] for r in rs):.4f} "
            f"| {last['virtual_time_s']:.0f} | {last.get('accepted', n)} | {sum((last.get('rejected') or {}).values())} "
            f"| {smean} |"
        )
        for t in args.target:
            tt, tb = time_to(rs, t), time_to(recs[base], t)
            speed = f"{tb / tt:.2f}x" if tt and tb else "n/a"
            row += f" {tt if tt is not None else 'not reached'} | {speed} |"
        print(row)
    if args.plot:
        series = {
            LABELS.get(n, n): [(r["virtual_time_s"] / 3600, r["test_accuracy"]) for r in rs] for n, rs in recs.items()
        }
        plot_compare(
            series,
            args.plot,
            "virtual time (hours)",
            "test accuracy",
            "MNIST Dirichlet 0.3, 2NN, lognormal speeds (sigma 1.25)",
        )
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
