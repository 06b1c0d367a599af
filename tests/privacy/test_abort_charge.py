"""What secure rounds' aborts cost under Poisson sampling (shoal.accounting_aborts): the failure
probability phi a round, its model (no dropouts: exact; injected dropouts: q; fixed-size: 0), and the
refusal of a run whose rounds take privacy.delta + T phi to 1/N."""

from __future__ import annotations

import pytest
from scipy.stats import binom

from shoal.accounting_aborts import abort_delta, simulated_abort_delta
from shoal.assembly import build
from shoal.config import load_config
from shoal.errors import ConfigError

REVIEWED = [  # N = 10, K = 5, t = 3, z = 1, 15 rounds: the configuration a review priced at ~6.0 with aborts
    "simulation.num_clients=10",
    "simulation.clients_per_round=5",
    "simulation.rounds=15",
    "secure_aggregation.enabled=true",
    'privacy.mode="distributed"',
    "privacy.noise_multiplier=1.0",
    "secure_aggregation.clip=6",  # C + 8 share stds
    "output.plots=false",
]


def test_phi_is_the_chance_a_sampled_client_meets_a_boundary():
    # m ~ Binomial(9, 1/2) others: m = t - 1 = 2 (abort without x, a sum of 3 with it) or m = 0
    assert abort_delta(10, 0.5, 3, 10) == pytest.approx(0.5 * (36 + 1) / 512)
    # the cap: with K_max = 6 of N = 10, 6 or more others push a round with x past it
    assert abort_delta(10, 0.5, 3, 6) == pytest.approx(0.5 * (binom.pmf(2, 9, 0.5) + 0.5**9 + binom.sf(5, 9, 0.5)))
    assert abort_delta(1000, 0.1, 50, 177) < 2e-10  # a large population makes a round of t - 1 improbable
    cfg = load_config(None, REVIEWED)
    assert simulated_abort_delta(cfg, 10, 0.5, 3, 10) == abort_delta(10, 0.5, 3, 10)
    dropped = load_config(None, [*REVIEWED, "secure_aggregation.dropout_masked=0.1"])
    assert simulated_abort_delta(dropped, 10, 0.5, 3, 10) == 0.5  # not bounded: x's whole sampling probability
    fixed = load_config(None, [*REVIEWED, 'privacy.sampling="fixed"'])
    assert simulated_abort_delta(fixed, 10, 0.5, 3, 5) == 0.0  # the sample's size does not depend on the data


def test_the_reviewed_configuration_is_refused_with_the_numbers_and_the_fix():
    with pytest.raises(ConfigError, match=r"0\.0361 a round.*15 rounds make delta = 0\.542 >= 1/N = 0\.1") as e:
        build(load_config(None, REVIEWED), None, "simulation")
    assert 'privacy.sampling = "fixed"' in str(e.value) and "more clients (N)" in str(e.value)
    parts = build(load_config(None, [*REVIEWED, 'privacy.sampling="fixed"']), None, "simulation")
    assert parts.secure is not None and parts.secure.abort_delta == 0.0
