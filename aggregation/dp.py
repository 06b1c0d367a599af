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

Distributed DP: :func:`noise_share` is what each of n clients adds to its clipped delta
before secure aggregation, N(0, z² C² / n), so the sum carries N(0, z² C²) without any
party seeing a less noisy value; the server then only divides (``DPMean`` with
``clip_norm=None`` and ``noise_multiplier=0``).
"""

from __future__ import annotations

import logging
import math
import secrets
from dataclasses import dataclass

import torch

from shoal.config import PrivacyConfig, StrategyConfig
from shoal.errors import ConfigError

from shoal.aggregation.mean import EmptyAggregate
from shoal.aggregation.server_opt import make_server_optimizer
from shoal.aggregation.strategy import Strategy

log = logging.getLogger(__name__)


def make_generator(device: torch.device | str, seed: int | None) -> torch.Generator:
    """A noise generator: seeded in simulations (same config, same numbers); from the OS
    otherwise. torch's generator is not a cryptographic one (docs/privacy.md)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(secrets.randbits(63) if seed is None else int(seed) % (1 << 63))
    return gen


def clip_to_norm(delta: torch.Tensor, clip_norm: float) -> tuple[torch.Tensor, float]:
    """``delta * min(1, C / ||delta||)`` (a new tensor) and the norm before clipping."""
    norm = float(torch.linalg.vector_norm(delta.double()))
    scale = min(1.0, clip_norm / norm) if norm > 0 else 1.0
    return delta * scale, norm


def gaussian(numel: int, std: float, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """N(0, std²) noise of ``numel`` entries on the generator's device."""
    noise = torch.empty(numel, dtype=dtype, device=generator.device)
    return noise.normal_(0.0, std, generator=generator)


def noise_share(clipped: torch.Tensor, clip_norm: float, noise_multiplier: float, num_clients: int,
                generator: torch.Generator) -> torch.Tensor:
    """Distributed DP: a client's clipped delta plus its share N(0, z² C² / n) of the noise."""
    if num_clients <= 0:
        raise ValueError(f"num_clients = {num_clients} must be > 0")
    std = noise_multiplier * clip_norm / math.sqrt(num_clients)
    return clipped + gaussian(clipped.numel(), std, generator).to(clipped.device)


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

    def __init__(self, numel: int, clip_norm: float | None, noise_multiplier: float, expected_clients: float,
                 device: torch.device | str = "cpu", seed: int | None = None,
                 adaptive: AdaptiveClipping | None = None):
        if numel <= 0 or expected_clients <= 0:
            raise ValueError(f"numel = {numel} and expected_clients = {expected_clients} must be > 0")
        if adaptive is not None and clip_norm is None:
            raise ValueError("adaptive clipping needs a server-side clip norm")
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

    def reset(self) -> None:
        self._sum.zero_()
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
        self.count += 1

    def mean(self) -> torch.Tensor:
        """(Σ clipped + N(0, z_Δ² C²)) / m as float32; then the adaptive clip update."""
        if self.count == 0:
            raise EmptyAggregate("no update was added: there is nothing to average")
        total = self._sum
        if self.sum_noise_multiplier > 0 and self.clip_norm is not None:
            std = self.sum_noise_multiplier * self.clip_norm
            total = total + gaussian(self.numel, std, self._gen, torch.float64)
        out = (total / self.expected_clients).to(torch.float32)
        if self.adaptive is not None:
            self._update_clip()
        return out

    def _update_clip(self) -> None:
        a = self.adaptive
        assert a is not None and self.clip_norm is not None
        noisy = (self.unclipped - self.count / 2) + float(gaussian(1, a.count_stddev, self._gen, torch.float64))
        frac = noisy / self.expected_clients + 0.5
        self.clip_norm *= math.exp(-a.lr * (frac - a.target_quantile))


def make_dp_strategy(strategy: StrategyConfig, privacy: PrivacyConfig, numel: int, expected_clients: int,
                     device: torch.device | str = "cpu", seed: int | None = None) -> Strategy:
    """The server side of ``privacy.mode`` central or distributed, over the configured server optimizer."""
    if privacy.mode == "central":
        adaptive = None
        if privacy.adaptive_clipping:
            sb = privacy.clipped_count_stddev or expected_clients / 20
            adaptive = AdaptiveClipping(privacy.target_quantile, privacy.clip_lr, sb)
        agg = DPMean(numel, privacy.clip_norm, privacy.noise_multiplier, expected_clients, device, seed, adaptive)
    elif privacy.mode == "distributed":
        agg = DPMean(numel, None, 0.0, expected_clients, device, seed)
    else:
        raise ValueError(f"privacy.mode = {privacy.mode!r} has no DP server strategy")
    if strategy.weighting != "uniform":
        log.info("privacy.mode = %s: updates are weighted uniformly (DP-FedAvg), not by example count",
                 privacy.mode)
    return Strategy(agg, make_server_optimizer(strategy), "uniform")
