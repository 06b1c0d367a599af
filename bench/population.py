"""Driver memory of a population far larger than a round: lazy (Task.population) against held whole.

Each case runs in its own subprocess (so each peak RSS is that case's alone) and prints one JSON
line: RSS after imports (the floor every case pays: Python, torch, shoal), after building the
simulation, and the process's peak (``ru_maxrss``) after ``--rounds`` rounds and one evaluation;
plus build, sampling (``SyncRounds.start_round`` over every id) and round times. The task is
shoal.tasks:SyntheticPopulationTask (logistic regression on Synthetic(1, 1), ~290 examples a
client), so the data, not the model, is what grows. Cases:

- ``lazy`` at ``--clients`` (default 100,000) with ``--cohort`` (1,000) a round, batched (the
  round's cohort loaded and concatenated for the batched trainer) and one by one;
- ``lazy`` and ``held`` (the same clients as SimulationData, held whole: train, client test
  and central test data) at ``--compare-clients`` (10,000), side by side: the ratio of peaks.

    OMP_NUM_THREADS=1 .venv/bin/python bench/population.py [--clients 100000] [--cohort 1000]
        [--compare-clients 10000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def case(kind: str, clients: int, cohort: int, rounds: int, batch: str) -> dict:
    """One case in this process (run by the parent as a subprocess)."""
    import torch

    from shoal.config import load_config
    from shoal.simulations.inprocess import InProcessSimulation
    from shoal.tasks import SyntheticPopulationTask

    torch.set_num_threads(1)
    floor = rss_mib()
    cfg = load_config(
        None,
        [
            f"simulation.num_clients={clients}",
            f"simulation.clients_per_round={cohort}",
            f"simulation.rounds={rounds}",
            f"simulation.batch_clients={batch}",
            "simulation.progress=false",
            "simulation.device='cpu'",
        ],
    )
    task = SyntheticPopulationTask()
    t0 = time.perf_counter()
    data = task.simulation_data(clients, 0) if kind == "held" else None
    sim = InProcessSimulation.from_config(cfg, data=data, task=task)
    build_s = time.perf_counter() - t0
    built = rss_mib()
    t0 = time.perf_counter()
    for _ in range(5):
        sim.rounds.start_round(sim.client_ids)
        sim.rounds.abort_round()
    sample_s = (time.perf_counter() - t0) / 5
    round_s = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sim.run_round()
        round_s.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    ev = sim.evaluate()
    eval_s = time.perf_counter() - t0
    return {
        "case": kind,
        "batch_clients": batch,
        "clients": clients,
        "cohort": cohort,
        "train_examples": sim.shards.total_examples(),
        "floor_mib": round(floor, 1),
        "built_mib": round(built, 1),
        "peak_mib": round(peak_mib(), 1),
        "build_s": round(build_s, 2),
        "start_round_s": round(sample_s, 4),
        "round_s": [round(t, 2) for t in round_s],
        "eval_s": round(eval_s, 2),
        "test_accuracy": round(ev["test_accuracy"], 4),
    }


def run_case(*args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, __file__, "--case", *args], capture_output=True, text=True, env=env, check=False
    )
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100_000)
    ap.add_argument("--cohort", type=int, default=1_000)
    ap.add_argument("--compare-clients", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--case", nargs=5, metavar=("KIND", "CLIENTS", "COHORT", "ROUNDS", "BATCH"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:
        kind, clients, cohort, rounds, batch = a.case
        print(json.dumps(case(kind, int(clients), int(cohort), int(rounds), batch)))
        return
    rows = []
    for kind, n, batch in [
        ("lazy", a.clients, "auto"),
        ("lazy", a.clients, "1"),
        ("lazy", a.compare_clients, "auto"),
        ("held", a.compare_clients, "auto"),
    ]:
        row = run_case(kind, str(n), str(a.cohort), str(a.rounds), batch)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(
        f"{'case':>5} {'batch':>5} {'clients':>8} {'cohort':>6} {'examples':>10} {'floor':>7} {'built':>7} "
        f"{'peak':>7} {'data+':>7} {'sample_s':>8} {'round_s':>8}"
    )
    for r in rows:
        extra = r["peak_mib"] - r["floor_mib"]
        mean_round = sum(r["round_s"]) / len(r["round_s"])
        print(
            f"{r['case']:>5} {r['batch_clients']:>5} {r['clients']:>8} {r['cohort']:>6} {r['train_examples']:>10} "
            f"{r['floor_mib']:>7.0f} {r['built_mib']:>7.0f} {r['peak_mib']:>7.0f} {extra:>7.0f} "
            f"{r['start_round_s']:>8.3f} {mean_round:>8.2f}"
        )
    lazy, held = rows[2], rows[3]
    print(
        f"\n{a.compare_clients} clients: peak RSS held / lazy = {held['peak_mib'] / lazy['peak_mib']:.2f}x; "
        f"above the import floor: {(held['peak_mib'] - held['floor_mib']) / (lazy['peak_mib'] - lazy['floor_mib']):.2f}x"
    )


if __name__ == "__main__":
    main()
