"""Accuracy per round and per byte of the runs of examples/femnist_gossip_compare.sh.

    python examples/femnist_gossip_report.py runs/femnist_compare [docs/img/gossip_femnist_bytes.png]

Prints a markdown table (every evaluated round of every run: accuracy of the peers' own
models, worst peer, average model, consensus distance, MB sent per peer so far) and the
check of issue 18 against FedAvg, from the runs' metrics.jsonl and summary.json only.
FedAvg's bytes per client are its measured upload total over the clients (a client
receives as much: the global model).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = [
    ("fedavg", "FedAvg, C = 1"),
    ("pushpull5", "push-pull, 5 exchanges/round"),
    ("dpsgd10", "D-PSGD 4-regular, 10 mixing steps"),
    ("group_average_1axis", "group averaging, one grid axis per round"),
    ("group_average", "group averaging, every axis per round"),
    ("secure_groups", "secure groups of 4"),
]


def load(folder: Path) -> tuple[list[dict], dict]:
    recs = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((folder / "summary.json").read_text())
    return recs, summary


def mb_per_peer(rec: dict, summary: dict) -> float:
    if "bytes_sent_per_peer" in rec:
        return rec["bytes_sent_per_peer"] / 1e6
    return rec["bytes_up_total"] / summary["num_clients"] / 1e6


def main() -> None:
    root = Path(sys.argv[1])
    plot = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    data = {k: load(root / k) for k, _ in RUNS if (root / k / "summary.json").exists()}
    print("| run | round | mean peer acc | min peer | average model acc | consensus distance | MB sent per peer |")
    print("|---|---|---|---|---|---|---|")
    for key, label in RUNS:
        if key not in data:
            continue
        recs, summary = data[key]
        for r in recs:
            cells = [
                label,
                str(r["round"]),
                f"{r['test_accuracy']:.4f}",
                f"{r['peer_accuracy_min']:.3f}" if "peer_accuracy_min" in r else "-",
                f"{r['average_model_accuracy']:.4f}" if "average_model_accuracy" in r else "-",
                f"{r['consensus_distance']:.3f}" if "consensus_distance" in r else "-",
                f"{mb_per_peer(r, summary):.1f}",
            ]
            print("| " + " | ".join(cells) + " |")
    if "fedavg" in data:
        frecs, fsum = data["fedavg"]
        target_round = frecs[-1]["round"]
        target, fbytes = frecs[-1]["test_accuracy"], mb_per_peer(frecs[-1], fsum)
        print(f"\nFedAvg: {target:.4f} at round {target_round}, {fbytes:.1f} MB sent per client")
        for key, label in RUNS[1:]:
            if key not in data:
                continue
            recs, summary = data[key]
            hit = next((r for r in recs if r["test_accuracy"] >= target - 0.01), None)
            if hit is None:
                best = max(recs, key=lambda r: r["test_accuracy"])
                print(f"{label}: never within 1 point (best {best['test_accuracy']:.4f} at round {best['round']})")
                continue
            mb = mb_per_peer(hit, summary)
            print(
                f"{label}: {hit['test_accuracy']:.4f} at round {hit['round']} "
                f"({hit['round'] / target_round:.2f}x FedAvg's rounds), {mb:.1f} MB sent per peer "
                f"({mb / fbytes:.2f}x FedAvg's)"
            )
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
        for key, label in RUNS:
            if key not in data:
                continue
            recs, summary = data[key]
            a.plot([r["round"] for r in recs], [r["test_accuracy"] for r in recs], marker="o", label=label)
            b.plot([mb_per_peer(r, summary) for r in recs], [r["test_accuracy"] for r in recs], marker="o", label=label)
        a.set(xlabel="round", ylabel="mean peer test accuracy (FedAvg: global model)")
        b.set(xlabel="MB sent per peer", ylabel="mean peer test accuracy", xscale="log")
        a.legend(fontsize=7)
        fig.suptitle("FEMNIST, 105 peers, logreg, same local work per round")
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"\nwrote {plot}")


if __name__ == "__main__":
    main()
