"""Wall time of one experiment on the in-process engine and on the Flower (Ray) engine.

The same config and seed on both: Synthetic(1,1), 100 clients, all 100 train in each of
5 rounds (logistic regression, E=1, B=10), so each engine trains 500 client-rounds.
Prints each engine's total wall time (what a user waits: data, Ray start-up, rounds)
and its round-loop time (summary.json's wall_s), their ratios, and how far apart the
two final accuracies are (they should match: the engines share sampling and seeds).
Torch runs one thread in this process, as Ray gives each 1-CPU client actor
(OMP_NUM_THREADS=1): on a loaded machine torch's default of one thread per core made
the in-process round ~100x slower here (74 s instead of 0.77 s for 100 clients), which
would measure thread contention rather than the engines.

    .venv/bin/python bench/engines.py [--ray-cpus N] [--clients 100] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from shoal.config import load_config  # noqa: E402
from shoal.simulations.experiment import run_simulation  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 1, help="CPUs the local Ray runtime may use")
    args = ap.parse_args()
    torch.set_num_threads(1)
    base = [
        f"simulation.num_clients={args.clients}",
        f"simulation.clients_per_round={args.clients}",
        f"simulation.rounds={args.rounds}",
        "simulation.device='cpu'",
        "simulation.progress=false",
        "output.plots=false",
        f"simulation.ray_num_cpus={args.ray_cpus}",
        "simulation.flower_client_cpus=1",
    ]
    results = {}
    for engine in ("inprocess", "flower"):
        cfg = load_config(None, base + [f"simulation.engine='{engine}'"])
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            summary = run_simulation(cfg, out, progress=False)
            results[engine] = (time.perf_counter() - t0, summary["wall_s"], summary["final_test_accuracy"])
    print(
        f"{args.clients} clients, all training in each of {args.rounds} rounds; Ray on {args.ray_cpus} CPU(s), 1 CPU per client actor"
    )
    print(f"{'engine':<10} {'total s':>9} {'rounds s':>9} {'final acc':>10}")
    for engine, (total, rounds, acc) in results.items():
        print(f"{engine:<10} {total:>9.2f} {rounds:>9.2f} {acc:>10.4f}")
    (ti, ri, ai), (tf, rf, af) = results["inprocess"], results["flower"]
    print(f"flower / inprocess: total {tf / ti:.1f}x, round loop {rf / ri:.1f}x; |acc difference| = {abs(af - ai):.2g}")


if __name__ == "__main__":
    main()
