"""What unpredictable noise costs: the CSPRNG's draws against torch's generator, side by side.

    python bench/ddg_noise.py                # n = 199,210 (MNIST 2NN), 5 repetitions each

Times, on one thread, the median of ``--reps`` runs of drawing ``n`` entries of:

* torch's generator, N(0, 1) (a seeded Mersenne Twister: the reproducible mode's noise), one draw
  per entry and, as Opacus' ``secure_mode`` does, four summed;
* shoal.noise's CSPRNG Gaussian (AES-256-CTR uniforms, four Box-Muller draws summed per entry),
  into a float32 tensor (what DP-SGD's steps and the central noise draw) and as float64;
* the same CSPRNG Gaussian as it was first written (keystream through ``update(bytes(n))``,
  numpy's transform on the whole array), for the record of what the vectorisation gained;
* the exact discrete Gaussian sampler (integer variance 10^6, CKS 2020) on the CSPRNG;
* a whole client-side discrete-Gaussian encoding (clip, rotate, conditional rounding, noise, modulus);

and prints each with its ratio to torch's generator. A first table puts the continuous Gaussian's
keystreams side by side on ``--device`` (float32 entries, the same four-draw transform for each):

* torch's generator on the device (the reproducible mode's noise, for scale);
* AES-256-CTR, the keystream made on the CPU, into a CPU tensor;
* (``--device cuda``) the same AES-CTR keystream copied to the device and transformed there;
* ChaCha20 made on the device (what a CUDA tensor gets by default; on the CPU only for the record).

    python bench/ddg_noise.py --device cuda     # GPU times are synchronised with the device
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from shoal.aggregation.discrete_gaussian import DdgCodec, plan, sample
from shoal.client.device import select_device
from shoal.noise import NoiseSource


def timed(fn, reps: int, clock=time.perf_counter) -> float:
    times = []
    for _ in range(reps):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def first_csprng_gaussian(src: NoiseSource, n: int, std: float) -> np.ndarray:
    """The CSPRNG Gaussian as shoal.noise first computed it (same bits and sums, slower plumbing)."""
    m = 4 * n
    pairs = (m + 1) // 2

    def uniform(k: int) -> np.ndarray:
        w = np.frombuffer(src._stream.update(bytes(8 * k)), dtype=np.uint64).copy()
        return (w >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    u1, u2 = uniform(pairs), uniform(pairs)
    radius = np.sqrt(-2.0 * np.log1p(-u1))
    angle = 2.0 * np.pi * u2
    draws = np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:m]
    return draws.reshape(4, n).sum(axis=0) * (std / 2.0)


def keystream_rows(n: int, device: torch.device) -> list[tuple[str, Callable[[], object]]]:
    """The Gaussian into ``n`` float32 entries by where its bits come from (module doc)."""
    gen = torch.Generator(device=device).manual_seed(0)
    src = NoiseSource()
    on_device, on_cpu = torch.empty(n, device=device), torch.empty(n)
    rows: list[tuple[str, Callable[[], object]]] = [
        (f"torch generator, N(0,1) float32 on {device}", lambda: on_device.normal_(0.0, 1.0, generator=gen)),
        ("AES-256-CTR keystream on the CPU, CPU tensor", lambda: src.gaussian_into(on_cpu, 1.0, keystream="aes")),
    ]
    if device.type == "cuda":
        rows.append(
            (f"AES-256-CTR keystream on the CPU, copied to {device}", lambda: src.gaussian_into(on_device, 1.0, "aes"))
        )
    rows.append((f"ChaCha20 keystream made on {device}", lambda: src.gaussian_into(on_device, 1.0, "chacha20")))
    return rows


def print_table(rows: list[tuple[str, Callable[[], object]]], n: int, reps: int, clock, device: torch.device) -> None:
    """Median seconds, ns per entry and the ratio to the first row, for each row."""

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        return run

    base = None
    print("| draw | seconds | ns per entry | x first row |\n|---|---|---|---|")
    for label, fn in rows:
        synced(fn)()  # warm-up
        t = timed(synced(fn), reps, clock)
        base = base or t
        print(f"| {label} | {t:.4f} | {1e9 * t / n:.1f} | {t / base:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=199_210)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--cpu-time", action="store_true", help="time with the process's CPU clock (steadier on a shared machine)"
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto: where the keystream table's noise goes")
    a = ap.parse_args()
    clock = time.process_time if a.cpu_time else time.perf_counter
    torch.set_num_threads(1)
    n = a.n
    device = select_device(a.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "one CPU thread"
    print(f"Gaussian keystreams: n = {n} float32 entries on {device} ({where}), median of {a.reps}")
    print_table(keystream_rows(n, device), n, a.reps, time.perf_counter if device.type == "cuda" else clock, device)
    print()
    gen = torch.Generator().manual_seed(0)
    src = NoiseSource()
    codec = DdgCodec(plan(n, 1.0, 1.0, 6, 39, 16), rotation_seed=1)
    update = np.random.default_rng(0).normal(size=n)
    out32 = torch.empty(n)

    def torch_four() -> torch.Tensor:
        acc = torch.zeros(n)
        for _ in range(4):
            acc += torch.normal(0.0, 0.5, size=(n,), generator=gen)
        return acc

    rows = [
        ("torch generator, N(0,1) float32", lambda: torch.empty(n).normal_(0.0, 1.0, generator=gen)),
        ("torch generator, N(0,1) float64", lambda: torch.empty(n, dtype=torch.float64).normal_(generator=gen)),
        ("torch generator, 4 draws summed (Opacus secure_mode)", torch_four),
        ("CSPRNG Gaussian into float32 (4 Box-Muller draws summed)", lambda: src.gaussian_into(out32, 1.0)),
        ("CSPRNG Gaussian, float64", lambda: src.gaussian(n, 1.0)),
        ("CSPRNG Gaussian, first version (update(bytes), numpy)", lambda: first_csprng_gaussian(src, n, 1.0)),
        ("CSPRNG exact discrete Gaussian, variance 1e6", lambda: sample(src, 10**6, n)),
        (f"discrete-Gaussian client encoding (2^16, variance {codec.p.variance})", lambda: codec.encode(update, src)),
    ]
    print(f"n = {n}, median of {a.reps}, one thread, {'CPU' if a.cpu_time else 'wall-clock'} time")
    print_table(rows, n, a.reps, clock, torch.device("cpu"))


if __name__ == "__main__":
    main()
