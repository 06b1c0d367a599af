"""DP-SGD's cost on a client, measured side by side: plain SGD on the flat buffer vs
DP-SGD with Opacus (per-sample gradients, clipping, noise) on the same bound model, with the
per-step noise from the CSPRNG (the default) and from torch's seeded generator
(``privacy.reproducible = true``); the last column is what the CSPRNG adds per step. On a CUDA
device the CSPRNG column's noise is made there, from a ChaCha20 stream keyed from the step's
AES-CTR source (shoal/chacha20.py); on the CPU it is the AES-CTR keystream itself.

    OMP_NUM_THREADS=1 python bench/bench_dp_sgd.py [--model 2nn] [--n 500] [--repeats 3]
    python bench/bench_dp_sgd.py --device cuda --model 2nn,cnn --n 6000

Data lives on the device (as the simulator and a node hold it); times are synchronised with
the device, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from shoal.client.device import select_device
from shoal.client.dp_sgd import DpSgdTrainer
from shoal.client.training import LocalTrainer
from shoal.config import PrivacyConfig, TrainConfig
from shoal.models import build_model


def best_of(trainer, g, x, y, repeats: int, device: torch.device) -> float:
    trainer.train(g, x, y, seed=0)  # warm-up
    times = []
    for r in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.train(g, x, y, seed=r)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def flop_per_step(trainer, g, x, y, steps: int) -> float | None:
    """FLOPs of one step, counted as bench/sim_throughput.py counts them (torch.utils.flop_counter:
    matmuls and convolutions, so Opacus's per-sample gradients count and the noise does not) over
    one epoch; None when the counter cannot follow the trainer."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter:
            trainer.train(g, x, y, seed=0)
    except Exception:  # noqa: BLE001 - a figure we cannot count is reported as n/a, not a failed bench
        return None
    return counter.get_total_flops() / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="2nn", help="one or more of shoal.models, comma-separated")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    a = ap.parse_args()
    device = select_device(a.device)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(a.n, 1, 28, 28, generator=g).to(device)
    y = torch.randint(0, 10, (a.n,), generator=g).to(device)
    cfg = TrainConfig(epochs=1, batch_size=a.batch, lr=0.05)
    steps = a.n // a.batch
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} thread(s)"
    print(f"DP-SGD (Opacus per-sample gradients) vs plain SGD on {device} ({where}): {a.n} examples, batch {a.batch}")
    made = "ChaCha20 made on the device, keyed from" if device.type == "cuda" else "the CPU keystream of"
    print(f"DP CSPRNG: noise from {made} an AES-256-CTR source keyed from the OS (shoal.noise)")
    print(
        f"{'model':<7} {'plain ms/step':>13} {'DP seeded':>10} {'DP CSPRNG':>10} {'DP/plain':>9} {'CSPRNG +ms/step':>16}"
    )
    for name in a.model.split(","):
        torch.manual_seed(0)
        plain = LocalTrainer(build_model(name, (1, 28, 28), 10), cfg, device)
        dp = {}
        for reproducible in (True, False):
            torch.manual_seed(0)
            # as many steps as plain SGD's epoch (n // B), at rate B / n: the per-step times compare
            privacy = PrivacyConfig(mode="local", reproducible=reproducible, local_steps=steps)
            dp[reproducible] = DpSgdTrainer(build_model(name, (1, 28, 28), 10), cfg, privacy, device)
        start = plain.flat.detach().clone()
        t_plain = best_of(plain, start, x, y, a.repeats, device)
        t_seeded = best_of(dp[True], start, x, y, a.repeats, device)
        t_dp = best_of(dp[False], start, x, y, a.repeats, device)
        ms = [1e3 * t / steps for t in (t_plain, t_seeded, t_dp)]
        print(
            f"{name:<7} {ms[0]:>13.2f} {ms[1]:>10.2f} {ms[2]:>10.2f} {t_dp / t_plain:>8.1f}x {ms[2] - ms[1]:>16.2f}",
            flush=True,
        )
        fields = {"bench": "dp_sgd", "card": where if device.type == "cuda" else "cpu", "model": name, "batch": a.batch}
        fields |= {"plain_ms_per_step": ms[0], "seeded_ms_per_step": ms[1], "csprng_ms_per_step": ms[2]}
        fields["csprng_keystream"] = "chacha20 on the device" if device.type == "cuda" else "aes-ctr on the cpu"
        flops = {"plain_flop_per_step": flop_per_step(plain, start, x, y, steps)}
        flops["dp_flop_per_step"] = flop_per_step(dp[True], start, x, y, steps)  # the CSPRNG adds no FLOPs
        print("RESULT " + json.dumps(fields | flops), flush=True)  # for bench/gpu_summary.py


if __name__ == "__main__":
    main()
