"""Rounds of SCAFFOLD, FedNova and FedDyn (and FedAvg beside them) one client at a time against the
batched many-clients trainer, side by side in one run: wall seconds per round and the ratio, plus
the largest difference between the two runs' models (they must agree: the batched trainer adds
each algorithm's terms as the one-by-one trainer does).

    OMP_NUM_THREADS=2 .venv/bin/python bench/algorithms_batched.py --data PATH_TO_MNIST \
        [--clients 10] [--rounds 2] [--epochs 1] [--device cpu]

NIID-Bench's MNIST setting (examples/tasks/niid_bench.py: its CNN, 10 clients all in every round,
B = 64, SGD lr 0.01, momentum 0.9, Dirichlet(0.5)), with fewer epochs and rounds by default so
that it fits a shared CPU; on a GPU pass --device cuda --epochs 10.
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.config import load_config
from shoal.simulations.inprocess import InProcessSimulation


def timed(cfg_args: list[str], rounds: int) -> tuple[float, torch.Tensor, bool]:
    sim = InProcessSimulation.from_config(load_config(None, cfg_args))
    sim.run_round()  # warm-up round (not timed): first-call costs of both paths
    t0 = time.perf_counter()
    for _ in range(rounds):
        sim.run_round()
    if sim.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / rounds, sim.global_params.detach().cpu(), sim.batched is not None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder with MNIST's idx files")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (after one warm-up round)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--algorithms", default="fedavg,scaffold,fednova,feddyn")
    a = ap.parse_args()
    base = [
        "task.app='examples/tasks/niid_bench.py:NiidBench'",
        f"task.args.data_dir='{a.data}'",
        f"simulation.num_clients={a.clients}",
        f"simulation.clients_per_round={a.clients}",
        f"simulation.device='{a.device}'",
        "simulation.progress=false",
        "simulation.eval_every=1000",
        f"train.epochs={a.epochs}",
        "train.batch_size=64",
        "train.lr=0.01",
        "train.momentum=0.9",
        "output.plots=false",
    ]
    print(f"NIID-Bench CNN, {a.clients} clients a round, E = {a.epochs}, B = 64, on {a.device}")
    print("| algorithm | one by one, s/round | batched, s/round | speed-up | max |model difference| |")
    print("|---|---|---|---|---|")
    for name in a.algorithms.split(","):
        args = [*base, f"algorithm.name='{name}'"]
        one, m1, b1 = timed([*args, "simulation.batch_clients=1"], a.rounds)
        many, m2, b2 = timed([*args, f"simulation.batch_clients={a.clients}"], a.rounds)
        assert not b1 and b2, "the batched run did not batch"
        gap = float((m1 - m2).abs().max())
        print(f"| {name} | {one:.2f} | {many:.2f} | {one / many:.2f}x | {gap:.1e} |", flush=True)


if __name__ == "__main__":
    main()
