"""The accountant (dp-accounting) against Abadi et al. 2016, and the per-round budgets."""

import json

import pytest

from shoal.accounting import epsilon
from shoal.accounting_dpsgd import LocalDpSgdAccountant, dp_sgd_schedule
from shoal.accounting_rounds import RoundAccountant

# Abadi et al. 2016, Section 5 / Fig. 2: q = 0.01, sigma = 4, delta = 1e-5; the moments
# accountant gives epsilon = 1.26 after 10,000 steps and 2.55 after 40,000.
ABADI = [(10_000, 1.26), (40_000, 2.55)]


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize("steps,paper", ABADI)
def test_abadi_setting_is_at_most_the_moments_accountant(kind, steps, paper):
    eps = epsilon(0.01, 4.0, steps, 1e-5, kind)
    assert eps <= 1.05 * paper
    assert eps < paper  # RDP and PLD are tighter than the 2016 moments accountant
    assert eps > 0.5 * paper  # and not absurdly small


@pytest.mark.slow
def test_epsilon_grows_with_rounds_and_falls_with_noise():
    a = RoundAccountant(q=0.1, noise_multiplier=1.0, delta=1e-5)
    assert a.epsilon == 0.0
    prev = 0.0
    for _ in range(5):
        nxt = a.next_epsilon()
        a.record_round(["c"])
        assert a.epsilon == nxt > prev
        prev = a.epsilon
    assert RoundAccountant(0.1, 2.0, 1e-5).epsilon_after(5) < prev
    assert epsilon(0.1, 0.0, 3, 1e-5) == float("inf")


@pytest.mark.slow
def test_local_accountant_is_the_worst_client_over_its_participations():
    sched = {"a": dp_sgd_schedule(100, 10, 2), "b": dp_sgd_schedule(50, 10, 2)}
    assert sched["a"] == (0.1, 20) and sched["b"] == (0.2, 10)
    acc = LocalDpSgdAccountant(sched, noise_multiplier=1.0, delta=1e-5)
    assert acc.epsilon == 0.0
    worst_next = acc.next_epsilon()
    acc.record_round(["a"])
    assert acc.epsilon == epsilon(0.1, 1.0, 20, 1e-5)
    assert acc.epsilon <= worst_next
    acc.record_round(["a"])
    acc.record_round(["b"])
    assert acc.epsilon == max(epsilon(0.1, 1.0, 40, 1e-5), epsilon(0.2, 1.0, 10, 1e-5))
    assert acc.next_epsilon() >= max(epsilon(0.1, 1.0, 60, 1e-5), epsilon(0.2, 1.0, 20, 1e-5))


@pytest.mark.slow
def test_fixed_size_sampling_is_replace_one_with_sensitivity_2c():
    """K of N without replacement: dp-accounting's replace-one RDP event at multiplier z/2 (replacing one
    clipped update moves the sum by up to 2C); never below the Poisson figure for the same q."""
    import dp_accounting
    from dp_accounting import rdp

    from shoal.accounting import epsilon_fixed_size

    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(100, 10, dp_accounting.GaussianDpEvent(0.75)), 50
        )
    )
    assert epsilon_fixed_size(100, 10, 1.5, 50, 1e-5) == pytest.approx(acc.get_epsilon(1e-5))
    for n, k, z in [(10, 5, 1.0), (100, 10, 1.5), (1000, 50, 3.0)]:
        assert epsilon_fixed_size(n, k, z, 20, 1e-5) > epsilon(k / n, z, 20, 1e-5)
    fixed = RoundAccountant(0.5, 1.0, 1e-5, sampling="fixed", num_clients=10, sample_size=5)
    assert fixed.epsilon_after(15) == pytest.approx(60.27, abs=0.05) and "replace-one" in fixed.describe()
    assert "Poisson" in RoundAccountant(0.5, 1.0, 1e-5).describe()
    with pytest.raises(ValueError, match="RDP only"):
        RoundAccountant(0.5, 1.0, 1e-5, "pld", sampling="fixed", num_clients=10, sample_size=5)


@pytest.mark.slow
def test_round_ledger_composes_rounds_of_different_mechanisms_as_they_ran():
    """Rounds charged at (q, z) = (0.1, 1.0), then at (0.2, 2.0): the ledger keeps both, survives
    state_dict / load_state_dict, and its epsilon is the composition dp-accounting gives."""
    import dp_accounting
    from dp_accounting import rdp

    acc = RoundAccountant(0.1, 1.0, 1e-5, clip=1.0)
    for _ in range(5):
        acc.record_round([])
    acc.set_mechanism(0.2, 2.0, clip=0.5)
    for _ in range(3):
        acc.record_round([])
    assert acc.rounds == 8 and [(e["q"], e["z"], e["clip"], e["rounds"]) for e in acc.ledger] == [
        (0.1, 1.0, 1.0, 5),
        (0.2, 2.0, 0.5, 3),
    ]
    ref = rdp.RdpAccountant()
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 5)
    ref.compose(dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(2.0)), 3)
    assert acc.epsilon == pytest.approx(ref.get_epsilon(1e-5), rel=1e-6)
    restored = RoundAccountant(0.2, 2.0, 1e-5, clip=0.5)
    restored.load_state_dict(json.loads(json.dumps(acc.state_dict())))
    assert restored.epsilon == pytest.approx(acc.epsilon) and restored.next_epsilon() > restored.epsilon
    with pytest.raises(ValueError):
        restored.load_state_dict({"ledger": [{"q": 0.1}]})


def test_both_round_accountants_share_one_ledger_and_compose_each_others_poisson_rounds():
    """A restart that switches between the continuous and the discrete Gaussian keeps every charged
    round as it ran and composes both in RDP (curves added order by order); fixed-size rounds,
    whose neighbouring relation differs, are refused with the reason."""
    from shoal.accounting import LEDGER_ORDERS as DDG_ORDERS
    from shoal.accounting import rdp_to_epsilon
    from shoal.accounting_rounds import DdgRoundAccountant, LedgerMismatch, RoundLedger, mixed_ledger_epsilon
    from shoal.aggregation.discrete_gaussian import plan

    p = plan(1000, 1.0, 1.0, 4, 10, 16)
    params = {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}
    ddg = DdgRoundAccountant(0.2, params, 1e-5)
    gauss = RoundAccountant(0.2, 1.0, 1e-5, clip=1.0)
    assert isinstance(ddg, RoundLedger) and isinstance(gauss, RoundLedger)
    for acc in (ddg, gauss):
        for _ in range(4):
            acc.record_round([])
        again = type(acc).__new__(type(acc))
        again.__dict__.update({**acc.__dict__, "ledger": []})
        again.load_state_dict(json.loads(json.dumps(acc.state_dict())))
        assert again.rounds == 4 and again.epsilon == pytest.approx(acc.epsilon)

    # 4 continuous rounds, then a restart with the discrete Gaussian and 4 more
    switched = DdgRoundAccountant(0.2, params, 1e-5)
    switched.load_state_dict(json.loads(json.dumps(gauss.state_dict())))
    assert switched.rounds == 4 and switched.epsilon > gauss.epsilon * 0.999  # priced in RDP: >= a hair below PLD
    for _ in range(4):
        switched.record_round([])
    gauss_rdp = mixed_ledger_epsilon([{**gauss._current(), "rounds": 4}], 1e-5)
    assert gauss_rdp == pytest.approx(gauss.epsilon, rel=0.02)  # the same rounds in RDP at integer orders
    by_hand = rdp_to_epsilon(
        DDG_ORDERS,
        [4 * a + 4 * b for a, b in zip(RoundAccountant_rdp(0.2, 1.0), ddg.rdp_curve(ddg.ledger[0]), strict=True)],
        1e-5,
    )
    assert switched.epsilon == pytest.approx(by_hand)
    assert max(gauss.epsilon, ddg.epsilon) < switched.epsilon < gauss.epsilon + ddg.epsilon
    assert "4 earlier rounds of the other Gaussian mechanism, composed with these in RDP" in switched.describe()
    # and the other way: a ledger of discrete-Gaussian rounds under the continuous accountant
    back = RoundAccountant(0.2, 1.0, 1e-5, clip=1.0)
    back.load_state_dict(json.loads(json.dumps(switched.state_dict())))
    assert back.epsilon == pytest.approx(switched.epsilon) and back.next_epsilon() > back.epsilon

    fixed = RoundAccountant(0.2, 1.0, 1e-5, sampling="fixed", num_clients=10, sample_size=2, clip=1.0)
    fixed.record_round([])
    with pytest.raises(LedgerMismatch, match=r"records 1 rounds of the continuous Gaussian \(fixed sampling"):
        ddg.load_state_dict(fixed.state_dict())
    with pytest.raises(LedgerMismatch, match=r"records 4 rounds of the distributed discrete Gaussian"):
        fixed.load_state_dict(ddg.state_dict())
    with pytest.raises(LedgerMismatch, match="an unknown mechanism 'laplace'"):
        ddg.load_state_dict({"ledger": [{"mechanism": "laplace", "q": 0.1, "rounds": 2}]})
    with pytest.raises(ValueError, match="without its charged rounds"):
        ddg.load_state_dict({"ledger": "nothing"})


def RoundAccountant_rdp(q: float, z: float) -> list[float]:
    """One Poisson-subsampled Gaussian round's RDP at DDG_ORDERS, from dp-accounting directly."""
    import dp_accounting

    from shoal.accounting import LEDGER_ORDERS as DDG_ORDERS

    acc = dp_accounting.rdp.RdpAccountant(orders=[float(a) for a in DDG_ORDERS])
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    return list(acc.rdp)


def test_a_configured_local_sampling_rate_makes_the_schedule_independent_of_the_data():
    from shoal.accounting_dpsgd import dp_sgd_schedule

    assert dp_sgd_schedule(40, 8, 2) == (0.2, 10) and dp_sgd_schedule(41, 8, 2) != (0.2, 10)
    assert {dp_sgd_schedule(n, 8, 2, rate=0.2) for n in (5, 40, 41, 10_000)} == {(0.2, 10)}
    assert dp_sgd_schedule(7, 8, 1, rate=0.03) == (0.03, 33)


def test_rdp_figures_from_cached_curves_equal_dp_accountings_accountant_exactly():
    """Each mechanism's RDP curve is computed once and scaled by its count: the figures are the
    ones a fresh dp-accounting RDP accountant gives for the whole event, to the last bit."""
    import dp_accounting
    from dp_accounting import rdp

    from shoal.accounting import epsilon_fixed_size, epsilon_of_segments, fixed_size_gaussian, subsampled_gaussian

    def fresh(event, replace_one=False):
        relation = dp_accounting.NeighboringRelation.REPLACE_ONE if replace_one else None
        acc = rdp.RdpAccountant(neighboring_relation=relation) if relation else rdp.RdpAccountant()
        acc.compose(event)
        return acc.get_epsilon(1e-5)

    for q, z, steps in [(0.1, 1.0, 100), (0.01, 1.1, 1000), (1.0, 0.8, 7), (0.5, 0.5, 3)]:
        assert epsilon(q, z, steps, 1e-5) == fresh(subsampled_gaussian(q, z, steps))
    assert epsilon_fixed_size(20, 5, 2.0, 10, 1e-5) == fresh(fixed_size_gaussian(20, 5, 2.0, 10), replace_one=True)
    segments = (
        ("poisson", 0.1, 1.0, 100, 10, 30),
        ("poisson", 0.2, 1.5, 100, 20, 40),
        ("poisson", 0.1, 1.0, 100, 10, 5),
    )
    composed = dp_accounting.ComposedDpEvent(
        [subsampled_gaussian(0.1, 1.0, 30), subsampled_gaussian(0.2, 1.5, 40), subsampled_gaussian(0.1, 1.0, 5)]
    )
    assert epsilon_of_segments(segments, 1e-5, "rdp") == pytest.approx(fresh(composed), rel=1e-12)
