"""How long one local-DP round takes on clients of different sizes n, side by side for the two
DP-SGD schedules (privacy.local_schedule): ``steps`` (the default: a fixed number of steps at
rate B / n, so an expected batch of B whatever n) and ``epochs`` (train.epochs passes over the
data: round(n / B) steps, so the round's duration grows with n and tells it to whoever times
the upload). Prints each round's steps, sampling rate and time, and the largest n's time over
the smallest's per schedule.

    OMP_NUM_THREADS=1 python bench/dp_sgd_round_time.py [--model 2nn] [--n 100,800] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.accounting_dpsgd import local_schedule
from shoal.client.dp_sgd import DpSgdTrainer
from shoal.config import PrivacyConfig, TrainConfig
from shoal.models import build_model


def round_ms(trainer: DpSgdTrainer, n: int, repeats: int) -> float:
    """Best of ``repeats`` rounds on ``n`` random MNIST-shaped examples, in ms (after a warm-up)."""
    g = torch.Generator().manual_seed(n)
    x, y = torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    start = trainer.flat.detach().clone()
    trainer.train(start, x, y, seed=0)
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        trainer.train(start, x, y, seed=r + 1)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="2nn", help="one of shoal.models")
    ap.add_argument("--n", default="100,800", help="client sizes, comma-separated")
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    sizes = [int(v) for v in a.n.split(",")]
    train = TrainConfig(epochs=1, batch_size=a.batch, lr=0.05)
    print(
        f"one local-DP round (DP-SGD, {a.model}, batch {a.batch}, {torch.get_num_threads()} thread(s)), best of {a.repeats}"
    )
    print(f"{'schedule':<8} {'n':>6} {'steps':>6} {'rate':>8} {'ms/round':>9}")
    for schedule in ("steps", "epochs"):
        privacy = PrivacyConfig(mode="local", local_schedule=schedule)  # type: ignore[arg-type]
        torch.manual_seed(0)
        trainer = DpSgdTrainer(build_model(a.model, (1, 28, 28), 10), train, privacy)
        times = []
        for n in sizes:
            q, steps = local_schedule(n, train, privacy)
            times.append(round_ms(trainer, n, a.repeats))
            print(f"{schedule:<8} {n:>6} {steps:>6} {q:>8.4g} {times[-1]:>9.1f}")
        print(f"{schedule:<8} time at n = {sizes[-1]} / time at n = {sizes[0]}: {times[-1] / times[0]:.2f}")


if __name__ == "__main__":
    main()
