"""Personalised accuracy of FedAvg, Ditto, FedPer and FedRep on MNIST with two classes per client.

Each client holds two labels (examples/tasks/personal_mnist.py) and its own test images of those
labels. Every algorithm runs the same rounds from the same seed; the table gives, at the last
round, the global model's accuracy on the clients' test data (``fed_accuracy``) and each
client's own model's (``fed_personal_accuracy``: Ditto's v_k, the global body with the client's
head for FedPer / FedRep, the global model for FedAvg; after ``--tune`` fine-tuning steps).

    OMP_NUM_THREADS=1 .venv/bin/python bench/personalisation.py --data PATH_TO_MNIST [--rounds 30] [--tune 0]
"""

from __future__ import annotations

import argparse
import time

from shoal.config import load_config
from shoal.simulations.experiment import run_simulation


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--train-per-client", type=int, default=500)
    ap.add_argument("--tune", type=int, default=0, help="fine-tuning steps before the personalised evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--algorithms", default="fedavg,ditto,fedper,fedrep")
    ap.add_argument("--out", default="runs/personalisation")
    a = ap.parse_args()
    rows = []
    for name in a.algorithms.split(","):
        cfg = load_config(
            None,
            [
                "task.app='examples/tasks/personal_mnist.py:PersonalMnist'",
                f"task.args.data_dir='{a.data}'",
                f"task.args.train_per_client={a.train_per_client}",
                f"simulation.num_clients={a.clients}",
                f"simulation.clients_per_round={a.per_round}",
                f"simulation.rounds={a.rounds}",
                f"simulation.eval_every={a.rounds}",
                f"simulation.seed={a.seed}",
                "simulation.device='cpu'",
                "simulation.progress=false",
                "train.epochs=1",
                "train.batch_size=32",
                "train.lr=0.05",
                f"algorithm.name='{name}'",
                f"algorithm.personal_eval_steps={a.tune}",
                "output.plots=false",
            ],
        )
        t0 = time.perf_counter()
        s = run_simulation(cfg, f"{a.out}/{name}", progress=False)
        last = s["final_metrics"]
        rows.append((name, last.get("fed_accuracy"), last.get("fed_personal_accuracy"), time.perf_counter() - t0))
    print(f"\n{a.clients} clients, {a.per_round} a round, {a.rounds} rounds, personalised after {a.tune} steps")
    print("| algorithm | global model, clients' test (fed_accuracy) | own model (fed_personal_accuracy) | wall s |")
    print("|---|---|---|---|")
    for name, g, p, w in rows:
        print(f"| {name} | {g:.4f} | {p:.4f} | {w:.0f} |")


if __name__ == "__main__":
    main()
