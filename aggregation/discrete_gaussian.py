"""The distributed discrete Gaussian (Kairouz, Liu, Steinke, ICML 2021) for secure aggregation.

Continuous noise followed by fixed-point encoding leaves a gap between what is analysed (a real
Gaussian) and what is summed (rounded floats). The distributed discrete Gaussian works in the
integers that secure aggregation sums from the start. Each client (:meth:`DdgCodec.encode`):

1. clips its update to L2 norm C and scales it by 1/gamma (gamma: the granularity);
2. flattens it with a random rotation, a randomized Hadamard transform whose signs come from a
   public per-round seed (:class:`Rotation`), so no coordinate is much larger than ||x||/sqrt(d)
   and the sum rarely wraps around the modulus;
3. rounds each coordinate randomly to an integer (unbiased), retrying until the rounded vector's
   norm is within the paper's bound (conditional randomized rounding, bias beta), which bounds
   the sensitivity after rounding;
4. adds integer discrete Gaussian noise of variance sigma^2 / gamma^2 per coordinate, drawn with
   the exact sampler of Canonne, Kamath and Steinke (2020) (:func:`sample`): integer arithmetic
   only, every bit from the CSPRNG of shoal.noise;
5. reduces modulo 2^bits; secure aggregation masks and sums these integers.

The server tops the unmasked sum up to K_max shares with more draws of the same integer noise
(:meth:`DdgCodec.top_up`), then (:meth:`DdgCodec.decode`) takes it modulo 2^bits, maps it to the
centred integers [-2^(bits-1), 2^(bits-1)), multiplies by gamma and undoes the rotation.
Reducing modulo 2^bits is post-processing of the integer sum, so the guarantee does not depend
on it; a coordinate whose sum leaves the range only loses accuracy (:func:`plan` sizes gamma
so that happens about never).

Privacy (shoal.accounting_ddg.ddg_rdp): the sum of n discrete Gaussians of variance sigma^2/gamma^2
is close to one of variance n sigma^2/gamma^2 (the paper's tau term), and the rounded update's
norm is at most Delta_2 (:meth:`DdgParams.sensitivity_sq`). Like the continuous mechanism, each
share's variance is sized for the fewest survivors t that secure aggregation accepts, so every
completed sum holds at least t shares.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

from shoal.errors import ConfigError
from shoal.noise import NoiseSource

MAX_VARIANCE = 1 << 30  # the sampler's integer variance: keeps every product of it within int64
HEADROOM_SIGMAS = 6.0  # the modulus holds this many stds of a coordinate of the sum
MAX_INFLATION = 1.10  # refuse a granularity that inflates the sensitivity C by more than 10%
MAX_ROUNDING_TRIES = 1000
DEFAULT_BETA = math.exp(-0.5)  # the paper's choice for the conditional rounding's bias


class DdgConfigError(ConfigError):
    """Discrete-Gaussian parameters that cannot work (the numbers are in the message)."""


# --- the exact sampler (Canonne, Kamath, Steinke 2020), vectorized ---------------------------


def _bernoulli_ratio(src: NoiseSource, num: np.ndarray, den: int, k: int) -> np.ndarray:
    """Bernoulli(num / (den k)) per entry, for 0 <= num <= den: a uniform integer on [0, den k)
    below num; when den k would not fit an int64, as U k + V with U on [0, den) and V on [0, k):
    U k + V < num iff U < num // k, or U == num // k and V < num % k."""
    if den * k < 1 << 62:
        return src.below(den * k, num.size) < num
    u = src.below(den, num.size)
    if k == 1:
        return u < num
    v = src.below(k, num.size)
    q, r = num // k, num % k
    return (u < q) | ((u == q) & (v < r))


def _bernoulli_exp_le1(src: NoiseSource, num: np.ndarray, den: int) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for 0 <= num <= den (CKS 2020, Algorithm 1's first part): draw
    A_k ~ Bernoulli(num / (den k)) for k = 1, 2, ... until one is 0; return whether that k is odd.
    The entries still drawing at step k all share that k, so a step is one vectorised draw."""
    stop = np.ones(num.size, dtype=np.int64)  # the k of each entry's first A_k = 0
    active = np.arange(num.size)
    k = 1
    while active.size:
        active = active[_bernoulli_ratio(src, num[active], den, k)]
        k += 1
        stop[active] = k
    return (stop % 2) == 1


def bernoulli_exp(src: NoiseSource, num: np.ndarray, den: np.ndarray | int) -> np.ndarray:
    """Bernoulli(exp(-num/den)) per entry, num >= 0 and den >= 1 int64 (one den for all, or one per
    entry): exp(-1) for each unit of the integer part, times exp(-fraction) (CKS 2020, Algorithm 1)."""
    num = np.asarray(num, dtype=np.int64)
    if np.ndim(den) != 0:  # the same den throughout (every caller here), else one pass per value
        den_arr = np.asarray(den, dtype=np.int64)
        if den_arr.size and int(den_arr.min()) != int(den_arr.max()):
            out = np.empty(num.shape, dtype=bool)
            for d in np.unique(den_arr):
                sel = den_arr == d
                out[sel] = bernoulli_exp(src, num[sel], int(d))
            return out
        den = int(den_arr.flat[0]) if den_arr.size else 1
    den = int(den)
    if den < 1:
        raise ValueError(f"bernoulli_exp needs den >= 1, got {den}")
    whole, frac = num // den, num % den
    out = _bernoulli_exp_le1(src, frac, den)
    left = whole.copy()
    pending = np.flatnonzero(out & (left > 0))
    while pending.size:
        b = _bernoulli_exp_le1(src, np.ones(pending.size, dtype=np.int64), 1)
        out[pending[~b]] = False
        left[pending] -= 1
        pending = pending[b & (left[pending] > 0)]
    return out


def _geometric_exp1(src: NoiseSource, n: int) -> np.ndarray:
    """The number of successes of Bernoulli(exp(-1)) before the first failure."""
    v = np.zeros(n, dtype=np.int64)
    going = np.arange(n)
    while going.size:
        ones = np.ones(going.size, dtype=np.int64)
        b = _bernoulli_exp_le1(src, ones, 1)
        v[going[b]] += 1
        going = going[b]
    return v


def _accepted(n: int, propose, rate: float) -> np.ndarray:
    """``n`` accepted draws of a rejection sampler: ``propose(m)`` gives m candidates and whether each
    is accepted. Each batch is sized for what is still missing at the acceptance ``rate`` seen so far
    (plus a margin), so one or two batches usually do, instead of one ever smaller batch per
    rejection round (numpy's per-call cost dominates small batches). Exact: the accepted candidates are
    independent draws of the target, and which of them are kept (the first n in order) depends only on
    which were accepted, never on their values."""
    out = np.empty(n, dtype=np.int64)
    have = 0
    while have < n:
        missing = n - have
        m = int(missing / rate + 4 * math.sqrt(missing / rate) + 16)
        values, ok = propose(m)
        kept = values[ok][:missing]
        out[have : have + kept.size] = kept
        have += kept.size
        rate = max(float(ok.mean()), 0.01)
    return out


def discrete_laplace(src: NoiseSource, t: int, n: int) -> np.ndarray:
    """``n`` draws of the discrete Laplace P(y) ∝ exp(-|y|/t), t a positive integer (CKS 2020,
    Algorithm 2 with s = 1)."""

    def propose(m: int) -> tuple[np.ndarray, np.ndarray]:
        u = src.below(t, m)
        d = bernoulli_exp(src, u, t)
        x = u + t * _geometric_exp1(src, m)
        negative = src.below(2, m) == 1
        return np.where(negative, -x, x), d & ~(negative & (x == 0))

    return _accepted(n, propose, 1 - math.exp(-1) / 2)


def sample(src: NoiseSource, variance: int, n: int) -> np.ndarray:
    """``n`` draws of the discrete Gaussian P(y) ∝ exp(-y^2 / (2 variance)) over the integers,
    exactly (CKS 2020, Algorithm 3): a discrete Laplace proposal of scale t = floor(sigma) + 1,
    accepted with probability exp(-(|y| - sigma^2/t)^2 / (2 sigma^2)). ``variance`` is an integer
    (so every probability is a ratio of int64s) of at most :data:`MAX_VARIANCE`; 0 gives zeros."""
    variance = int(variance)
    if variance == 0:
        return np.zeros(n, dtype=np.int64)
    if not 0 < variance <= MAX_VARIANCE:
        raise ValueError(f"discrete Gaussian variance {variance} must be in [0, {MAX_VARIANCE}]")
    a = variance
    t = math.isqrt(a) + 1

    def propose(m: int) -> tuple[np.ndarray, np.ndarray]:
        y = discrete_laplace(src, t, m)
        # accept with exp(-r^2 / (2 a t^2)), r = t|y| - a; with r = t u + v (0 <= v < t) the exponent
        # splits into u^2/(2a) + u v/(a t) + v^2/(2 a t^2), each a ratio of int64s
        r = np.abs(t * np.abs(y) - a)
        u, v = r // t, r % t
        ok = bernoulli_exp(src, u * u, 2 * a)
        idx = np.flatnonzero(ok)
        ok[idx] = bernoulli_exp(src, u[idx] * v[idx], a * t)
        idx = np.flatnonzero(ok)
        ok[idx] = bernoulli_exp(src, v[idx] * v[idx], 2 * a * t * t)
        return y, ok

    return _accepted(n, propose, 0.5)


# --- the flattening rotation -----------------------------------------------------------------


def _fwht(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform of a vector whose length is a power of two."""
    n = x.size
    h = 1
    while h < n:
        pairs = x.reshape(-1, 2, h)
        x = np.stack([pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]], axis=1).reshape(n)
        h *= 2
    return x / math.sqrt(n)


def _blocks(d: int) -> list[tuple[int, int]]:
    """(start, size) of the power-of-two blocks that tile [0, d), largest first (d's binary digits)."""
    out, start = [], 0
    for bit in reversed(range(d.bit_length())):
        size = 1 << bit
        if d & size:
            out.append((start, size))
            start += size
    return out


class Rotation:
    """A randomized Hadamard transform x -> H D x over ``dim`` coordinates: random signs D from a
    public seed, then an orthonormal Hadamard transform on each power-of-two block of the vector
    (a dimension that is no power of two is tiled by blocks, so nothing is padded). Orthogonal:
    norms, and so the analysis, are unchanged. ``seed=None``: the identity."""

    def __init__(self, dim: int, seed: int | None):
        self.dim = dim
        self.signs = None if seed is None else np.random.default_rng(seed).integers(0, 2, dim) * 2.0 - 1.0
        self.blocks = _blocks(dim)

    def _hadamard(self, x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        for start, size in self.blocks:
            out[start : start + size] = _fwht(x[start : start + size]) if size > 1 else x[start : start + size]
        return out

    def forward(self, x: np.ndarray) -> np.ndarray:
        if self.signs is None:
            return np.asarray(x, dtype=np.float64).copy()
        return self._hadamard(np.asarray(x, dtype=np.float64) * self.signs)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        if self.signs is None:
            return np.asarray(y, dtype=np.float64).copy()
        return self._hadamard(np.asarray(y, dtype=np.float64)) * self.signs


# --- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DdgParams:
    """One round's mechanism: ``dim`` coordinates, clip C, granularity gamma, modulus 2^bits,
    conditional-rounding bias beta, integer noise ``variance`` per client (sigma^2/gamma^2), for
    sums of ``shares`` (t, the fewest) to ``max_summands`` clients."""

    dim: int
    clip: float
    gamma: float
    bits: int
    beta: float
    variance: int
    shares: int
    max_summands: int
    rotate: bool = True

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @property
    def client_std(self) -> float:
        """sigma: the std of one client's noise in the update's units (gamma sqrt(variance))."""
        return self.gamma * math.sqrt(self.variance)

    def rounding_bound(self) -> float:
        """The largest norm conditional rounding keeps, in integer units (the paper's bound):
        min(C/gamma + sqrt(d), sqrt(C^2/gamma^2 + d/4 + sqrt(2 ln(1/beta)) (C/gamma + sqrt(d)/2)))."""
        c, d = self.clip / self.gamma, self.dim
        plain = c + math.sqrt(d)
        if self.beta <= 0:
            return plain
        return min(plain, math.sqrt(c * c + d / 4 + math.sqrt(2 * math.log(1 / self.beta)) * (c + math.sqrt(d) / 2)))

    def sensitivity_sq(self) -> float:
        """Delta_2^2, the squared L2 sensitivity after rounding in the update's units (Theorem 1):
        min(C^2 + gamma^2 d/4 + sqrt(2 ln(1/beta)) gamma (C + gamma sqrt(d)/2), (C + gamma sqrt(d))^2)."""
        return (self.gamma * self.rounding_bound()) ** 2

    def as_dict(self) -> dict:
        return {
            "dim": self.dim,
            "clip": self.clip,
            "gamma": self.gamma,
            "bits": self.bits,
            "beta": self.beta,
            "variance": self.variance,
            "shares": self.shares,
            "max_summands": self.max_summands,
            "rotate": self.rotate,
        }


def _range_std(dim: int, clip: float, summands: int, client_var: float) -> float:
    """The std of one coordinate of a sum of ``summands`` flattened updates with their noise,
    in the update's units: each flattened coordinate is about C/sqrt(d), and at worst all align."""
    return math.sqrt((summands * clip) ** 2 / dim + summands * client_var)


def plan(
    dim: int,
    clip: float,
    noise_multiplier: float,
    shares: int,
    max_summands: int,
    bits: int,
    beta: float = DEFAULT_BETA,
    gamma: float = 0.0,
    rotate: bool = True,
) -> DdgParams:
    """The round's :class:`DdgParams`: each client's noise sigma^2 = z^2 C^2 / t (so any t shares
    sum to variance z^2 C^2, as the continuous mechanism), and gamma (when 0) the finest
    granularity whose sum of ``max_summands`` clients fits :data:`HEADROOM_SIGMAS` stds in the
    modulus 2^bits. Refuses (DdgConfigError, with the numbers) a modulus too small for the sum,
    a granularity so coarse that rounding inflates the sensitivity by over 10%, or one so fine
    the sampler's integers would overflow."""
    if dim < 1 or shares < 1 or max_summands < shares:
        raise ValueError(f"dim = {dim}, shares = {shares}, max_summands = {max_summands}: need 1 <= t <= max")
    if not 2 <= bits <= 32:
        raise DdgConfigError(f"privacy.bits = {bits} must be in [2, 32] (secure aggregation sums mod 2^32)")
    if not 0 <= beta < 1:
        raise DdgConfigError(f"privacy.beta = {beta} must be in [0, 1)")
    client_var = (noise_multiplier * clip) ** 2 / shares
    spread = 2 * HEADROOM_SIGMAS * _range_std(dim, clip, max_summands, client_var)
    finest = math.sqrt(client_var / MAX_VARIANCE)  # below it the integer variance exceeds the sampler's
    if gamma <= 0:
        gamma = max(spread / (1 << bits), finest)
    elif spread / gamma > (1 << bits):
        need = math.ceil(math.log2(spread / gamma))
        raise DdgConfigError(
            f"privacy.gamma = {gamma:g} with privacy.bits = {bits}: a coordinate of the sum of up to {max_summands} "
            f"clients spans about 2 x {HEADROOM_SIGMAS:g} stds = {spread:.4g}, i.e. {spread / gamma:.4g} steps of "
            f"gamma, more than the modulus 2^{bits} = {1 << bits}: raise privacy.bits to at least {need}, raise "
            f"gamma to at least {spread / (1 << bits):.4g}, or leave gamma = 0 (chosen from bits)"
        )
    elif gamma < finest:
        raise DdgConfigError(
            f"privacy.gamma = {gamma:g} is finer than {finest:.4g}: each client's integer noise variance "
            f"sigma^2/gamma^2 = {client_var / gamma**2:.4g} would exceed the sampler's {MAX_VARIANCE}; raise gamma"
        )
    variance = math.ceil(client_var / gamma**2 - 1e-9) if noise_multiplier > 0 else 0
    p = DdgParams(dim, clip, gamma, bits, beta, variance, shares, max_summands, rotate)
    inflation = math.sqrt(p.sensitivity_sq()) / clip
    if inflation > MAX_INFLATION:
        raise DdgConfigError(
            f"privacy.bits = {bits} gives granularity gamma = {gamma:.4g} for a {dim}-parameter model: randomized "
            f"rounding inflates the sensitivity C = {clip:g} to Delta_2 = {inflation * clip:.4g} "
            f"({100 * (inflation - 1):.1f}% more, over the {100 * (MAX_INFLATION - 1):.0f}% allowed); raise "
            f"privacy.bits (each bit halves gamma) or select fewer clients per round"
        )
    return p


# --- the client's and the server's halves ----------------------------------------------------


def rotation_seed(session: bytes) -> int:
    """The rotation's public seed for a secure-aggregation session (every node and the server know
    the session id): 63 bits of its BLAKE2b hash."""
    return int.from_bytes(hashlib.blake2b(b"shoal ddg rotation/" + session, digest_size=8).digest(), "big") >> 1


class DdgCodec:
    """Encode a client's update into Z_{2^bits} (clip, scale, rotate, round, noise, reduce) and
    decode the secure sum (centre, scale, rotate back). Sans-I/O: the simulator and a node share it.
    ``rotation_seed`` is public and the same for every client and the server of a round."""

    def __init__(self, params: DdgParams, rotation_seed: int | None):
        self.p = params
        self.rotation = Rotation(params.dim, rotation_seed if params.rotate else None)

    def round_conditionally(self, x: np.ndarray, src: NoiseSource) -> np.ndarray:
        """Unbiased randomized rounding of ``x`` (integer units), redrawn until the result's norm is
        at most the paper's bound; a failure that many times is the rounding's, not the data's."""
        bound = self.p.rounding_bound()
        low = np.floor(x)
        frac = x - low
        for _ in range(MAX_ROUNDING_TRIES):
            r = low + (src.uniform(x.size) < frac)
            if float(np.linalg.norm(r)) <= bound:
                return r.astype(np.int64)
        raise RuntimeError(f"conditional randomized rounding failed {MAX_ROUNDING_TRIES} times (bound {bound:.6g})")

    def integers(self, update: np.ndarray, src: NoiseSource) -> np.ndarray:
        """The client's rounded, noised integer vector before the modular reduction (int64)."""
        x = np.asarray(update, dtype=np.float64).reshape(-1)
        if x.size != self.p.dim:
            raise ValueError(f"update has {x.size} entries, the mechanism {self.p.dim}")
        if not np.isfinite(x).all():  # as aggregation.dp.clip_to_norm: 0, so the mechanism is defined for every
            x = np.zeros_like(x)  # input and nothing it releases tells that one client's training went non-finite
        norm = float(np.linalg.norm(x))
        if norm > self.p.clip:
            x = x * (self.p.clip / norm)
        rounded = self.round_conditionally(self.rotation.forward(x / self.p.gamma), src)
        return rounded + sample(src, self.p.variance, self.p.dim)

    def encode(self, update: np.ndarray, src: NoiseSource) -> np.ndarray:
        """What the client masks: :meth:`integers` modulo 2^bits, as uint32."""
        return self.reduce(self.integers(update, src))

    def reduce(self, integers: np.ndarray) -> np.ndarray:
        return np.mod(integers, self.p.modulus).astype(np.uint32)

    def top_up(self, total: np.ndarray, shares: int, src: NoiseSource) -> np.ndarray:
        """The secure sum ``total`` (its first ``dim`` entries) plus ``shares`` more draws of a client's
        integer noise, modulo 2^bits: the server tops a sum of n survivors up to K_max shares here,
        in the integers, so every released sum is the clients' rounded updates plus exactly K_max
        shares whatever n. Topped up with continuous noise instead, a sum of all K_max survivors
        (which only a round holding the client can reach when K_max = N) alone would lie on the
        lattice and tell that round apart."""
        out = np.mod(np.asarray(total, dtype=np.int64).reshape(-1)[: self.p.dim], self.p.modulus)
        for _ in range(max(0, int(shares))):
            out = np.mod(out + sample(src, self.p.variance, self.p.dim), self.p.modulus)
        return out

    def noise_only(self, shares: int, src: NoiseSource) -> np.ndarray:
        """What a round without updates releases: ``shares`` (K_max) draws of a client's integer noise,
        decoded like any secure sum (float64). An empty round is then the mechanism at n = 0: its
        release lies on the round's rotated lattice like every other, where continuous noise would
        tell it apart."""
        return self.decode(self.top_up(np.zeros(self.p.dim, dtype=np.int64), shares, src))

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The float64 sum of the clients' updates (with their noise) from the secure sum of their
        encodings (any integer type, taken modulo 2^bits)."""
        t = np.mod(np.asarray(total, dtype=np.int64).reshape(-1)[: self.p.dim], self.p.modulus)
        centred = np.where(t >= self.p.modulus // 2, t - self.p.modulus, t)
        return self.rotation.inverse(centred.astype(np.float64) * self.p.gamma)
