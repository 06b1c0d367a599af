"""Overhead of the simulator over a bare torch loop doing the same local training.

One round of 100 clients (2NN, 600 samples each, E=1, B=10 by default) through
InProcessSimulation (sampling, seeds, flat-buffer trainer, streaming FedAvg) against a
plain loop: load_state_dict, torch.optim.SGD, the same permutations, a running
weighted sum of the deltas. The two alternate, repeated; the ratio of medians is
printed. Target: ratio <= 1.10.

    .venv/bin/python bench/sim_overhead.py [--model 2nn] [--clients 100] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from shoal.config import load_config
from shoal.datasets import ArrayDataset, FederatedData
from shoal.models import build_model
from shoal.simulations.inprocess import InProcessSimulation


def make_data(clients: int, per_client: int, seed: int = 0) -> FederatedData:
    g = torch.Generator().manual_seed(seed)
    n = clients * per_client
    train = ArrayDataset(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))
    test = ArrayDataset(torch.rand(1000, 1, 28, 28, generator=g), torch.randint(0, 10, (1000,), generator=g))
    idx = [np.arange(i * per_client, (i + 1) * per_client) for i in range(clients)]
    return FederatedData("bench", train, test, idx, (1, 28, 28), 10)


def bare_round(model, global_sd, data: FederatedData, tasks, epochs: int, bs: int, lr: float):
    """What a user would write by hand: the same training, no framework."""
    total = None
    weight = 0
    for task in tasks:
        i = int(task.client_id.split("-")[1])
        x, y = data.train.x[data.client_indices[i]], data.train.y[data.client_indices[i]]
        model.load_state_dict(global_sd)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(task.seed % (1 << 63))
        n = len(y)
        for _ in range(epochs):
            perm = torch.randperm(n, generator=gen)
            for s in range(0, n, bs):
                idx = perm[s : s + bs]
                opt.zero_grad()
                F.cross_entropy(model(x[idx]), y[idx]).backward()
                opt.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                d = (v - global_sd[k]) * n
                if total is None:
                    total = {kk: torch.zeros_like(vv) for kk, vv in global_sd.items()}
                total[k] += d
        weight += n
    return {k: global_sd[k] + v / weight for k, v in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="2nn")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    data = make_data(args.clients, args.samples)
    cfg = load_config(None, [
        f"simulation.num_clients={args.clients}", f"simulation.clients_per_round={args.clients}",
        f"model.name={args.model!r}".replace("'", '"'), f"train.epochs={args.epochs}",
        f"train.batch_size={args.batch}", "train.lr=0.05", "simulation.device=\"cpu\"",
    ])
    sim = InProcessSimulation(cfg, data)
    model = build_model(args.model, (1, 28, 28), 10)
    sim_t, bare_t = [], []
    for r in range(args.repeats + 1):  # the first pair warms up
        g_sd = {k: v.clone() for k, v in sim.spec.views(sim.global_params.clone()).items()}
        t0 = time.perf_counter()
        sim.run_round()
        t1 = time.perf_counter()
        tasks = list(sim.rounds.selected.values())
        t2 = time.perf_counter()
        bare_round(model, g_sd, data, tasks, args.epochs, args.batch, 0.05)
        t3 = time.perf_counter()
        if r:
            sim_t.append(t1 - t0)
            bare_t.append(t3 - t2)
    s, b = statistics.median(sim_t), statistics.median(bare_t)
    print(f"model {args.model}, {args.clients} clients x {args.samples} samples, E={args.epochs}, B={args.batch}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"shoal round (median of {args.repeats}): {s:.3f} s")
    print(f"bare torch loop (median of {args.repeats}): {b:.3f} s")
    print(f"ratio shoal / bare = {s / b:.3f}  (target <= 1.10)")


if __name__ == "__main__":
    main()
