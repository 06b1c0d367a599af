"""Tables and plots for docs/results.md from the runs of examples/robust_and_compression.sh.

.venv/bin/python examples/robust_and_compression_report.py runs/issue10 docs/img
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shoal.metrics import read_jsonl
from shoal.simulations.report import plot_compare


def load(runs: Path, name: str) -> tuple[dict, list[dict]] | None:
    d = runs / name
    if not (d / "summary.json").is_file():
        return None
    return json.loads((d / "summary.json").read_text()), read_jsonl(d / "metrics.jsonl")


def robust_table(runs: Path) -> None:
    rules = ["mean", "median", "trimmed_mean", "krum", "multikrum"]
    print("| rule | clean (final / lowest) | sign flip x10 (final / lowest) | scale x100 (final / lowest) |")
    print("|---|---|---|---|")
    for rule in rules:
        cells = []
        for prefix in ("clean", "signflip10", "scale100"):
            got = load(runs, f"{prefix}_{rule}")
            if got is None:
                cells.append("-")
                continue
            s, recs = got
            accs = [r["test_accuracy"] for r in recs]
            cells.append(f"{s['final_test_accuracy']:.4f} / {min(accs):.4f}")
        print(f"| {rule} | " + " | ".join(cells) + " |")


def other_attacks_table(runs: Path) -> None:
    print("| run | final acc | lowest acc | rejected (last round) |")
    print("|---|---|---|---|")
    for name in (
        "signflip1_mean",
        "labelflip_mean",
        "labelflip_median",
        "gaussian_mean",
        "gaussian_median",
        "signflip10_mean_normbound1",
        "scale100_mean_normbound1",
        "nan_mean",
    ):
        got = load(runs, name)
        if got is None:
            continue
        s, recs = got
        accs = [r["test_accuracy"] for r in recs]
        print(f"| {name} | {s['final_test_accuracy']:.4f} | {min(accs):.4f} | {recs[-1].get('rejected') or '-'} |")


def compression_table(runs: Path) -> None:
    dense = load(runs, "c_dense")
    print("| encoding | final acc | best acc | bytes up (total) | of dense | bytes down (total) |")
    print("|---|---|---|---|---|---|")
    for name in ("c_dense", "c_q8", "c_topk04", "c_topk04_zstd"):
        got = load(runs, name)
        if got is None:
            continue
        s, _ = got
        frac = s["bytes_up_total"] / dense[0]["bytes_up_total"] if dense else float("nan")
        print(
            f"| {name[2:]} | {s['final_test_accuracy']:.4f} | {s['best_test_accuracy']:.4f} | "
            f"{s['bytes_up_total']:,} | {frac:.2%} | {s['bytes_down_total']:,} |"
        )


def plots(runs: Path, img: Path) -> None:
    img.mkdir(parents=True, exist_ok=True)
    series = {}
    for name, label in [
        ("clean_mean", "clean, FedAvg"),
        ("signflip10_mean", "attacked, FedAvg"),
        ("signflip10_median", "attacked, median"),
        ("signflip10_trimmed_mean", "attacked, trimmed mean"),
        ("signflip10_multikrum", "attacked, Multi-Krum"),
    ]:
        got = load(runs, name)
        if got:
            series[label] = [(r["round"], r["test_accuracy"]) for r in got[1]]
    plot_compare(
        series,
        img / "robust_signflip_mnist_logreg.png",
        "round",
        "test accuracy",
        "MNIST logreg, 20% sign-flip x10 attackers",
    )
    series = {}
    for name in ("c_dense", "c_q8", "c_topk04", "c_topk04_zstd"):
        got = load(runs, name)
        if got:
            series[name[2:]] = [(r["bytes_up_total"] / 1e6, r["test_accuracy"]) for r in got[1]]
    plot_compare(
        series,
        img / "compression_mnist_2nn.png",
        "MB uploaded (all clients)",
        "test accuracy",
        "MNIST 2NN, 20 clients: accuracy against upload bytes",
    )


if __name__ == "__main__":
    runs, img = Path(sys.argv[1]), Path(sys.argv[2])
    robust_table(runs)
    print()
    other_attacks_table(runs)
    print()
    compression_table(runs)
    plots(runs, img)
