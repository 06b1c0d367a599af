"""DP-FedAvg aggregation: clipping bounds contributions, the noise has std z*C, adaptive C."""

import math

import pytest
import torch

from shoal.aggregation.dp import AdaptiveClipping, DPMean, clip_to_norm, make_dp_strategy, make_generator, noise_share
from shoal.config import PrivacyConfig, StrategyConfig
from shoal.errors import ConfigError
from shoal.update import Update


def test_clip_to_norm_bounds_and_keeps_small_vectors():
    big = torch.full((100,), 3.0)
    clipped, norm = clip_to_norm(big, 2.0)
    assert norm == pytest.approx(30.0)
    assert float(clipped.norm()) == pytest.approx(2.0, rel=1e-6)
    assert torch.allclose(clipped / clipped.norm(), big / big.norm())
    small = torch.full((100,), 0.01)
    assert torch.equal(clip_to_norm(small, 2.0)[0], small)


def test_each_contribution_is_bounded_by_the_clip_norm():
    """Sensitivity: adding any one update moves the noiseless sum by at most C."""
    torch.manual_seed(0)
    c = 0.5
    others = [torch.randn(1000) * s for s in (0.01, 1.0, 100.0)]
    agg = DPMean(1000, c, 0.0, expected_clients=1)
    for d in others:
        agg.add(d)
    without = agg.mean().double()
    agg.add(torch.randn(1000) * 1e6)  # an adversarially huge update
    with_it = agg.mean().double()
    assert float((with_it - without).norm()) <= c * (1 + 1e-5)
    assert agg.unclipped == 1  # only the 0.01-scale update was under C (norm ~0.32)
    with pytest.raises(ValueError, match="weights in"):
        agg.add(torch.zeros(1000), weight=5.0)


def test_central_noise_std_is_z_times_c_over_many_draws():
    z, c, m, numel = 1.3, 0.7, 4, 400_000
    agg = DPMean(numel, c, z, expected_clients=m, seed=1)
    agg.add(torch.zeros(numel))
    noise_sum = agg.mean().double() * m  # the sum's noise, before dividing by m
    assert float(noise_sum.mean()) == pytest.approx(0.0, abs=0.01)
    assert float(noise_sum.std()) == pytest.approx(z * c, rel=0.01)


def test_distributed_noise_shares_sum_to_the_central_noise():
    z, c, n, numel = 1.1, 2.0, 8, 200_000
    gen = make_generator("cpu", 3)
    shares = [noise_share(torch.zeros(numel), c, z, n, gen) for _ in range(n)]
    assert float(shares[0].std()) == pytest.approx(z * c / math.sqrt(n), rel=0.01)  # one share hides little
    total = torch.stack(shares).double().sum(0)
    assert float(total.std()) == pytest.approx(z * c, rel=0.01)
    # the server side divides the (clean) sum by n and adds nothing
    agg = DPMean(numel, None, 0.0, expected_clients=n)
    for s in shares:
        agg.add(s)
    assert torch.allclose(agg.mean().double(), total / n, atol=1e-6)


def test_adaptive_clipping_noise_split_and_quantile_tracking():
    a = AdaptiveClipping(target_quantile=0.5, lr=0.2, count_stddev=5.0)
    z = 1.0
    z_sum = a.sum_noise_multiplier(z)
    assert z_sum**-2 + (2 * a.count_stddev) ** -2 == pytest.approx(z**-2)  # Andrew et al. Thm 1
    with pytest.raises(ConfigError, match="clipped_count_stddev"):
        AdaptiveClipping(count_stddev=0.4).sum_noise_multiplier(1.0)
    # all update norms are 10: C must grow from 1 toward 10, geometrically
    agg = DPMean(10, 1.0, 0.0, expected_clients=20, seed=0, adaptive=AdaptiveClipping(0.5, 0.2, 1.0))
    cs = [agg.clip_norm]
    for _ in range(40):
        for _ in range(20):
            agg.add(torch.full((10,), 10 / math.sqrt(10)))
        agg.mean()
        agg.reset()
        cs.append(agg.clip_norm)
    assert cs[1] == pytest.approx(math.exp(0.1), rel=0.05)  # b̄ ~ 0: C *= exp(0.2 * 0.5)
    assert 7 < cs[-1] < 14  # hovers around the median norm, 10


def test_dp_strategy_weights_uniformly_and_keeps_the_server_optimizer():
    pc = PrivacyConfig(mode="central", noise_multiplier=0.0, clip_norm=1.0)
    s = make_dp_strategy(StrategyConfig(weighting="examples"), pc, numel=4, expected_clients=2)
    s.begin(torch.zeros(4))
    s.accumulate(Update(delta=torch.tensor([10.0, 0, 0, 0]), num_examples=1000))
    s.accumulate(Update(delta=torch.tensor([0.0, 0.5, 0, 0]), num_examples=1))
    assert torch.allclose(s.finalize(), torch.tensor([0.5, 0.25, 0.0, 0.0]))


def test_dp_strategy_releases_noise_for_an_empty_round_and_plain_mean_does_not():
    """Poisson sampling can pick nobody; the DP mean then releases N(0, z²C²)/m (it must look like any
    round), a noiseless DP mean has nothing to release."""
    from shoal.aggregation.mean import EmptyAggregate

    pc = PrivacyConfig(mode="central", noise_multiplier=1.5, clip_norm=2.0)
    s = make_dp_strategy(StrategyConfig(), pc, numel=100_000, expected_clients=5, seed=3)
    s.begin(torch.zeros(100_000))
    out = s.finalize().double()
    assert float(out.std()) == pytest.approx(1.5 * 2.0 / 5, rel=0.01)
    quiet = make_dp_strategy(StrategyConfig(), PrivacyConfig(mode="central", noise_multiplier=0.0), 10, 5)
    quiet.begin(torch.zeros(10))
    with pytest.raises(EmptyAggregate):
        quiet.finalize()
    dist = make_dp_strategy(
        StrategyConfig(), PrivacyConfig(mode="distributed", noise_multiplier=1.5, clip_norm=2.0), 100_000, 5, seed=4
    )
    dist.begin(torch.zeros(100_000))  # no share arrived: the server adds the whole N(0, z²C²)
    assert float(dist.finalize().double().std()) == pytest.approx(1.5 * 2.0 / 5, rel=0.01)
