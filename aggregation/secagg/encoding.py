"""Fixed-point encoding of float vectors into Z_{2^32} for secure aggregation.

Masks live in the ring of integers mod 2^32 (uint32 arithmetic wraps for free), so a
client's floats are clipped to [-clip, clip], scaled onto the integers 0..L with
``L = 2^bits - 1`` and stochastically rounded (unbiased: E[round(s)] = s). The sum of
n encodings is at most n * L, which must stay below the modulus or the sum wraps into
garbage: :class:`FixedPoint` checks that headroom up front and raises a
:class:`SecAggConfigError` naming the fix (fewer bits or fewer clients).

Example-weighted averaging (FedAvg's sum_k n_k x_k / sum_k n_k) is two secure sums:
each client sends ``w_k * clip(x_k)`` and ``w_k`` with ``w_k = n_k / max_weight`` in
[0, 1]; the server divides the sums (:func:`encode_weighted`, :func:`decode_weighted`).

Distributed DP (:func:`check_noise_range`): a client encodes its clipped delta plus its noise
share of std s = zC/sqrt(t), so an entry can be as large as C (the whole L2 norm in one
coordinate) plus the noise. The encoding's range must hold C + h*s with h =
:data:`HEADROOM_SIGMAS` (P(|N(0,1)| > 8) = 1.2e-15 per entry), or clipping would cut the
noise and the sum would carry less than accounted; and the grid spacing must be at most
s / :data:`MIN_SIGMAS_PER_QUANTUM`, so stochastic rounding (error variance <= quantum^2/4 per
entry) adds under 0.25% to the noise variance. A config that breaks either is refused with
the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shoal.errors import ConfigError

from .protocol import SecAggAborted

MODULUS_BITS = 32
HEADROOM_SIGMAS = 8.0
MIN_SIGMAS_PER_QUANTUM = 10.0


class SecAggConfigError(ConfigError):
    """Secure aggregation parameters that cannot work (e.g. no headroom in the modulus)."""


@dataclass(frozen=True)
class FixedPoint:
    """Values in [-clip, clip] <-> integers 0..2^bits-1, for sums of up to ``max_summands``."""

    clip: float
    bits: int
    max_summands: int

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise SecAggConfigError(f"secure_aggregation.clip = {self.clip} must be > 0")
        if not 1 <= self.bits <= MODULUS_BITS:
            raise SecAggConfigError(f"secure_aggregation.bits = {self.bits} must be in [1, {MODULUS_BITS}]")
        need = (self.max_summands * self.levels).bit_length()
        if need > MODULUS_BITS:
            most = MODULUS_BITS - max(self.max_summands, 1).bit_length()
            raise SecAggConfigError(
                f"secure_aggregation.bits = {self.bits} with {self.max_summands} clients needs a "
                f"{need}-bit modulus, but masks live mod 2^{MODULUS_BITS}: lower bits to at most "
                f"{max(most, 0)} or select fewer clients per round"
            )

    @property
    def levels(self) -> int:
        return 2**self.bits - 1

    @property
    def quantum(self) -> float:
        """The spacing of representable values: 2 * clip / L."""
        return 2 * self.clip / self.levels

    def encode(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Clip, scale to [0, L], round stochastically; uint32. NaN is refused (ValueError): clipped,
        it would become an arbitrary integer and corrupt a sum no one can inspect; +-Inf clip."""
        x = np.asarray(x, dtype=np.float64)
        if np.isnan(x).any():
            raise ValueError(f"input has {int(np.isnan(x).sum())} NaN entries; refusing to encode it")
        scaled = (np.clip(x, -self.clip, self.clip) + self.clip) / self.quantum
        low = np.floor(scaled)
        up = rng.random(scaled.shape) < (scaled - low)
        return np.minimum(low + up, self.levels).astype(np.uint32)

    def decode_sum(self, total: np.ndarray, count: int) -> np.ndarray:
        """The float sum of ``count`` encoded vectors from their integer sum mod 2^32."""
        if count > self.max_summands:
            raise ValueError(f"{count} summands exceed the encoding's headroom of {self.max_summands}")
        return np.asarray(total, dtype=np.float64) * self.quantum - count * self.clip

    def error_bound(self, count: int) -> float:
        """Largest |decoded sum - true sum| per entry for inputs inside [-clip, clip]:
        stochastic rounding moves each summand by less than one quantum."""
        return count * self.quantum


def noise_range(clip_norm: float, share_std: float) -> float:
    """The smallest encoding range that holds a clipped delta's entry plus its noise share:
    C + HEADROOM_SIGMAS * s."""
    return clip_norm + HEADROOM_SIGMAS * share_std


def check_noise_range(values: FixedPoint, clip_norm: float, share_std: float, shares: int) -> None:
    """Refuse an encoding that would clip or coarsen a distributed-DP noise share (module doc)."""
    need = noise_range(clip_norm, share_std)
    why = (
        f"with privacy.clip_norm = C = {clip_norm:g} and each of t = {shares} noise shares of std "
        f"s = z*C/sqrt(t) = {share_std:.4g}, an entry of a client's noisy update reaches C + "
        f"{HEADROOM_SIGMAS:g} s = {need:.4g}"
    )
    if values.clip < need:
        raise SecAggConfigError(
            f"secure_aggregation.clip = {values.clip:g} would clip the distributed-DP noise: {why}, so the "
            f"sum would carry less noise than the accountant assumes; set secure_aggregation.clip >= {need:.4g}"
        )
    if values.quantum > share_std / MIN_SIGMAS_PER_QUANTUM:
        bits = next(
            (
                b
                for b in range(values.bits, MODULUS_BITS + 1)
                if 2 * values.clip / (2**b - 1) <= share_std / MIN_SIGMAS_PER_QUANTUM
            ),
            None,
        )
        raise SecAggConfigError(
            f"secure_aggregation.bits = {values.bits} with clip = {values.clip:g} gives a grid spacing of "
            f"{values.quantum:.4g}, coarser than 1/{MIN_SIGMAS_PER_QUANTUM:g} of the noise share's std "
            f"{share_std:.4g}: rounding would add noise the accountant does not model; raise "
            "secure_aggregation.bits"
            + (f" to at least {bits}" if bits else "")
            + f" or lower secure_aggregation.clip (not below {need:.4g})"
        )


def encode_weighted(
    x: np.ndarray, weight: float, values: FixedPoint, weights: FixedPoint, rng: np.random.Generator
) -> np.ndarray:
    """``[w * clip(x), w]`` encoded for the secure sum; ``weight`` must be in [0, 1]."""
    if not 0 <= weight <= 1:
        raise ValueError(f"weight = {weight} must be in [0, 1] (divide by the round's max weight)")
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all():  # NaN would encode to an arbitrary integer and corrupt the sum unseen
        raise ValueError(f"input has {int((~np.isfinite(x)).sum())} NaN/Inf entries; refusing to encode it")
    clipped = np.clip(x, -values.clip, values.clip)
    return np.concatenate([values.encode(weight * clipped, rng), weights.encode(np.array([weight]), rng)])


def decode_weighted(total: np.ndarray, count: int, values: FixedPoint, weights: FixedPoint) -> tuple[np.ndarray, float]:
    """(sum_k w_k x_k, sum_k w_k) from the integer sum of :func:`encode_weighted` vectors."""
    return values.decode_sum(total[:-1], count), float(weights.decode_sum(total[-1:], count)[0])


def example_weight(num_examples: int, max_weight: float, weighting: str = "examples") -> float:
    """w_k in [0, 1]: ``n_k / max_weight`` (capped at 1) for example weighting, else 1."""
    if weighting != "examples":
        return 1.0
    if not max_weight > 0:
        raise ValueError(f"max_weight = {max_weight} must be > 0")
    return min(num_examples / max_weight, 1.0)


def weighted_mean(total: np.ndarray, count: int, values: FixedPoint, weights: FixedPoint) -> tuple[np.ndarray, float]:
    """(sum_k w_k x_k / sum_k w_k, sum_k w_k) from the unmasked integer sum of ``count``
    :func:`encode_weighted` vectors. Raises SecAggAborted when the summed weight is not
    positive (nothing to average)."""
    total_x, wsum = decode_weighted(total, count, values, weights)
    if not wsum > 0:
        raise SecAggAborted(f"the securely summed weight is {wsum}: nothing to average")
    return total_x / wsum, wsum
