"""Why shoal/chacha20.py keeps its 32-bit words in int32 lanes: ChaCha20's twenty rounds timed in
int32 lanes (the module's block function) against int64 lanes masked with 0xFFFFFFFF.

    python bench/chacha20_lanes.py [--blocks 65536] [--reps 3] [--device cpu]

Both compute the same blocks (checked); the int64 variant is written here only to be timed.
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.chacha20 import chacha20_blocks
from shoal.client.device import select_device

MASK = 0xFFFF_FFFF


def _rotl64(x: torch.Tensor, n: int) -> torch.Tensor:
    high = x << n
    return x.bitwise_right_shift_(32 - n).bitwise_or_(high).bitwise_and_(MASK)


def _quarter64(a, b, c, d):
    d = _rotl64(d.bitwise_xor_(a.add_(b).bitwise_and_(MASK)), 16)
    b = _rotl64(b.bitwise_xor_(c.add_(d).bitwise_and_(MASK)), 12)
    d = _rotl64(d.bitwise_xor_(a.add_(b).bitwise_and_(MASK)), 8)
    b = _rotl64(b.bitwise_xor_(c.add_(d).bitwise_and_(MASK)), 7)
    return a, b, c, d


def blocks_int64(initial: torch.Tensor) -> torch.Tensor:
    """chacha20_blocks in int64 lanes (values in [0, 2^32)), words in stream order."""
    a, b, c, d = (initial[4 * i : 4 * i + 4].clone() for i in range(4))
    for _ in range(10):
        a, b, c, d = _quarter64(a, b, c, d)
        a, b, c, d = _quarter64(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0))
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    return torch.cat([a, b, c, d]).add_(initial).bitwise_and_(MASK).t().contiguous()


def best(fn, arg: torch.Tensor, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        fn(arg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1 << 16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    a = ap.parse_args()
    torch.set_num_threads(1)
    device = select_device(a.device)
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 32, (16, a.blocks), generator=g, dtype=torch.int64).to(device)
    as_int32 = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    same = torch.equal(chacha20_blocks(as_int32).to(torch.int64) & MASK, blocks_int64(words))
    t32, t64 = best(chacha20_blocks, as_int32, a.reps, device), best(blocks_int64, words, a.reps, device)
    print(f"ChaCha20, {a.blocks} blocks on {device} (one thread on a CPU), best of {a.reps}; same blocks: {same}")
    print("| lanes | ms | ns per block |\n|---|---|---|")
    for name, t in (("int32 (shoal/chacha20.py)", t32), ("int64 masked", t64)):
        print(f"| {name} | {1e3 * t:.1f} | {1e9 * t / a.blocks:.0f} |")
    print(f"int64 / int32: {t64 / t32:.1f}x")


if __name__ == "__main__":
    main()
