"""Seeds derived from (experiment seed, round, client): the same config gives the same numbers.

Every part keeps its full width (a 128-bit secret stays 128 bits: SeedSequence takes integers
of any size); a negative part is taken modulo 2^64.
"""

from __future__ import annotations

import hashlib

import numpy as np


def _words(parts: tuple[int, ...]) -> list[int]:
    return [int(p) if int(p) >= 0 else int(p) % (1 << 64) for p in parts]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts, independent across parts (SeedSequence mixing)."""
    return int(np.random.SeedSequence(_words(parts)).generate_state(2, np.uint64)[0] >> 1)


def rng(*parts: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(_words(parts)))


def _prf(secret: bytes, parts: tuple[int, ...]) -> bytes:
    """Keyed BLAKE2b of the parts (a pseudorandom function of the key): 32 bytes."""
    if len(secret) < 16:
        raise ValueError("a secret seed needs at least 128 bits")
    h = hashlib.blake2b(key=secret[:64], digest_size=32)
    for p in parts:
        b = int(p).to_bytes((int(p).bit_length() + 8) // 8 or 1, "big", signed=True)
        h.update(len(b).to_bytes(2, "big") + b)
    return h.digest()


def secret_seed(secret: bytes, *parts: int) -> int:
    """A 63-bit seed from a secret key (at least 128 bits, from the OS) and integer parts, by a
    keyed BLAKE2b: without the key the seeds are unpredictable, and seeing any number of them
    tells nothing of the key or of the others (unlike SeedSequence, whose mixing is no PRF)."""
    return int.from_bytes(_prf(secret, parts)[:8], "big") >> 1


def secret_rng(secret: bytes, *parts: int) -> np.random.Generator:
    """A generator for one use (one round's draws) seeded with 256 bits of the keyed BLAKE2b."""
    return np.random.default_rng(np.random.SeedSequence(int.from_bytes(_prf(secret, parts), "big"), pool_size=8))
