"""One privacy plan per config, and one accountant interface (state_dict / load_state_dict)."""

import pytest

from shoal.accounting_dpsgd import LocalDpSgdAccountant, dp_sgd_schedule
from shoal.accounting_rounds import RoundAccountant
from shoal.config import load_config
from shoal.privacy_plan import PrivacyPlan, combined_multiplier, plan_of


@pytest.mark.parametrize(
    ("mode", "flags"),
    [
        ("none", (False, False, False, False, False)),
        ("central", (True, True, True, False, False)),
        ("distributed", (True, True, False, True, False)),
        ("local", (True, False, False, False, True)),
    ],
)
def test_the_plan_says_who_adds_the_noise(mode, flags):
    plan = plan_of(load_config(None, [f'privacy.mode="{mode}"']))
    assert (plan.enabled, plan.user_level, plan.server_noise, plan.client_shares, plan.dp_sgd) == flags
    assert plan.round_sampling == ("poisson" if plan.user_level else "fixed")
    assert plan.withholds == plan.enabled and plan.client_evaluations == (not plan.enabled)
    assert plan.accounted_z == plan.noise_multiplier  # withhold: nothing else is charged


def test_noised_release_charges_every_round_at_the_combined_multiplier():
    plan = plan_of(load_config(None, ['privacy.mode="central"', 'privacy.release="noised"']))
    assert plan.accounted_z == pytest.approx(combined_multiplier(1.0, 5.0)) == pytest.approx((1 + 2 / 25) ** -0.5)
    acc = plan.round_accountant(0.1)
    assert isinstance(acc, RoundAccountant) and acc.z == plan.accounted_z


def test_records_keep_the_model_on_held_out_data_and_the_guarantee():
    rec = {"round": 3, "test_accuracy": 0.9, "train_loss": 0.2, "num_examples": 50, "fed_accuracy": 0.8, "epsilon": 2.0}
    assert PrivacyPlan(mode="central").release_record(rec) == {
        "round": 3,
        "test_accuracy": 0.9,
        "epsilon": 2.0,
        "release": "withhold",
    }
    assert PrivacyPlan(mode="central", release="clear").release_record(rec) == {**rec, "release": "clear"}
    assert PrivacyPlan().release_record(rec) == rec  # no DP: nothing to withhold


def test_both_accountants_restore_from_their_state_dict():
    r = RoundAccountant(0.2, 1.0, 1e-5)
    for _ in range(3):
        r.record_round([])
    again = RoundAccountant(0.2, 1.0, 1e-5)
    again.load_state_dict(r.state_dict())
    assert again.epsilon == r.epsilon and again.rounds == 3

    schedules = {"a": dp_sgd_schedule(40, 10, 1), "b": dp_sgd_schedule(80, 10, 1)}
    local = LocalDpSgdAccountant(schedules, 1.0, 1e-5)
    local.record_round(["a", "b", "a"])
    restored = LocalDpSgdAccountant(schedules, 1.0, 1e-5)
    restored.load_state_dict(local.state_dict())
    assert restored.rounds_of("a") == 2 and restored.epsilon == local.epsilon
    # charged for another schedule or noise: cannot be composed, refused with the numbers
    with pytest.raises(ValueError, match="z = 1.0"):
        LocalDpSgdAccountant(schedules, 2.0, 1e-5).load_state_dict(local.state_dict())
    with pytest.raises(ValueError, match="schedules"):
        LocalDpSgdAccountant({"a": dp_sgd_schedule(41, 10, 1)}, 1.0, 1e-5).load_state_dict(local.state_dict())
