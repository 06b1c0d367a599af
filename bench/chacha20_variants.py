"""ChaCha20's block function in torch, timed in the ways it could be written, side by side:

* int32 lanes (shoal/chacha20.py's ``chacha20_blocks``, what the noise uses on a CPU);
* int64 lanes masked with 0xFFFFFFFF (why the module keeps int32: more ops, twice the bytes);
* int32 lanes with the rotations by 16 and 8 done as byte shuffles (one gather kernel each instead
  of four elementwise ones: fewer kernel launches on a GPU, slower on a CPU);
* with ``--compile``, ``torch.compile`` of the int32 function (one fused kernel on a GPU, what the
  noise uses there once it has checked it, shoal/chacha20.py's ``block_function``; compiling
  takes minutes on a small CPU, seconds to a minute on a GPU machine, cached afterwards).

    python bench/chacha20_variants.py [--blocks 65536] [--reps 3] [--device cpu|cuda] [--compile]

Every variant is checked to give the same blocks; the others are written here only to be timed.
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


def _rounds(initial: torch.Tensor, quarter) -> torch.Tensor:
    """chacha20_blocks' 10 double rounds with ``quarter`` as the quarter round, the input added back:
    the (16, m) state, before serialisation."""
    a, b, c, d = (initial[4 * i : 4 * i + 4].clone() for i in range(4))
    for _ in range(10):
        a, b, c, d = quarter(a, b, c, d)
        a, b, c, d = quarter(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0))
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    return torch.cat([a, b, c, d]).add_(initial)


def blocks_int64(initial: torch.Tensor) -> torch.Tensor:
    """chacha20_blocks in int64 lanes (values in [0, 2^32)), words in stream order."""
    return _rounds(initial, _quarter64).bitwise_and_(MASK).t().contiguous()


def _rotl16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16).view(*x.shape, 2).flip(-1).view(torch.int32).view(x.shape)


def _rotl8_bytes(x: torch.Tensor) -> torch.Tensor:  # little-endian bytes b0 b1 b2 b3 -> b3 b0 b1 b2
    return x.view(torch.uint8).view(*x.shape, 4).roll(1, -1).view(torch.int32).view(x.shape)


def _rotl32(x: torch.Tensor, n: int) -> torch.Tensor:
    high = x << n
    return x.bitwise_right_shift_(32 - n).bitwise_and_((1 << n) - 1).bitwise_or_(high)


def _quarter_shuffled(a, b, c, d):
    d = _rotl16_bytes(d.bitwise_xor_(a.add_(b)))
    b = _rotl32(b.bitwise_xor_(c.add_(d)), 12)
    d = _rotl8_bytes(d.bitwise_xor_(a.add_(b)))
    b = _rotl32(b.bitwise_xor_(c.add_(d)), 7)
    return a, b, c, d


def blocks_shuffled(initial: torch.Tensor) -> torch.Tensor:
    """chacha20_blocks with the rotations by 16 and 8 as byte shuffles."""
    return _rounds(initial, _quarter_shuffled).t().contiguous()


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
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the int32 function")
    a = ap.parse_args()
    torch.set_num_threads(1)
    device = select_device(a.device)
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 1 << 32, (16, a.blocks), generator=g, dtype=torch.int64).to(device)
    as_int32 = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    expected = chacha20_blocks(as_int32)
    variants = [
        ("int32 (shoal/chacha20.py)", chacha20_blocks, as_int32),
        ("int64 masked", blocks_int64, words),
        ("int32, rotations by 16 and 8 as byte shuffles", blocks_shuffled, as_int32),
    ]
    if a.compile:
        start = time.perf_counter()
        compiled = torch.compile(chacha20_blocks, dynamic=True)
        compiled(as_int32)
        print(f"torch.compile: {time.perf_counter() - start:.1f} s to compile and run once")
        variants.append(("int32, torch.compile", compiled, as_int32))
    print(f"ChaCha20, {a.blocks} blocks on {device} (one thread on a CPU), best of {a.reps}")
    print("| variant | ms | ns per block | x int32 | same blocks |\n|---|---|---|---|---|")
    base = None
    for name, fn, arg in variants:
        same = torch.equal(fn(arg).to(torch.int64) & MASK, expected.to(torch.int64) & MASK)
        t = best(fn, arg, a.reps, device)
        base = base or t
        print(f"| {name} | {1e3 * t:.1f} | {1e9 * t / a.blocks:.0f} | {t / base:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
