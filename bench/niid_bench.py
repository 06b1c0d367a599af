"""NIID-Bench's MNIST rows (Li et al. 2022, Table 3): FedAvg, FedProx, SCAFFOLD and FedNova on its CNN
with the label-skew splits Dirichlet(0.5) and two labels per client, the best test accuracy over
the rounds beside the published one.

    .venv/bin/python bench/niid_bench.py --data PATH_TO_MNIST [--device cuda] [--parallel 8]

The benchmark's settings are the defaults: 10 clients, all in every round, 50 rounds, E = 10,
B = 64, SGD lr 0.01 with momentum 0.9, FedProx mu 0.01. Each configuration is one
`shoal simulate` process (examples/tasks/niid_bench.py) writing runs/niid/<split>-<algorithm>/;
``--parallel`` of them run at once (on a GPU they share it: the model is small). Each run is
about 30M example passes; every algorithm here runs on the batched many-clients trainer.
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


def command(a: argparse.Namespace, split: str, algorithm: str, out: Path) -> list[str]:
    sets = {
        "task.args.data_dir": json.dumps(a.data),
        "task.args.split": json.dumps(split),
        "simulation.num_clients": "10",
        "simulation.clients_per_round": "10",
        "simulation.rounds": str(a.rounds),
        "simulation.seed": str(a.seed),
        "simulation.device": json.dumps(a.device),
        "simulation.progress": "false",
        "train.epochs": str(a.epochs),
        "train.batch_size": "64",
        "train.lr": "0.01",
        "train.momentum": "0.9",
        "train.weight_decay": str(a.weight_decay),
        "output.plots": "false",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="folder with MNIST's idx files")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--mu", type=float, default=0.01, help="FedProx's mu")
    ap.add_argument(
        "--weight-decay", type=float, default=0.0, help="SGD weight decay (NIID-Bench's code defaults to 1e-5)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--splits", default="dirichlet,labels")
    ap.add_argument("--algorithms", default="fedavg,fedprox,scaffold,fednova")
    ap.add_argument("--parallel", type=int, default=1, help="configurations run at once")
    ap.add_argument("--out", default="runs/niid")
    a = ap.parse_args()
    a.data = str(Path(a.data).resolve())
    jobs = [(s, al) for s in a.splits.split(",") for al in a.algorithms.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    running: list[tuple[subprocess.Popen, str, str, float]] = []
    wall: dict[tuple[str, str], float] = {}
    status: dict[tuple[str, str], int] = {}
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < a.parallel:
            split, algorithm = pending.pop(0)
            out = Path(a.out) / f"{split}-{algorithm}"
            out.mkdir(parents=True, exist_ok=True)
            log = (out / "run.log").open("w")
            p = subprocess.Popen(command(a, split, algorithm, out), stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((p, split, algorithm, time.perf_counter()))
        time.sleep(1.0)
        for item in list(running):
            p, split, algorithm, t0 = item
            if p.poll() is not None:
                running.remove(item)
                wall[(split, algorithm)] = time.perf_counter() - t0
                status[(split, algorithm)] = p.returncode
                print(f"{split} {algorithm}: exit {p.returncode} after {wall[(split, algorithm)]:.0f} s", flush=True)
    print(
        f"\nNIID-Bench MNIST, 10 clients, {a.rounds} rounds, E = {a.epochs}, weight decay {a.weight_decay},"
        f" on {a.device} (seed {a.seed})"
    )
    print("| split | algorithm | best test accuracy % | published (50 rounds) | difference | rounds | wall s |")
    print("|---|---|---|---|---|---|---|")
    for split, algorithm in jobs:
        acc, n = best(Path(a.out) / f"{split}-{algorithm}")
        pub = PUBLISHED[(split, algorithm)]
        shown = f"failed (exit {status[(split, algorithm)]})" if acc is None else f"{acc:.2f}"
        diff = "" if acc is None else f"{acc - pub:+.2f}"
        print(f"| {split} | {algorithm} | {shown} | {pub:.2f} | {diff} | {n} | {wall[(split, algorithm)]:.0f} |")


if __name__ == "__main__":
    main()
