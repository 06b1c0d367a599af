"""Distributed DP with secure aggregation: the released noise does not tell how many took part.

Each share is sized for t survivors, so n survivors' shares sum to n z²C²/t; over d coordinates a
recipient of the model would read n off the variance. The DP mean tops the sum up to K_max shares
(the most a round is encoded for), the same variance for every n in [t, K_max]."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shoal.aggregation.dp import DPMean, cohort_cap, make_generator, noise_share

Z, C = 2.0, 1.0
N, K, T = 10, 5, 3  # 10 clients, 5 a round on average, threshold 3 (secure aggregation at 0.5)


def released_variance(n: int, cohort: int, numel: int = 200_000) -> float:
    """The per-coordinate variance of the sum a recipient gets when n of the round's clients survive
    (their deltas 0, so the sum is the noise alone), times K (the fixed denominator)."""
    agg = DPMean(numel, None, 0.0, expected_clients=K, share_noise=(Z, C))
    agg.expect_shares(T, cohort)
    gen = make_generator("cpu", None)  # the CSPRNG, as in a run
    for _ in range(n):
        agg.add(noise_share(torch.zeros(numel), C, Z, T, gen))
    return float((agg.mean().double() * K).var())


def test_the_sum_of_three_or_five_survivors_carries_the_same_noise():
    """N = 10, K = 5, t = 3 (the issue's check): K_max = 10, so every released sum carries
    10 z²C²/3 whether 3, 4 or 5 survived; without the top-up 3 and 5 differ by 67%."""
    cohort = cohort_cap(N, K)
    assert cohort == 10  # Poisson at q = 1/2 may draw all ten
    target = cohort * (Z * C) ** 2 / T
    measured = {n: released_variance(n, cohort) for n in (3, 4, 5)}
    for v in measured.values():  # std error of a variance over 200,000 coordinates: 0.32% (3% is 9 of them)
        assert v == pytest.approx(target, rel=0.03)
    assert abs(measured[3] / measured[5] - 1) < 0.05
    bare = {n: released_variance(n, 0) for n in (3, 5)}  # the old release: n z²C²/t
    assert bare[5] / bare[3] == pytest.approx(5 / 3, rel=0.04)


def test_a_cohort_below_t_is_refused():
    agg = DPMean(10, None, 0.0, expected_clients=K, share_noise=(Z, C))
    with pytest.raises(ValueError, match="below t"):
        agg.expect_shares(3, 2)


def test_the_server_tops_up_to_k_max_and_aborts_above_it(tmp_path):
    """`shoal server`, 10 registered nodes, K = 5, secure distributed DP: K_max = cohort_cap(10, 5) = 10,
    the DP mean is told it each round, and a survivor count outside [t, K_max] is never unmasked."""
    from shoal.aggregation.secagg import SecAggAborted
    from shoal.server.store import open_service

    from ..server.live import small_config

    sections = {
        "privacy": {"mode": "distributed", "noise_multiplier": Z, "clip_norm": C},
        "secure_aggregation": {"enabled": True, "clip": 20.0},
    }
    svc = open_service(small_config(tmp_path, sections, clients_per_round=K), registered=N)
    p = svc.privacy
    assert (p.noise_shares, p.cohort) == (T, 10)
    p.round_started([f"n{i}" for i in range(4)])
    assert (p.aggregator.shares, p.aggregator.cohort) == (T, 10)
    assert p.aggregator.released_share_var == pytest.approx(10 * (Z * C) ** 2 / T)
    p.check_survivors(10, 1)
    for bad in (2, 11):
        with pytest.raises(SecAggAborted):
            p.check_survivors(bad, 1)


def test_the_discrete_gaussians_sum_arrives_topped_up(tmp_path):
    """The distributed discrete Gaussian: the server tops the unmasked sum up to K_max shares in the
    integers (DdgCodec.top_up), so the DP mean adds no continuous noise to a round with updates (which
    would leave only a round of all K_max survivors on the lattice); a round that selected nobody
    releases K_max integer shares decoded in a secret rotation drawn like a secure round's, on the
    lattice like every other release (continuous noise, or a rotation anyone could derive, would tell
    the empty round apart)."""
    from shoal.aggregation.discrete_gaussian import DdgCodec
    from shoal.server.store import open_service

    from ..server.live import small_config

    sections = {
        "privacy": {"mode": "distributed", "mechanism": "discrete_gaussian", "noise_multiplier": Z, "clip_norm": C},
        "secure_aggregation": {"enabled": True},
    }
    svc = open_service(small_config(tmp_path, sections, clients_per_round=K), registered=N)
    p = svc.privacy
    assert p.ddg is not None and (p.noise_shares, p.cohort) == (T, 10)
    # the noise is the OS's, not a seed's: the variance is checked over 20 empty rounds (12,200
    # coordinates, standard error 1.3%) to 5 standard errors, not over one round's 610 (7%)
    draws = []
    for r in range(7, 27):
        p.round_started([], r)
        agg = p.aggregator
        assert agg.topped_up and agg.missing_share_std() == 0.0
        released = agg.mean().double().numpy() * K  # the noise sum an empty round released
        rotation = DdgCodec(p.ddg, p.empty_rotation).rotation  # the round's secret, kept by the server
        steps = rotation.forward(released) / p.ddg.gamma
        assert np.abs(steps - np.round(steps)).max() < 0.01  # on the rotated integer lattice
        draws.append(steps * p.ddg.gamma)
    noise = np.concatenate(draws)
    var = float(np.mean(noise**2))  # K_max shares of sigma^2 = z^2 C^2 / t each, mean 0
    assert var == pytest.approx(10 * (Z * C) ** 2 / T, rel=5 * math.sqrt(2 / noise.size))
    first = p.empty_rotation
    p.round_started([f"n{i}" for i in range(4)], 27)
    assert p.empty_rotation != first  # a fresh secret every round
    agg.add(torch.zeros(agg.numel))
    assert agg.missing_share_std() == 0.0
