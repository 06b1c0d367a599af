"""Where the randomness a privacy guarantee rests on comes from.

:class:`NoiseSource` is a cryptographically secure generator: the AES-256-CTR keystream of a
256-bit key read from the OS (``os.urandom``), so nobody can predict or recompute its draws,
not even with the run's config and its ``simulation.seed``. Every draw that a differential-privacy
guarantee rests on takes its bits from one: client selection under DP, the central noise, the
distributed noise shares (continuous or discrete) and the rounding of the discrete Gaussian.

``privacy.reproducible = true`` keys the stream from the run's seed instead (:meth:`NoiseSource.seeded`),
so a run repeats exactly; the guarantee then does not hold against anyone who knows the seed,
and the run's log and summary say so (:func:`describe`).

Gaussian noise for a CUDA tensor (DP-SGD's steps on a GPU, central noise drawn there) takes its bits
from a second stream made on the device itself: ChaCha20 (shoal/chacha20.py), keyed with 32 bytes
of this source's AES stream the first time a device asks (:meth:`NoiseSource.device_stream`), so
it is as unpredictable as the source (OS-keyed, or repeating when seeded) and its keystream never
crosses the bus. Everything else (integers, uniforms, discrete noise, CPU tensors) stays on AES-CTR.

Continuous Gaussian noise (:meth:`NoiseSource.gaussian`) is not a single floating-point draw per
entry: Mironov (2012) shows that the set of values a textbook floating-point sampler can output
has gaps that depend on the value added, so an output can give away which of two neighbouring
inputs produced it. Each entry here is the sum of four independent Box-Muller draws of std s/2,
whose floating-point values fill the line far more densely (the mitigation of Holohan and
Braghin 2021, which Opacus' secure mode also takes); each uniform carries 53 bits of the
CSPRNG. It is a mitigation, not a proof; the discrete Gaussian (aggregation/discrete_gaussian.py,
exact integer arithmetic, no floating point in the sampler) is the mechanism with none of it.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Literal

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from shoal.chacha20 import ChaCha20Stream

KEY_BYTES = 32  # 256-bit keys: at least 128 bits of OS entropy in every unreproducible stream
_ZERO_IV = bytes(16)
_AES_BLOCK = 16
_U64_MAX = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
GAUSSIAN_SUMMANDS = 4  # draws summed per continuous Gaussian entry (module doc)
GAUSSIAN_BLOCK = 1 << 15  # entries transformed at a time on the CPU: the float64 working arrays stay in L2
GAUSSIAN_BLOCK_DEVICE = 1 << 21  # on a CUDA device: few kernel launches, bounded memory (~0.4 GB a block)


class NoiseSource:
    """Uniform words, bounded integers, uniforms and Gaussians from an AES-256-CTR keystream.

    ``NoiseSource()`` keys the stream with 32 bytes of ``os.urandom``; :meth:`seeded` derives
    the key from integers (reproducible mode only)."""

    def __init__(self, key: bytes | None = None, *, reproducible: bool = False):
        if key is None:
            key = os.urandom(KEY_BYTES)
        if len(key) != KEY_BYTES:
            raise ValueError(f"a noise key has {KEY_BYTES} bytes, not {len(key)}")
        self.reproducible = reproducible
        self._stream = Cipher(algorithms.AES(key), modes.CTR(_ZERO_IV)).encryptor()
        self._zeros = b""  # the plaintext of the keystream (zeros), grown on demand
        self._device_streams: dict[torch.device, ChaCha20Stream] = {}  # keyed from this stream when first used

    @classmethod
    def seeded(cls, *parts: int) -> NoiseSource:
        """A stream keyed by a BLAKE2b hash of ``parts`` (e.g. the run's seed, the round, the client):
        the same parts give the same draws. For ``privacy.reproducible`` only."""
        h = hashlib.blake2b(b"shoal noise", digest_size=KEY_BYTES)
        for p in parts:
            b = int(p).to_bytes((int(p).bit_length() + 8) // 8 or 1, "big", signed=True)
            h.update(len(b).to_bytes(2, "big") + b)
        return cls(h.digest(), reproducible=True)

    @classmethod
    def for_run(cls, reproducible: bool, *parts: int) -> NoiseSource:
        """The OS-keyed source, or (``reproducible``) the one seeded from ``parts``."""
        return cls.seeded(*parts) if reproducible else cls()

    def random_bytes(self, n: int) -> bytes:
        return bytes(self._keystream(n))

    def _keystream(self, n: int) -> bytearray:
        """``n`` keystream bytes, encrypted straight into a fresh buffer (no plaintext copy per call:
        the zero plaintext is one buffer reused, which makes this several times faster than
        ``update(bytes(n))`` on large draws)."""
        out = bytearray(n + _AES_BLOCK - 1)  # update_into wants room for a block's worth of slack
        if len(self._zeros) < n:
            self._zeros = bytes(max(n, 2 * len(self._zeros)))
        written = self._stream.update_into(memoryview(self._zeros)[:n], out)
        if written != n:  # CTR is a stream mode: every byte in gives one out
            raise RuntimeError(f"AES-CTR wrote {written} bytes for {n}")
        del out[n:]
        return out

    def words(self, n: int) -> np.ndarray:
        """``n`` uniform 64-bit words."""
        return np.frombuffer(self._keystream(8 * n), dtype=np.uint64)

    def secret(self, nbytes: int = KEY_BYTES) -> bytes:
        """Key material for another generator (a selection secret, a per-round stream)."""
        return self.random_bytes(nbytes)

    def below(self, high: np.ndarray | int, n: int | None = None) -> np.ndarray:
        """Uniform integers in [0, high) (int64), exactly: 64-bit words reduced modulo ``high``,
        rejecting the top partial block. ``high`` is a positive int (then ``n`` draws) or an int64
        array (then one draw per entry and ``n`` is ignored)."""
        if np.ndim(high) == 0:
            h = int(high)
            if h <= 0:
                raise ValueError("below(high) needs high >= 1")
            count = int(n if n is not None else 1)
            if h <= 1 << 24:  # small bounds (most of the discrete Gaussian sampler's): half the keystream
                return self._below_small(h, count)
            w = self.words(count)
            hu = np.uint64(h)
            # words above 2^64 - 1 - (2^64 mod h) would favour the low residues: redraw them (chance h / 2^64)
            limit = _U64_MAX - np.uint64((1 << 64) % h)
            bad = np.flatnonzero(w > limit)
            while bad.size:
                w[bad] = self.words(bad.size)
                bad = bad[w[bad] > limit]
            return (w % hu).astype(np.int64)
        high_arr = np.asarray(high, dtype=np.int64)
        if high_arr.size and int(high_arr.min()) <= 0:
            raise ValueError("below(high) needs high >= 1")
        hu_arr = high_arr.astype(np.uint64)
        w = self.words(hu_arr.size)
        # only a word within max(high) of 2^64 can be above its entry's limit (2^64 mod h < h): the exact
        # limit is computed for those few alone
        top = _U64_MAX - np.uint64(int(high_arr.max(initial=1)) - 1)
        suspect = np.flatnonzero(w >= top)
        while suspect.size:
            hs = hu_arr[suspect]
            limits = _U64_MAX - (np.uint64(0) - hs) % hs
            bad = suspect[w[suspect] > limits]
            w[bad] = self.words(bad.size)
            suspect = bad[w[bad] >= top]
        return (w % hu_arr).astype(np.int64)

    def _below_small(self, h: int, n: int) -> np.ndarray:
        """``n`` uniform integers in [0, h) for h <= 2^24, from 32-bit words (exactly: words at or
        above the largest multiple of h below 2^32 are redrawn, a chance below h / 2^32)."""
        w = np.frombuffer(self._keystream(4 * n), dtype=np.uint32)
        limit = np.uint32((1 << 32) - (1 << 32) % h - 1)
        bad = np.flatnonzero(w > limit)
        while bad.size:
            w[bad] = np.frombuffer(self._keystream(4 * bad.size), dtype=np.uint32)
            bad = bad[w[bad] > limit]
        return (w % np.uint32(h)).astype(np.int64)

    def uniform(self, n: int) -> np.ndarray:
        """``n`` uniforms in [0, 1) with 53 random bits each (float64)."""
        return (self.words(n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    def gaussian(self, n: int, std: float) -> np.ndarray:
        """``n`` draws of N(0, std^2) (float64), each the sum of :data:`GAUSSIAN_SUMMANDS` Box-Muller
        draws of std ``std / 2`` (module doc)."""
        out = torch.empty(max(n, 0), dtype=torch.float64)
        self.gaussian_into(out, std)
        return out.numpy()

    def gaussian_tensor(
        self, n: int, std: float, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """:meth:`gaussian` as a tensor of ``dtype`` on ``device``."""
        out = torch.empty(max(n, 0), dtype=dtype, device=device)
        self.gaussian_into(out, std)
        return out

    def gaussian_into(
        self, out: torch.Tensor, std: float, keystream: Literal["auto", "aes", "chacha20"] = "auto"
    ) -> torch.Tensor:
        """Fill the contiguous tensor ``out`` (any float dtype and shape) with N(0, std^2) draws,
        computed in float64 from 53-bit uniforms in blocks (so memory stays bounded, and on the CPU
        the working arrays stay in cache), rounded to ``out``'s dtype only at the end. Returns ``out``.

        ``keystream`` says where the uniforms' bits come from: ``"auto"`` takes the device stream
        (:meth:`device_stream`, ChaCha20 made on the device) for a CUDA tensor and this source's
        AES-CTR stream otherwise; ``"aes"`` always the AES-CTR stream (made on the CPU, copied to a
        CUDA device as 8 bytes per uniform); ``"chacha20"`` always the device stream (on the CPU,
        for tests and benchmarks). The transform is the same either way."""
        if not out.is_contiguous():
            raise ValueError("gaussian_into fills a contiguous tensor")
        if keystream not in ("auto", "aes", "chacha20"):
            raise ValueError(f"keystream is 'auto', 'aes' or 'chacha20', not {keystream!r}")
        where = out.device if out.device.type == "cuda" else torch.device("cpu")
        if keystream == "chacha20" or (keystream == "auto" and where.type == "cuda"):
            top53 = self.device_stream(where).top53
        else:
            top53 = self._top53
        size = GAUSSIAN_BLOCK if where.type == "cpu" else GAUSSIAN_BLOCK_DEVICE
        flat = out.view(-1)
        for start in range(0, flat.numel(), size):
            block = flat[start : start + size]
            n = block.numel()
            z = _box_muller_sums(top53(4 * n).to(where), n, std)
            block.copy_(z.to(block.dtype))  # rounded where drawn
        return out

    def device_stream(self, device: torch.device | str) -> ChaCha20Stream:
        """This source's ChaCha20 stream on ``device``, keyed with 32 bytes of its AES stream when
        first asked for (so it is OS-keyed when this source is, and repeats when it is seeded)."""
        device = torch.device(device)
        if device not in self._device_streams:
            self._device_streams[device] = ChaCha20Stream(self.secret(KEY_BYTES), device)
        return self._device_streams[device]

    def _top53(self, n: int) -> torch.Tensor:
        """``n`` integers in [0, 2^53) from the AES stream (int64, on the CPU)."""
        return torch.from_numpy((self.words(n) >> np.uint64(11)).view(np.int64))


def _box_muller_sums(top53: torch.Tensor, n: int, std: float) -> torch.Tensor:
    """``n`` N(0, std^2) entries (float64, where ``top53`` is) from ``4 n`` 53-bit integers: each entry
    the sum of 4 Box-Muller draws (2 pairs: cos and sin of each).

    The transform runs in torch (its vectorised float64 log, sin and cos, several times faster
    than numpy's), on uniforms with 53 random bits each."""
    pairs = 2 * n  # each pair (radius, angle) gives two independent summands, cos and sin
    u = top53.to(torch.float64).mul_(1.0 / (1 << 53))  # [0, 1) in steps of 2^-53
    u1, u2 = u[:pairs], u[pairs:]
    radius = torch.log1p(u1.neg_()).mul_(-2.0).sqrt_()  # 1 - u1 in (0, 1]: never log(0)
    angle = u2.mul_(2.0 * math.pi)
    z = torch.cos(angle).mul_(radius).add_(torch.sin(angle).mul_(radius))  # 2 summands per pair
    z = z[:n].add_(z[n:])  # pair i and pair n + i: four summands per entry
    return z.mul_(std / math.sqrt(GAUSSIAN_SUMMANDS))


def describe(reproducible: bool) -> str:
    """What the run's log and summary say about where its privacy noise came from."""
    if reproducible:
        return (
            "privacy.reproducible = true: selection and noise are seeded from simulation.seed, so the run "
            "repeats exactly; the privacy guarantee does NOT hold against anyone who knows the seed"
        )
    return (
        "selection and noise from a CSPRNG (AES-256-CTR, and ChaCha20 keyed from it for noise made on a GPU) "
        "keyed with 256 bits from the OS"
    )
