"""The distributed discrete Gaussian: the exact sampler, the codec under real secure aggregation,
the noise of the unmasked sum, and the accounting against the paper's bound computed here."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from shoal.accounting_aborts import abort_branches
from shoal.accounting_rounds import DdgRoundAccountant
from shoal.aggregation import discrete_gaussian as dg
from shoal.aggregation.secagg import SecAggParams
from shoal.aggregation.secagg.memory import run_in_memory
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.noise import NoiseSource
from shoal.seeding import derive_seed
from shoal.simulations.inprocess import InProcessSimulation


def test_bernoulli_exp_matches_exp_of_the_ratio():
    src = NoiseSource.seeded(1)
    n = 200_000
    for num, den in ((0, 1), (1, 3), (3, 2), (7, 2)):
        hits = dg.bernoulli_exp(src, np.full(n, num), np.full(n, den)).mean()
        p = math.exp(-num / den)
        assert abs(hits - p) <= 5 * math.sqrt(p * (1 - p) / n) + 1e-12, (num, den, hits, p)


def test_bernoulli_exp_with_a_den_per_entry_and_dens_beyond_int64_products():
    src = NoiseSource.seeded(5)
    n = 200_000
    den = np.where(np.arange(n) % 2 == 0, 3, 5)  # two dens in one call: each entry its own
    hits = dg.bernoulli_exp(src, np.full(n, 2), den)
    for d in (3, 5):
        p = math.exp(-2 / d)
        assert abs(hits[den == d].mean() - p) <= 5 * math.sqrt(p * (1 - p) / (n / 2)), d
    # den * k >= 2^62 (the largest variances' third acceptance test): U k + V, still exact
    big = 1 << 61
    for k in (1, 3):
        num = np.full(n, big // 2 + 12345)
        p = (big // 2 + 12345) / (big * k)
        hits = dg._bernoulli_ratio(src, num, big, k).mean()
        assert abs(hits - p) <= 5 * math.sqrt(p * (1 - p) / n), k
    p = math.exp(-0.75)
    hits = dg.bernoulli_exp(src, np.full(n, 3 * (big // 4)), big).mean()
    assert abs(hits - p) <= 5 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("variance", [1, 3])
def test_small_variance_samples_follow_the_exact_pmf(variance):
    src = NoiseSource.seeded(2, variance)
    n = 200_000
    x = dg.sample(src, variance, n)
    support = np.arange(-12, 13)
    pmf = np.exp(-(support**2) / (2 * variance))
    pmf /= pmf.sum()  # the mass beyond |12| is below 1e-10 for these variances
    counts = np.array([(x == k).sum() for k in support])
    assert counts.sum() == n
    big = pmf * n > 50
    chi2 = float((((counts - pmf * n) ** 2) / (pmf * n))[big].sum())
    assert chi2 < 3 * big.sum(), chi2  # chi-square with ~|support| dof: mean = dof, far below 3x


def test_large_variance_moments():
    src = NoiseSource.seeded(3)
    a = 640_000
    x = dg.sample(src, a, 100_000).astype(np.float64)
    assert abs(x.mean()) < 5 * math.sqrt(a / x.size)
    assert abs(x.var() / a - 1) < 0.03


def test_rotation_is_orthogonal_for_any_dimension():
    for d in (1, 7, 64, 1000):
        r = dg.Rotation(d, seed=5)
        x = np.random.default_rng(d).normal(size=d)
        y = r.forward(x)
        assert np.isclose(np.linalg.norm(y), np.linalg.norm(x))
        assert np.allclose(r.inverse(y), x)
    spike = np.zeros(1024)
    spike[3] = 1.0
    assert np.abs(dg.Rotation(1024, seed=1).forward(spike)).max() == pytest.approx(1 / 32)  # flattened


def _secure_sum(encoded: dict[str, np.ndarray], drop: dict[str, str] | None = None):
    n = next(iter(encoded.values())).size
    params = SecAggParams(session=b"ddg-test", vector_size=n, graph="full", threshold_fraction=0.5)
    result, _ = run_in_memory(params, encoded, drop, seed=11)
    return result


def test_unmasked_result_equals_the_plain_quantized_sum():
    d, n = 300, 6
    p = dg.plan(d, clip=1.0, noise_multiplier=1.0, shares=4, max_summands=n, bits=16)
    codec = dg.DdgCodec(p, rotation_seed=99)
    rng = np.random.default_rng(0)
    updates = {f"c{i}": rng.normal(size=d) * (0.2 if i % 2 else 3.0) for i in range(n)}  # half get clipped
    ints = {c: codec.integers(x, NoiseSource.seeded(7, i)) for i, (c, x) in enumerate(updates.items())}
    result = _secure_sum({c: codec.reduce(v) for c, v in ints.items()}, drop={"c5": "masked"})
    assert sorted(result.included) == [f"c{i}" for i in range(5)]
    plain = sum(ints[c] for c in result.included)
    assert np.array_equal(codec.decode(result.total), codec.rotation.inverse(plain * p.gamma))
    # and that is the clipped sum plus noise: with z = 0 it is the clipped sum within the rounding
    quiet = dg.DdgCodec(dg.plan(d, 1.0, 0.0, 4, n, 16), rotation_seed=99)
    enc = {c: quiet.encode(x, NoiseSource.seeded(8, i)) for i, (c, x) in enumerate(updates.items())}
    clipped = sum(x * min(1.0, 1.0 / np.linalg.norm(x)) for x in updates.values())
    err = np.linalg.norm(quiet.decode(_secure_sum(enc).total) - clipped)
    assert err <= n * quiet.p.gamma * math.sqrt(d)  # each rounding moves a vector by < gamma sqrt(d)


def test_noise_of_the_unmasked_sum_matches_the_analysis():
    d, t, n, z, c = 20_000, 4, 5, 1.0, 1.0
    p = dg.plan(d, clip=c, noise_multiplier=z, shares=t, max_summands=n, bits=18)
    codec = dg.DdgCodec(p, rotation_seed=3)
    rng = np.random.default_rng(1)
    updates = [rng.normal(size=d) for _ in range(n)]
    enc = {f"c{i}": codec.encode(x, NoiseSource.seeded(9, i)) for i, x in enumerate(updates)}
    noise = codec.decode(_secure_sum(enc).total) - sum(x / np.linalg.norm(x) for x in updates)
    expected = n * p.variance * p.gamma**2  # n shares of sigma^2 = variance gamma^2 each
    assert expected >= n / t * (z * c) ** 2  # at least z^2 C^2 whenever t or more shares arrive
    rounding = n * p.gamma**2 / 4  # unbiased rounding adds at most gamma^2/4 per coordinate and client
    assert abs(noise.mean()) < 5 * math.sqrt(expected / d)
    assert abs(noise.var() / expected - 1) < 5 * math.sqrt(2 / d) + rounding / expected


def test_the_server_tops_the_sum_up_in_the_integers():
    """DdgCodec.top_up adds whole draws of a client's integer noise to the unmasked sum (modulo 2^bits):
    3 survivors topped up to K_max = 8 carry 8 shares, and the sum stays on the integers."""
    d, t, kmax = 20_000, 3, 8
    p = dg.plan(d, clip=1.0, noise_multiplier=1.0, shares=t, max_summands=kmax, bits=18)
    codec = dg.DdgCodec(p, rotation_seed=5)
    enc = {f"c{i}": codec.encode(np.zeros(d), NoiseSource.seeded(12, i)) for i in range(t)}
    total = _secure_sum(enc).total
    topped = codec.top_up(total, kmax - t, NoiseSource.seeded(13))
    assert topped.dtype == np.int64 and topped.shape == (d,) and ((0 <= topped) & (topped < p.modulus)).all()
    centred = np.where(topped >= p.modulus // 2, topped - p.modulus, topped)
    assert abs(centred.var() / (kmax * p.variance) - 1) < 5 * math.sqrt(2 / d)
    assert np.array_equal(codec.top_up(total, 0, NoiseSource.seeded(13)), np.mod(total[:d].astype(np.int64), p.modulus))


def _paper_epsilon(c, gamma, beta, d, var_int, n, delta, release_z=0.0):
    """Theorem 1 of Kairouz, Liu, Steinke (2021), written out afresh: one round, no sampling;
    ``release_z``: plus two Gaussian queries of multiplier release_z (RDP a / (2 z^2) each)."""
    d2 = min(
        c**2 + gamma**2 * d / 4 + math.sqrt(2 * math.log(1 / beta)) * gamma * (c + gamma * math.sqrt(d) / 2),
        (c + gamma * math.sqrt(d)) ** 2,
    )
    sigma2 = var_int * gamma**2
    tau = 10 * sum(math.exp(-2 * math.pi**2 * sigma2 / gamma**2 * k / (k + 1)) for k in range(1, n))
    best = math.inf
    for a in range(2, 257):
        r = min(a * d2 / (2 * n * sigma2) + tau * d, a / 2 * (math.sqrt(d2 / (n * sigma2)) + tau * math.sqrt(d)) ** 2)
        r += 2 * a / (2 * release_z**2) if release_z else 0.0
        best = min(best, r + math.log((a - 1) / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return best


@pytest.mark.parametrize("variance", [1, 2, 10**5])
def test_epsilon_per_round_is_the_papers_bound(variance):
    d, n, gamma, c, beta = 1000, 8, 0.01, 1.0, math.exp(-0.5)
    p = dg.DdgParams(d, c, gamma, 16, beta, variance, n, n)
    acc = DdgRoundAccountant(1.0, {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}, 1e-5)
    one = acc.next_epsilon()
    assert one == pytest.approx(_paper_epsilon(c, gamma, beta, d, variance, n, 1e-5), rel=1e-9)
    acc.record_round()
    assert acc.epsilon == one and acc.rounds == 1


def test_noised_round_figures_are_charged_with_the_discrete_gaussian():
    """privacy.release = "noised": the round's count and loss (multiplier 5 each) compose with the sum
    before sampling: unsampled, the paper's bound plus a / 25 at every order; sampled, more than
    without the figures; the ledger keeps sigma, and an older ledger without it counts none."""
    d, n, gamma, c, beta = 1000, 8, 0.01, 1.0, math.exp(-0.5)
    p = dg.DdgParams(d, c, gamma, 16, beta, 10**5, n, n)
    ddg = {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}
    noised = DdgRoundAccountant(1.0, ddg, 1e-5, release_z=5.0)
    assert noised.next_epsilon() == pytest.approx(_paper_epsilon(c, gamma, beta, d, 10**5, n, 1e-5, 5.0), rel=1e-9)
    assert noised.next_epsilon() > DdgRoundAccountant(1.0, ddg, 1e-5).next_epsilon()
    sampled, plain = DdgRoundAccountant(0.2, ddg, 1e-5, 5.0), DdgRoundAccountant(0.2, ddg, 1e-5)
    for acc in (sampled, plain):
        for _ in range(3):
            acc.record_round()
    assert sampled.epsilon > plain.epsilon and "noised result count" in sampled.describe()
    assert sampled.state_dict()["ledger"][0]["release_z"] == 5.0
    older = plain.state_dict()
    for e in older["ledger"]:
        del e["release_z"]
    restored = DdgRoundAccountant(0.2, ddg, 1e-5, 5.0)
    restored.load_state_dict(older)
    assert restored.epsilon == pytest.approx(plain.epsilon)  # its rounds priced as they ran
    assert restored.next_epsilon() > plain.next_epsilon()


def test_with_negligible_tau_it_is_the_gaussian_of_the_same_sensitivity():
    # dp-accounting (independent code) on the Gaussian with z = sqrt(n sigma^2) / Delta_2, same orders
    p = dg.plan(5000, 1.0, 1.2, 6, 9, 20)
    acc = DdgRoundAccountant(1.0, {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}, 1e-6)
    for _ in range(5):
        acc.record_round()
    z = math.sqrt(p.shares * p.client_std**2 / p.sensitivity_sq())
    ref = rdp.RdpAccountant(orders=list(range(2, 257)))
    ref.compose(dp_accounting.GaussianDpEvent(z), 5)
    assert acc.epsilon == pytest.approx(ref.get_epsilon(1e-6), rel=1e-6)
    # Poisson sampling: the general (Zhu-Wang) amplification bound is above the Gaussian's exact one
    sampled = DdgRoundAccountant(0.1, acc.ddg, 1e-6)
    ref = rdp.RdpAccountant(orders=list(range(2, 257)))
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(z)), 5)
    assert ref.get_epsilon(1e-6) <= sampled.epsilon_after(5) < acc.epsilon


def test_ledger_round_trip_and_restart_composes_as_run():
    p = dg.plan(500, 1.0, 1.0, 4, 6, 16)
    ddg = {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}
    a = DdgRoundAccountant(0.2, ddg, 1e-5)
    for _ in range(3):
        a.record_round()
    b = DdgRoundAccountant(0.2, {**ddg, "variance": ddg["variance"] * 16}, 1e-5)  # restarted with 4x the std
    b.load_state_dict(a.state_dict())
    assert b.epsilon == pytest.approx(a.epsilon)
    b.record_round()
    assert a.epsilon < b.epsilon < a.epsilon_after(1)
    with pytest.raises(ValueError):
        b.load_state_dict({"ledger": [{"mechanism": "gaussian", "rounds": 1}]})


def test_bad_combinations_are_refused_with_the_numbers():
    with pytest.raises(dg.DdgConfigError, match=r"raise privacy.bits to at least \d+"):
        dg.plan(1000, 1.0, 1.0, 4, 8, 12, gamma=1e-5)
    with pytest.raises(dg.DdgConfigError, match=r"inflates the sensitivity C = 1 to Delta_2 = "):
        dg.plan(200_000, 1.0, 1.0, 4, 50, 8)
    with pytest.raises(ConfigError, match="set secure_aggregation.enabled = true"):
        load_config(None, ['privacy.mode="distributed"', 'privacy.mechanism="discrete_gaussian"'])
    with pytest.raises(ConfigError, match="privacy.mode = 'distributed'"):
        load_config(None, ['privacy.mode="central"', 'privacy.mechanism="discrete_gaussian"'])


def ddg_simulation(rounds: int, *settings: str) -> InProcessSimulation:
    """12 clients, 6 a round, secure distributed DP with the discrete Gaussian (z = 0.8), a seeded
    selection (an OS-drawn one may abort every round: too few)."""
    cfg = load_config(
        None,
        [
            f"simulation.rounds={rounds}",
            "simulation.num_clients=12",
            "simulation.clients_per_round=6",
            "secure_aggregation.enabled=true",
            'privacy.mode="distributed"',
            'privacy.mechanism="discrete_gaussian"',
            "privacy.noise_multiplier=0.8",
            "privacy.reproducible=true",
            *settings,
        ],
    )
    return InProcessSimulation.from_config(cfg)


def rotated_steps(sim: InProcessSimulation, round_: int, before: torch.Tensor) -> np.ndarray:
    """The round's released sum (K = 6 times FedAvg's step from ``before``) in the round's rotation,
    in units of the lattice step gamma: integers when the release lies on the rotated lattice."""
    sa, cfg = sim.secure_aggregation, sim.cfg
    assert sa is not None and sa.ddg is not None
    seed = derive_seed(cfg.secure_aggregation.seed, cfg.simulation.seed, round_)
    rotation = dg.DdgCodec(sa.ddg, derive_seed(seed, 0x40D)).rotation
    return rotation.forward((sim.global_params.double() - before).numpy() * 6) / sa.ddg.gamma


@pytest.mark.parametrize("release", ["withhold", "noised"])
def test_simulated_rounds_use_the_mechanism_and_its_accountant(release):
    sim = ddg_simulation(2, f'privacy.release="{release}"')
    sa = sim.secure_aggregation
    assert sa is not None and sa.ddg is not None and sa.ddg.shares == sa.noise_shares
    assert not any(type(s).__name__ == "DistributedNoise" for s in sim.client_steps)
    g0 = sim.global_params.clone()
    summaries = []
    for _ in range(2):
        before = sim.global_params.clone().double()
        summaries.append(sim.run_round())
        # The released sum (K times FedAvg's step) lies on the round's rotated lattice although fewer
        # than K_max = 12 survived: the server tops it up to K_max shares in the integers. Topped up
        # with continuous noise, only a round of all K_max would lie on it, and tell itself apart.
        assert 0 < sa.last["included"] < sa.max_summands == 12
        steps = rotated_steps(sim, summaries[-1].round, before)
        assert np.abs(steps - np.round(steps)).max() < 0.01
    assert not bool((sim.global_params == g0).all())
    acc = sim.privacy.accountant
    assert isinstance(acc, DdgRoundAccountant) and acc.rounds == 2
    release_z = 5.0 if release == "noised" else 0.0  # privacy.release_noise_multiplier's default
    expected = DdgRoundAccountant(0.5, {**sa.ddg.as_dict(), "sensitivity_sq": sa.ddg.sensitivity_sq()}, 1e-5, release_z)
    # N = 12 at q = 1/2: an aborted round is released as an empty one, each round priced as the mixture
    expected.abort_branches = abort_branches(12, 0.5, sa.noise_shares, sa.max_summands)
    assert sim.privacy.epsilon == pytest.approx(expected.epsilon_after(2))
    figures = sim.privacy.round_figures(summaries[-1])
    assert ("num_results_noisy" in figures) == (release == "noised")
    if release == "noised":
        assert figures["num_results_noisy"] != summaries[-1].num_results
    assert "discrete Gaussian" in sim.privacy.summary()["accountant"]


def test_a_simulated_round_that_selects_nobody_releases_lattice_noise():
    """An empty round is the mechanism at n = 0: K_max integer shares decoded in the round's rotation,
    so its release lies on the rotated lattice like a round with updates (continuous noise would not)."""
    sim = ddg_simulation(1)
    sa = sim.secure_aggregation
    assert sa is not None and sa.ddg is not None
    sim.rounds.poisson_rate = 1e-12  # the Poisson draw selects nobody
    before = sim.global_params.clone().double()
    summary = sim.run_round()
    assert summary.num_selected == 0 and summary.version == 1  # released, like any round
    steps = rotated_steps(sim, summary.round, before)
    assert np.abs(steps - np.round(steps)).max() < 0.01
    var = float(np.var(steps)) * sa.ddg.gamma**2  # K_max = 12 shares of z^2 C^2 / t
    assert var == pytest.approx(12 * sa.ddg.variance * sa.ddg.gamma**2, rel=0.05)
    assert sim.privacy.accountant.rounds == 1  # charged like any round
