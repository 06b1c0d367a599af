"""How long one local-DP round takes on clients of different sizes n, side by side for the two
DP-SGD schedules (privacy.local_schedule): ``steps`` (the default: a fixed number of steps at
rate B / n, so an expected batch of B whatever n) and ``epochs`` (train.epochs passes over the
data: round(n / B) steps, so the round's duration grows with n and tells it to whoever times
the upload). Prints each round's steps, sampling rate and time, and the largest n's time over
the smallest's per schedule.

    OMP_NUM_THREADS=1 python bench/dp_sgd_round_time.py [--model 2nn] [--n 100,800] [--repeats 5]

The cells are timed in turn, each repeat once, so a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.accounting_dpsgd import local_schedule
from shoal.client.dp_sgd import DpSgdTrainer
from shoal.config import PrivacyConfig, TrainConfig
from shoal.models import build_model


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random MNIST-shaped examples."""
    g = torch.Generator().manual_seed(n)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def round_ms(trainer: DpSgdTrainer, xy: tuple[torch.Tensor, torch.Tensor], seed: int) -> float:
    """One round's wall time in ms."""
    start = trainer.flat.detach().clone()
    t0 = time.perf_counter()
    trainer.train(start, *xy, seed=seed)
    return (time.perf_counter() - t0) * 1e3


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
        f"one local-DP round (DP-SGD, {a.model}, batch {a.batch}, {torch.get_num_threads()} thread(s)), best of {a.repeats} interleaved"
    )
    print(f"{'schedule':<8} {'n':>6} {'steps':>6} {'rate':>8} {'ms/round':>9}")
    trainers: dict[str, tuple[DpSgdTrainer, PrivacyConfig]] = {}
    for schedule in ("steps", "epochs"):
        privacy = PrivacyConfig(mode="local", local_schedule=schedule)  # type: ignore[arg-type]
        torch.manual_seed(0)
        trainers[schedule] = (DpSgdTrainer(build_model(a.model, (1, 28, 28), 10), train, privacy), privacy)
    sets = {n: data(n) for n in sizes}
    best = {(s, n): float("inf") for s in trainers for n in sizes}
    for r in range(a.repeats + 1):  # interleaved, so a busy machine slows every cell alike; round 0 warms up
        for s, n in best:
            t = round_ms(trainers[s][0], sets[n], seed=r)
            if r:
                best[s, n] = min(best[s, n], t)
    for s, (_, privacy) in trainers.items():
        for n in sizes:
            q, steps = local_schedule(n, train, privacy)
            print(f"{s:<8} {n:>6} {steps:>6} {q:>8.4g} {best[s, n]:>9.1f}")
        print(f"{s:<8} time at n = {sizes[-1]} / time at n = {sizes[0]}: {best[s, sizes[-1]] / best[s, sizes[0]]:.2f}")


if __name__ == "__main__":
    main()
