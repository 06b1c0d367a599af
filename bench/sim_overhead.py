"""Overhead of the simulator over a bare torch loop doing the same local training.

One round of 100 clients (2NN, 600 samples each, E=1, B=10 by default) through
InProcessSimulation (sampling, seeds, flat-buffer trainer, streaming FedAvg) against a
plain loop: load_state_dict, torch.optim.SGD, the same permutations, a running
weighted sum of the deltas. Two cases, each against its own bare loop:

- ``tensors``: the task's clients are (x, y) tensors (shoal's in-memory fast path; the
  bare loop slices the same tensors with the same permutations);
- ``dataset``: the task's clients are a torch Dataset (items ``(x[i], y[i])``, not a
  TensorDataset), so shoal trains them through ``LocalTrainer.train_dataset``; the bare
  loop reads the same Dataset through a DataLoader with the same batches.

Within a case the two alternate, repeated; the ratio of medians is printed per case,
side by side. Target: ratio <= 1.10. ``--threads`` sets torch's threads (default 1,
with OMP_NUM_THREADS=1 as well, so that other load on the machine moves both sides alike).

    OMP_NUM_THREADS=1 .venv/bin/python bench/sim_overhead.py [--model 2nn] [--clients 100] [--repeats 5]
        [--case both|tensors|dataset] [--profile dataset]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler

from shoal.config import load_config
from shoal.models import build_model
from shoal.simulations.inprocess import InProcessSimulation
from shoal.task import SimulationData, Task

INPUT = (1, 28, 28)


class Rows(Dataset):
    """A map-style Dataset over tensors, one (x, y) item at a time (what a user's Dataset looks like)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class BenchTask(Task):
    """A built-in model on random MNIST-shaped data; clients as tensors or as Datasets."""

    def __init__(self, model: str, clients: list[tuple[torch.Tensor, torch.Tensor]], as_dataset: bool):
        self.model_name, self.clients, self.as_dataset = model, clients, as_dataset

    def model(self):
        return build_model(self.model_name, INPUT, 10)

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        train = [Rows(x, y) for x, y in self.clients] if self.as_dataset else list(self.clients)
        return SimulationData(train=train)


def make_clients(clients: int, per_client: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(per_client, *INPUT, generator=g), torch.randint(0, 10, (per_client,), generator=g))
        for _ in range(clients)
    ]


def bare_round(model, global_sd, clients, tasks, epochs: int, bs: int, lr: float, as_dataset: bool):
    """What a user would write by hand: the same training, no framework."""
    total = {k: torch.zeros_like(v) for k, v in global_sd.items()}
    weight = 0
    for task in tasks:
        x, y = clients[int(task.client_id.split("-")[1])]
        model.load_state_dict(global_sd)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        gen = torch.Generator().manual_seed(task.seed % (1 << 63))
        n = len(y)
        if as_dataset:
            rows = Rows(x, y)  # a seeded RandomSampler: one randperm per epoch from the client's seed
            loader = DataLoader(rows, batch_size=bs, sampler=RandomSampler(rows, generator=gen))
            for _ in range(epochs):
                for xb, yb in loader:
                    opt.zero_grad()
                    F.cross_entropy(model(xb), yb).backward()
                    opt.step()
        else:
            for _ in range(epochs):
                perm = torch.randperm(n, generator=gen)
                for s in range(0, n, bs):
                    idx = perm[s : s + bs]
                    opt.zero_grad()
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                total[k] += (v - global_sd[k]) * n
        weight += n
    return {k: global_sd[k] + v / weight for k, v in total.items()}


def run_case(args, clients, as_dataset: bool, profile: bool = False) -> dict[str, float]:
    """Median seconds (wall clock and this process's CPU time) of one shoal round and of one
    bare round, and the largest difference between the two global models."""
    cfg = load_config(
        None,
        [
            f"simulation.num_clients={args.clients}",
            f"simulation.clients_per_round={args.clients}",
            f"train.epochs={args.epochs}",
            f"train.batch_size={args.batch}",
            "train.lr=0.05",
            'simulation.device="cpu"',
            "simulation.progress=false",
        ],
    )
    task = BenchTask(args.model, clients, as_dataset)
    sim = InProcessSimulation.from_config(cfg, task=task)
    model = build_model(args.model, INPUT, 10)
    sim_t, bare_t, sim_c, bare_c, diff = [], [], [], [], 0.0
    prof = cProfile.Profile() if profile else None
    for r in range(args.repeats + 1):  # the first pair warms up
        g_sd = {k: v.clone() for k, v in sim.spec.views(sim.global_params.clone()).items()}
        if prof is not None and r:
            prof.enable()
        c0, t0 = time.process_time(), time.perf_counter()
        sim.run_round()
        t1, c1 = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.disable()
        tasks = list(sim.rounds.selected.values())
        c2, t2 = time.process_time(), time.perf_counter()
        bare = bare_round(model, g_sd, clients, tasks, args.epochs, args.batch, 0.05, as_dataset)
        t3, c3 = time.perf_counter(), time.process_time()
        views = sim.spec.views(sim.global_params)
        diff = max(diff, max(float((views[k] - bare[k]).abs().max()) for k in views))
        if r:
            sim_t.append(t1 - t0)
            bare_t.append(t3 - t2)
            sim_c.append(c1 - c0)
            bare_c.append(c3 - c2)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    med = statistics.median
    return {"shoal": med(sim_t), "bare": med(bare_t), "shoal_cpu": med(sim_c), "bare_cpu": med(bare_c), "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="2nn")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: leave torch's default)")
    ap.add_argument("--case", choices=("both", "tensors", "dataset"), default="both")
    ap.add_argument(
        "--profile",
        choices=("tensors", "dataset"),
        default=None,
        help="cProfile shoal's rounds of this case (top 25 by own time)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clients = make_clients(args.clients, args.samples)
    cases = ["tensors", "dataset"] if args.case == "both" else [args.case]
    rows = [(case, run_case(args, clients, case == "dataset", profile=args.profile == case)) for case in cases]
    print(
        f"model {args.model}, {args.clients} clients x {args.samples} samples, E={args.epochs}, B={args.batch}, "
        f"torch threads {torch.get_num_threads()}, median of {args.repeats} rounds"
    )
    print(
        f"{'client data':<22} {'shoal s':>8} {'bare s':>8} {'ratio':>6} | {'shoal cpu s':>11} {'bare cpu s':>10} "
        f"{'ratio':>6} | {'max |model diff|':>16}"
    )
    for case, r in rows:
        name = "tensors (fast path)" if case == "tensors" else "Dataset (DataLoader)"
        print(
            f"{name:<22} {r['shoal']:8.3f} {r['bare']:8.3f} {r['shoal'] / r['bare']:6.3f} | {r['shoal_cpu']:11.3f} "
            f"{r['bare_cpu']:10.3f} {r['shoal_cpu'] / r['bare_cpu']:6.3f} | {r['diff']:16.2e}"
        )
    print("target: ratio shoal / bare <= 1.10 (wall clock; CPU time is this process's, steadier on a shared machine)")


if __name__ == "__main__":
    main()
