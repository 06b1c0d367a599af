"""A population far larger than a round on the Ray engine: 100,000 clients, 1,000 per round.

``--data lazy`` (the default): shoal.tasks:SyntheticPopulationTask, whose population() gives
each client when it is trained, so neither the driver nor a worker holds the population's
data. ``--data held``: each client holds a few rows of a linearly separable 4-class problem
(16 features) given whole by simulation_data(), so every process holds it all (loaded once).
The figures: what the driver and the workers hold, and the time a 1,000-client round takes. Workers return partial sums (plain FedAvg),
so the driver receives one model-sized vector per worker per round. Prints seconds per
round, the driver's peak RSS and each worker's (reported by the worker itself).

    .venv/bin/python bench/ray_scale.py [--clients 100000] [--cohort 1000] [--rounds 3] [--workers 2] [--engine ray|inprocess] [--data lazy|held]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shoal.task import SimulationData, Task
from shoal.task_data import Partitioned


class ManyClients(Task):
    """``clients`` clients of 8-24 rows each: x ~ N(0, I_16), y = argmax(x W) for a fixed W."""

    num_classes = 4

    def __init__(self, clients: int = 100_000, features: int = 16):
        self.clients, self.features = clients, features

    def model(self) -> nn.Module:
        return nn.Linear(self.features, self.num_classes)

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        g = torch.Generator().manual_seed(seed)
        sizes = np.random.default_rng(seed).integers(8, 25, size=self.clients)
        n = int(sizes.sum())
        x = torch.randn(n, self.features, generator=g)
        w = torch.randn(self.features, self.num_classes, generator=g)
        y = (x @ w).argmax(1)
        bounds = np.concatenate([[0], np.cumsum(sizes)])
        parts = [np.arange(bounds[i], bounds[i + 1]) for i in range(self.clients)]
        test_x = torch.randn(2000, self.features, generator=g)
        return SimulationData(train=Partitioned(x, y, parts), test=(test_x, (test_x @ w).argmax(1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--cohort", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--data",
        default="lazy",
        choices=["lazy", "held"],
        help="lazy: shoal.tasks:SyntheticPopulationTask (clients loaded when trained, Task.population); "
        "held: ManyClients below (every process holds the whole population)",
    )
    ap.add_argument(
        "--engine", default="ray", choices=["ray", "inprocess"], help="inprocess: the same run for reference"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    from shoal.config import load_config
    from shoal.simulations.experiment import run_simulation

    cfg = load_config(
        None,
        [
            *(
                [f"task.app='{Path(__file__).resolve()}:ManyClients'", f"task.args={{clients = {args.clients}}}"]
                if args.data == "held"
                else ["task.app='shoal.tasks:SyntheticPopulationTask'"]
            ),
            f"simulation.num_clients={args.clients}",
            f"simulation.clients_per_round={args.cohort}",
            f"simulation.rounds={args.rounds}",
            f"simulation.engine='{args.engine}'",
            f"simulation.ray_workers={args.workers}",
            f"simulation.ray_num_cpus={args.workers}",
            "simulation.device='cpu'",
            "simulation.progress=false",
            "output.plots=false",
            "train.lr=0.1",
        ],
    )
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        summary = run_simulation(cfg, out, progress=False)
        total = time.perf_counter() - t0
    driver = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "engine": args.engine,
                "data": args.data,
                "clients": args.clients,
                "cohort": args.cohort,
                "rounds": summary["rounds"],
                "total_s": round(total, 2),
                "s_per_round": round(summary["wall_s"] / summary["rounds"], 3),
                "final_test_accuracy": round(summary["final_test_accuracy"], 4),
                "driver_peak_rss_mb": round(driver, 1),
                "worker_peak_rss_mb": summary.get("ray_worker_peak_rss_mb"),
                "ray_prepare_s": summary.get("ray_prepare_s"),
            }
        )
    )


if __name__ == "__main__":
    main()
