"""DP-SGD's cost on a client, measured side by side: plain SGD on the flat buffer vs
DP-SGD with Opacus (per-sample gradients, clipping, noise) on the same bound model.

    OMP_NUM_THREADS=1 python bench/bench_dp_sgd.py [--model 2nn] [--n 500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.client.dp_sgd import DpSgdTrainer
from shoal.client.training import LocalTrainer
from shoal.config import PrivacyConfig, TrainConfig
from shoal.models import build_model


def best_of(trainer, g, x, y, repeats: int) -> float:
    trainer.train(g, x, y, seed=0)  # warm-up
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        trainer.train(g, x, y, seed=r)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="2nn")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(a.n, 1, 28, 28, generator=g), torch.randint(0, 10, (a.n,), generator=g)
    cfg = TrainConfig(epochs=1, batch_size=a.batch, lr=0.05)
    torch.manual_seed(0)
    plain = LocalTrainer(build_model(a.model, (1, 28, 28), 10), cfg)
    torch.manual_seed(0)
    dp = DpSgdTrainer(build_model(a.model, (1, 28, 28), 10), cfg, PrivacyConfig(mode="local"))
    start = plain.flat.detach().clone()
    t_plain = best_of(plain, start, x, y, a.repeats)
    t_dp = best_of(dp, start, x, y, a.repeats)
    steps = a.n // a.batch
    print(f"model {a.model}, {a.n} examples, batch {a.batch}, {steps} steps, {torch.get_num_threads()} thread(s)")
    print(f"plain SGD   {1e3 * t_plain / steps:8.2f} ms/step")
    print(f"DP-SGD      {1e3 * t_dp / steps:8.2f} ms/step")
    print(f"ratio DP-SGD / plain: {t_dp / t_plain:.1f}x")


if __name__ == "__main__":
    main()
