"""NIID-Bench's MNIST rows (Li et al. 2022, Table 3): FedAvg, FedProx, SCAFFOLD and FedNova on its CNN
with the label-skew splits Dirichlet(0.5) and two labels per client, the best test accuracy over
the rounds beside the published one.

    .venv/bin/python bench/niid_bench.py --data PATH_TO_MNIST [--device cuda] [--parallel 8] [--seeds 0,1,2]
    .venv/bin/python bench/niid_bench.py --seeds 0,1,2 --table-only

The benchmark's settings are the defaults: 10 clients, all in every round, 50 rounds, E = 10,
B = 64, SGD lr 0.01 with momentum 0.9, FedProx mu 0.01. Each configuration and seed is one
`shoal simulate` process (examples/tasks/niid_bench.py) writing
runs/niid/seed<seed>/<split>-<algorithm>/; ``--parallel`` of them run at once (on a GPU they
share it: the model is small). A seed redraws the split, the initial model and the batch order.
Each run is about 30M example passes; every algorithm here runs on the batched many-clients
trainer. ``--table-only`` runs nothing and prints the table of the runs already in ``--out``
(seeds run at different times, on different machines, put together), each row's mean over the
seeds set beside the published figure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Li et al. 2022, Table 3, MNIST: best test accuracy (%) over 50 rounds.
PUBLISHED = {
    ("dirichlet", "fedavg"): 98.89,
    ("dirichlet", "fedprox"): 99.02,
    ("dirichlet", "scaffold"): 99.07,
    ("dirichlet", "fednova"): 98.03,
    ("labels", "fedavg"): 96.86,
    ("labels", "fedprox"): 96.85,
    ("labels", "scaffold"): 96.92,
    ("labels", "fednova"): 96.65,
}


def command(a: argparse.Namespace, seed: int, split: str, algorithm: str, out: Path) -> list[str]:
    sets = {
        "task.args.data_dir": json.dumps(a.data),
        "task.args.split": json.dumps(split),
        "simulation.num_clients": "10",
        "simulation.clients_per_round": "10",
        "simulation.rounds": str(a.rounds),
        "simulation.seed": str(seed),
        "simulation.device": json.dumps(a.device),
        "simulation.progress": "false",
        "train.epochs": str(a.epochs),
        "train.batch_size": "64",
        "train.lr": "0.01",
        "train.momentum": "0.9",
        "train.weight_decay": str(a.weight_decay),
        "output.plots": "false",
        "simulation.cuda_graphs": "true" if a.cuda_graphs == "on" else "false",
        "algorithm.name": json.dumps("fedavg" if algorithm == "fedprox" else algorithm),
    }
    if algorithm == "fedprox":
        sets["train.prox_mu"] = str(a.mu)
    args = [sys.executable, "-m", "shoal.cli", "simulate", "--task", "examples/tasks/niid_bench.py:NiidBench"]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    return [*args, "--out", str(out)]


def best(out: Path) -> tuple[float | None, int]:
    """The best test accuracy (%) in a run's metrics.jsonl and how many rounds it recorded."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return None, 0
    acc = [json.loads(x).get("test_accuracy") for x in path.read_text().splitlines() if x.strip()]
    acc = [a for a in acc if a is not None]
    return (100 * max(acc) if acc else None), len(acc)


def seconds_per_round(out: Path) -> float | None:
    """The median seconds between a run's consecutive rounds after its first (which pays for loading,
    cuDNN's autotuning and the first graph captures), from metrics.jsonl's ``elapsed_s``."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return None
    elapsed = [json.loads(x).get("elapsed_s") for x in path.read_text().splitlines() if x.strip()]
    gaps = sorted(b - a for a, b in zip(elapsed[1:], elapsed[2:]) if a is not None and b is not None)
    return gaps[len(gaps) // 2] if gaps else None


def run_all(a: argparse.Namespace, jobs: list[tuple[int, str, str]]) -> dict[tuple[int, str, str], str]:
    """Run every (seed, split, algorithm), ``a.parallel`` at once; how each ended, for the table."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    running: list[tuple[subprocess.Popen, tuple[int, str, str], float]] = []
    ended: dict[tuple[int, str, str], str] = {}
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < a.parallel:
            job = pending.pop(0)
            out = folder(a, *job)
            out.mkdir(parents=True, exist_ok=True)
            with (out / "run.log").open("w") as log:
                p = subprocess.Popen(command(a, *job, out), stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((p, job, time.perf_counter()))
        time.sleep(1.0)
        for item in list(running):
            p, job, t0 = item
            if p.poll() is not None:
                running.remove(item)
                ended[job] = f"exit {p.returncode} after {time.perf_counter() - t0:.0f} s"
                print(f"seed {job[0]} {job[1]} {job[2]}: {ended[job]}", flush=True)
    return ended


def folder(a: argparse.Namespace, seed: int, split: str, algorithm: str) -> Path:
    return Path(a.out) / f"seed{seed}" / f"{split}-{algorithm}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="folder with MNIST's idx files (not needed with --table-only)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--mu", type=float, default=0.01, help="FedProx's mu")
    ap.add_argument(
        "--weight-decay", type=float, default=0.0, help="SGD weight decay (NIID-Bench's code defaults to 1e-5)"
    )
    ap.add_argument("--seeds", default="0", help="simulation seeds, comma-separated (one run of each row per seed)")
    ap.add_argument("--splits", default="dirichlet,labels")
    ap.add_argument("--algorithms", default="fedavg,fedprox,scaffold,fednova")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once")
    ap.add_argument("--out", default="runs/niid")
    ap.add_argument("--table-only", action="store_true", help="run nothing: the table of the runs in --out")
    ap.add_argument(
        "--cuda-graphs", default="on", choices=("on", "off"), help="simulation.cuda_graphs (on a GPU; on by default)"
    )
    ap.add_argument(
        "--round-time",
        action="store_true",
        help="also print each run's median seconds per round after the first (a RESULT line each, for the GPU suite)",
    )
    a = ap.parse_args()
    if not a.table_only:
        if not a.data:
            ap.error("--data is needed to run the benchmark")
        a.data = str(Path(a.data).resolve())
    seeds = [int(s) for s in a.seeds.split(",")]
    rows = [(s, al) for s in a.splits.split(",") for al in a.algorithms.split(",")]
    ended = {} if a.table_only else run_all(a, [(seed, s, al) for seed in seeds for s, al in rows])
    print(
        f"\nNIID-Bench MNIST, 10 clients, {a.rounds} rounds, E = {a.epochs}, weight decay {a.weight_decay},"
        f"{'' if a.table_only else f' on {a.device},'} seeds {a.seeds}: best test accuracy % (rounds recorded) per seed"
    )
    print("| split | algorithm | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | published | difference |")
    print("|---|---|" + "---|" * (len(seeds) + 3))
    for split, algorithm in rows:
        cells, got = [], []
        for seed in seeds:
            acc, n = best(folder(a, seed, split, algorithm))
            if acc is None:
                cells.append(ended.get((seed, split, algorithm), "no run"))
            else:
                cells.append(f"{acc:.2f} ({n})")
                got.append(acc)
        pub = PUBLISHED[(split, algorithm)]
        mean = f"{sum(got) / len(got):.2f}" if got else ""
        diff = f"{sum(got) / len(got) - pub:+.2f}" if got else ""
        print(f"| {split} | {algorithm} | {' | '.join(cells)} | {mean} | {pub:.2f} | {diff} |")
    if a.round_time:
        for seed in seeds:
            for split, algorithm in rows:
                sec = seconds_per_round(folder(a, seed, split, algorithm))
                print(f"seed {seed} {split} {algorithm}: {sec if sec is None else round(sec, 3)} s per round")
                fields = {"bench": "niid_round", "split": split, "algorithm": algorithm, "seed": seed}
                fields |= {"cuda_graphs": a.cuda_graphs == "on", "s_per_round": sec}
                print("RESULT " + json.dumps(fields), flush=True)


if __name__ == "__main__":
    main()
