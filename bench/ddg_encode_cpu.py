"""The discrete Gaussian's cost per 2NN-sized client, in CPU time, for comparing two checkouts.

    OMP_NUM_THREADS=1 .venv/bin/python bench/ddg_encode_cpu.py LABEL

Prints one line: the exact sampler (integer variance 10^6), a whole client-side encoding (2^16,
t = 6: clip, rotate, conditional rounding, noise, modulus) and the CSPRNG's continuous Gaussian,
each the best of 7 in the process's CPU time (steadier than wall-clock time on a shared machine).
It uses only APIs every version since the discrete Gaussian has, so the same file run from two
checkouts, alternately, compares them side by side (docs/results.md).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from shoal.aggregation.discrete_gaussian import DdgCodec, plan, sample
from shoal.noise import NoiseSource

N = 199_210  # MNIST 2NN's parameters


def cpu(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this"
    src = NoiseSource()
    codec = DdgCodec(plan(N, 1.0, 1.0, 6, 39, 16), rotation_seed=1)
    update = np.random.default_rng(0).normal(size=N)
    s = cpu(lambda: sample(src, 10**6, N))
    e = cpu(lambda: codec.encode(update, src))
    g = cpu(lambda: src.gaussian(N, 1.0))
    print(
        f"{label}: sampler {s:.3f} s ({1e9 * s / N:.0f} ns/entry), client encoding {e:.3f} s, "
        f"CSPRNG Gaussian {g:.4f} s ({1e9 * g / N:.0f} ns/entry)",
        flush=True,
    )


if __name__ == "__main__":
    main()
