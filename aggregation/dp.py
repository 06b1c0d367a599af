"""Differentially private aggregation: DP-FedAvg with fixed or adaptive clipping.

DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
Models", Algorithm 1 with the fixed-denominator estimator): each client delta is clipped
to L2 norm C, the clipped deltas are summed with weight 1, Gaussian noise N(0, z^2 C^2)
is added to the sum, and the sum is divided by the *expected* number of clients m
(not the number that arrived, which would depend on the data of who took part).

Weighting: an update's weight is its sensitivity factor, so :class:`DPMean` takes
weights in (0, 1] only (1 = uniform, as in the paper; a staleness discount below 1 keeps
the sensitivity <= C). Example weighting (n_k) would let one large client move the sum
by n_k * C, so a DP strategy always uses ``weighting = "uniform"``.

Adaptive clipping (Andrew et al. 2021, "Differentially Private Learning with Adaptive
Clipping", Algorithm 1): clients report b_i = 1[||Δ_i|| <= C]; the server forms the
noisy fraction b̄ = (Σ(b_i - 1/2) + N(0, σ_b²)) / m + 1/2 and updates
C <- C · exp(-η_C (b̄ - γ)), which tracks the γ-quantile of update norms. The total
noise multiplier z is split between the count and the sum (their Theorem 1):
z_Δ = (z^-2 - (2σ_b)^-2)^(-1/2), so the pair costs the same privacy as one Gaussian
query with multiplier z, and the accountant keeps using z.

Distributed DP: :func:`noise_share` is what each client adds to its clipped delta before
secure aggregation, N(0, z² C² / t) where t is the fewest shares a completed round can hold
(the fewest survivors secure aggregation accepts, or the number of clients selected when the
sum is taken in the clear), so whenever the round completes the sum carries at least
N(0, z² C²) without any party seeing a less noisy value (docs/privacy.md). The server only
divides (``DPMean`` with ``clip_norm=None`` and ``share_noise=(z, C)``); should fewer than t
shares reach a sum taken in the clear, it adds the missing variance itself.

The count does not show in the noise: with secure aggregation n survivors (t <= n <= K_max)
put n z²C²/t on the sum, so over d coordinates its variance would tell every recipient n. The
round's ``cohort`` K_max (the most summands a round is encoded for; a round with more is
aborted) makes the server top the sum up to K_max z²C²/t, the same for every n: the released
model's noise no longer depends on who took part. The top-up protects the released model's
recipients, not against the server, which drew it (the server knows n anyway: it ran the
protocol with the survivors); against the server only the t shares count.

Empty rounds: with Poisson sampling a round may select nobody; the DP mean then releases its
noise alone (McMahan et al. 2018, Algorithm 1 does the same), so an empty round is not told
apart by what it releases. Under the distributed discrete Gaussian that noise is K_max integer
shares decoded like a secure sum (``expect_shares``' ``empty_release``, DdgCodec.noise_only):
continuous noise would be off the lattice every other release lies on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.aggregation.mean import EmptyAggregate
from shoal.aggregation.server_opt import ServerOptimizer, make_server_optimizer
from shoal.aggregation.strategy import Strategy
from shoal.config import PrivacyConfig, StrategyConfig
from shoal.errors import ConfigError
from shoal.noise import NoiseSource
from shoal.privacy_plan import PrivacyPlan

log = logging.getLogger(__name__)


Noise = torch.Generator | NoiseSource  # where a DP draw comes from


def make_generator(device: torch.device | str, seed: int | None) -> Noise:
    """Where DP noise comes from: ``seed=None`` (the default, and always in a deployment): a CSPRNG
    keyed with 256 bits from the OS (shoal.noise), that nobody can recompute; a seed (only with
    ``privacy.reproducible = true``): torch's generator seeded with it, so the same config gives
    the same numbers, and the guarantee does not hold against whoever knows the seed."""
    if seed is None:
        return NoiseSource()
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed) % (1 << 63))
    return gen


def clip_to_norm(delta: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """``delta * min(1, C / ||delta||)`` (a new tensor) and the norm before clipping. An update with a
    NaN or infinite entry becomes 0: the clip is then defined for every input (its sensitivity stays
    C), so what DP releases never depends on whether one client's training went non-finite."""
    norm = float(torch.linalg.vector_norm(delta.double()))
    if not math.isfinite(norm):
        return torch.zeros_like(delta), norm
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return delta * scale, norm


def gaussian(
    numel: int,
    std: float,
    generator: Noise,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """N(0, std²) noise of ``numel`` entries: from the CSPRNG (each entry a sum of draws that resists
    the floating-point attack, shoal.noise) on ``device`` (default CPU), or from a seeded torch
    generator on its device (reproducible mode)."""
    if isinstance(generator, NoiseSource):
        return generator.gaussian_tensor(numel, std, device or "cpu", dtype)
    noise = torch.empty(numel, dtype=dtype, device=generator.device)
    return noise.normal_(0.0, std, generator=generator)


def noise_share(
    clipped: torch.Tensor, clip_norm: float, noise_multiplier: float, num_clients: int, generator: Noise
) -> torch.Tensor:
    """Distributed DP: a client's clipped delta plus its share N(0, z² C² / t) of the noise, where
    ``num_clients`` = t is the fewest shares any completed sum holds (see the module doc)."""
    if num_clients <= 0:
        raise ValueError(f"num_clients = {num_clients} must be > 0")
    std = share_std(clip_norm, noise_multiplier, num_clients)
    return clipped + gaussian(clipped.numel(), std, generator, clipped.dtype, clipped.device)


def share_std(clip_norm: float, noise_multiplier: float, shares: int) -> float:
    """z C / sqrt(t): the std of one client's noise share when t shares make the sum's N(0, z²C²)."""
    return noise_multiplier * clip_norm / math.sqrt(shares)


def cohort_cap(n: int, k: int) -> int:
    """K_max, the most clients a Poisson round (mean k of n) is encoded for and its noise topped up to:
    k + 7 sqrt(k) + 7, at most n. P(Binomial(n, k/n) above it) < 1e-9; a round that draws more is
    aborted (a sampling event, docs/privacy.md)."""
    return min(n, int(k + 7 * math.sqrt(k) + 7))


@dataclass
class AdaptiveClipping:
    """Andrew et al. 2021's quantile tracker: target γ, step η_C, count noise σ_b."""

    target_quantile: float = 0.5
    lr: float = 0.2
    count_stddev: float = 0.5

    def sum_noise_multiplier(self, z: float) -> float:
        """z_Δ = (z^-2 - (2σ_b)^-2)^(-1/2): the sum's share of the total multiplier z."""
        if z <= 0:
            return 0.0
        rest = z**-2 - (2 * self.count_stddev) ** -2
        if rest <= 0:
            raise ConfigError(
                f"adaptive clipping with privacy.noise_multiplier = {z} needs privacy.clipped_count_stddev "
                f"> {z / 2:g} (it is {self.count_stddev:g}): the count would use up the whole noise budget"
            )
        return rest**-0.5


class DPMean:
    """Clipped, noised, fixed-denominator sum of deltas (the Aggregator protocol).

    ``clip_norm=None`` means the clients clipped already (distributed DP); the server
    cannot clip a masked update. With ``adaptive`` the clip norm changes after each
    :meth:`mean`, from the noisy count of unclipped updates.
    """

    def __init__(
        self,
        numel: int,
        clip_norm: float | None,
        noise_multiplier: float,
        expected_clients: float,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        adaptive: AdaptiveClipping | None = None,
        share_noise: tuple[float, float] | None = None,
    ):
        """``share_noise=(z, C)``: clients add noise shares N(0, z²C²/t) (distributed DP, with
        ``clip_norm=None``); set t per round with :meth:`expect_shares`."""
        if numel <= 0 or expected_clients <= 0:
            raise ValueError(f"numel = {numel} and expected_clients = {expected_clients} must be > 0")
        if adaptive is not None and clip_norm is None:
            raise ValueError("adaptive clipping needs a server-side clip norm")
        if share_noise is not None and clip_norm is not None:
            raise ValueError("share_noise is for distributed DP, where the clients clip (clip_norm=None)")
        self.share_noise = share_noise
        self.shares = max(1, round(expected_clients))  # t: overwritten each round by expect_shares
        self.cohort = 0  # K_max the released noise is topped up to (0: z²C², t shares in the clear)
        self.topped_up = False  # the sum arrives carrying the cohort's shares (expect_shares' in_sum)
        self.empty_release: Callable[[], torch.Tensor] | None = None  # an empty round's noise (in_sum only)
        self._share_var = 0.0
        self.numel = numel
        self.clip_norm = clip_norm
        self.noise_multiplier = noise_multiplier
        self.expected_clients = float(expected_clients)
        self.adaptive = adaptive
        z = adaptive.sum_noise_multiplier(noise_multiplier) if adaptive else noise_multiplier
        self.sum_noise_multiplier = z
        self._gen = make_generator(device, seed)
        self._sum = torch.zeros(numel, device=device, dtype=torch.float64)
        self.count = 0
        self.unclipped = 0
        self.last_norms: list[float] = []

    @property
    def device(self) -> torch.device:
        return self._sum.device

    def expect_shares(
        self,
        t: int,
        cohort: int = 0,
        in_sum: bool = False,
        empty_release: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        """Distributed DP: each client of this round adds N(0, z²C²/t). ``cohort`` = K_max >= t (secure
        aggregation): the released sum is topped up to K_max z²C²/t, whatever the survivors' count.
        ``in_sum``: the secure sum arrives topped up already (the distributed discrete Gaussian does it
        in the integers, DdgCodec.top_up), so this mean adds no continuous noise at all; an empty round
        then releases ``empty_release()`` (required with ``in_sum``: K_max integer shares decoded in the
        round's rotation, DdgCodec.noise_only), the mechanism at n = 0."""
        if t < 1:
            raise ValueError(f"t = {t} noise shares: must be >= 1")
        if cohort and cohort < t:
            raise ValueError(f"cohort = {cohort} is below t = {t} noise shares")
        if in_sum and empty_release is None:
            raise ValueError("a sum topped up in the integers (in_sum) needs the noise an empty round releases")
        self.shares = int(t)
        self.cohort = int(cohort)
        self.topped_up = bool(in_sum)
        self.empty_release = empty_release if in_sum else None

    @property
    def released_share_var(self) -> float:
        """Distributed DP: the noise variance the released sum carries, n-independent: z²C², or
        K_max z²C²/t with a cohort (the module doc)."""
        if self.share_noise is None:
            return 0.0
        z, c = self.share_noise
        return (z * c) ** 2 * max(1.0, self.cohort / self.shares if self.cohort else 1.0)

    @property
    def releases_noise(self) -> bool:
        """True when :meth:`mean` adds noise, so it has something to release without updates."""
        return (self.sum_noise_multiplier > 0 and self.clip_norm is not None) or (
            self.share_noise is not None and self.share_noise[0] > 0
        )

    def reset(self) -> None:
        self._sum.zero_()
        self._share_var = 0.0
        self.count = 0
        self.unclipped = 0
        self.last_norms = []

    def add(self, delta: torch.Tensor, weight: float = 1.0) -> None:
        """Clip ``delta`` to C (unless clients did) and add ``weight`` times it, weight in (0, 1]."""
        if delta.shape != (self.numel,):
            raise ValueError(f"delta has shape {tuple(delta.shape)}, expected ({self.numel},)")
        if not 0 < weight <= 1:
            raise ValueError(
                f"weight = {weight!r}: DP aggregation takes weights in (0, 1] (its sensitivity bound); "
                "use strategy weighting = 'uniform'"
            )
        delta = delta.to(self.device)
        if self.clip_norm is not None:
            delta, norm = clip_to_norm(delta, self.clip_norm)
            self.last_norms.append(norm)
            self.unclipped += int(norm <= self.clip_norm)
        self._sum.add_(delta, alpha=weight)
        if self.share_noise is not None:
            z, c = self.share_noise
            self._share_var += weight**2 * (z * c) ** 2 / self.shares
        self.count += 1

    def missing_share_std(self) -> float:
        """Distributed DP: the std the sum still lacks to carry :attr:`released_share_var` (0 when the
        shares that arrived carry it: t of them in the clear, K_max with a cohort)."""
        if self.share_noise is None or self.topped_up:  # topped up: in the sum, or the empty release
            return 0.0
        target = self.released_share_var
        missing = target - self._share_var
        return math.sqrt(missing) if missing > 1e-9 * target else 0.0

    def mean(self) -> torch.Tensor:
        """(Σ clipped + N(0, z_Δ² C²)) / m as float32; then the adaptive clip update.
        With no update, the noise alone divided by m (nothing at all without noise: EmptyAggregate)."""
        if self.count == 0 and not self.releases_noise:
            raise EmptyAggregate("no update was added: there is nothing to average")
        total = self._sum
        if self.sum_noise_multiplier > 0 and self.clip_norm is not None:
            std = self.sum_noise_multiplier * self.clip_norm
            total = total + gaussian(self.numel, std, self._gen, torch.float64, self.device)
        if self.count == 0 and self.empty_release is not None:  # the lattice noise of n = 0 (in_sum)
            total = total + self.empty_release().to(self.device, torch.float64).reshape(-1)
        missing = self.missing_share_std()
        if missing > 0:
            log.info(
                "distributed DP: %d noise shares of 1/%d reached the sum; the server tops it up to %d shares "
                "with N(0, %.4g^2)",
                self.count,
                self.shares,
                max(self.cohort, self.shares),
                missing,
            )
            total = total + gaussian(self.numel, missing, self._gen, torch.float64, self.device)
        out = (total / self.expected_clients).to(torch.float32)
        if self.adaptive is not None:
            self._update_clip()
        return out

    def _update_clip(self) -> None:
        a = self.adaptive
        assert a is not None and self.clip_norm is not None
        noisy = (self.unclipped - self.count / 2) + float(
            gaussian(1, a.count_stddev, self._gen, torch.float64, self.device)
        )
        frac = noisy / self.expected_clients + 0.5
        self.clip_norm *= math.exp(-a.lr * (frac - a.target_quantile))


class DPStrategy(Strategy):
    """A Strategy over :class:`DPMean` that also closes a round nobody took part in: the noise is
    released alone (Poisson sampling makes such rounds; what they release must not differ)."""

    aggregator: DPMean

    def __init__(self, aggregator: DPMean, optimizer: ServerOptimizer, weighting: str = "examples"):
        super().__init__(aggregator, optimizer, weighting)

    def finalize(self) -> torch.Tensor:
        agg = self.aggregator
        if self._global is None or agg.count > 0 or not agg.releases_noise:
            return super().finalize()
        new_global = self.optimizer.step(self._global, agg.mean())
        agg.reset()
        self._global = None
        return new_global


def make_dp_strategy(
    strategy: StrategyConfig,
    privacy: PrivacyConfig,
    numel: int,
    expected_clients: int,
    device: torch.device | str = "cpu",
    seed: int | None = None,
) -> Strategy:
    """The server side of ``privacy.mode`` central or distributed, over the configured server optimizer.
    ``seed`` seeds the noise only with ``privacy.reproducible``; otherwise it comes from the CSPRNG."""
    if not privacy.reproducible:
        seed = None
    plan = PrivacyPlan(mode=privacy.mode)  # who adds the noise is the plan's answer
    if plan.server_noise:
        adaptive = None
        if privacy.adaptive_clipping:
            sb = privacy.clipped_count_stddev or expected_clients / 20
            adaptive = AdaptiveClipping(privacy.target_quantile, privacy.clip_lr, sb)
        agg = DPMean(numel, privacy.clip_norm, privacy.noise_multiplier, expected_clients, device, seed, adaptive)
    elif plan.client_shares:
        agg = DPMean(
            numel, None, 0.0, expected_clients, device, seed, share_noise=(privacy.noise_multiplier, privacy.clip_norm)
        )
    else:
        raise ValueError(f"privacy.mode = {privacy.mode!r} has no DP server strategy")
    if strategy.weighting != "uniform":
        log.info("privacy.mode = %s: updates are weighted uniformly (DP-FedAvg), not by example count", privacy.mode)
    return DPStrategy(agg, make_server_optimizer(strategy), "uniform")
