"""The accountant (dp-accounting) against Abadi et al. 2016, and the per-round budgets."""

import pytest

from shoal.accounting import LocalDpSgdAccountant, RoundAccountant, dp_sgd_schedule, epsilon

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
