"""Secure aggregation inside the in-process simulator."""

import math

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.simulations.inprocess import InProcessSimulation


def cfg(*extra):
    return load_config(
        None, ["simulation.rounds=2", "simulation.num_clients=12", "simulation.clients_per_round=6", *extra]
    )


def test_secure_round_matches_plain_fedavg_within_the_quantization_bound():
    plain = InProcessSimulation.from_config(cfg())
    secure = InProcessSimulation.from_config(cfg("secure_aggregation.enabled=true", "secure_aggregation.bits=20"))
    g0 = plain.global_params.clone()
    assert torch.equal(g0, secure.global_params)
    a, b = plain.run_round(), secure.run_round()
    assert b.num_results == a.num_results == 6 and b.num_examples == a.num_examples
    assert not torch.equal(secure.global_params, g0)
    sa = secure.secure_aggregation
    # mean = (S + e_S) / (W + e_W) with |e_S| <= K q_values, |e_W| <= K q_weights (K = 6 summands)
    w = a.num_examples / sa.max_weight
    mean = (plain.global_params - g0).abs().max().item()
    e_s, e_w = sa.values.error_bound(6), sa.weights.error_bound(6)
    bound = (e_s + mean * e_w) / (w - e_w) + 1e-6  # + float32 rounding of the parameters
    err = (secure.global_params - plain.global_params).abs().max().item()
    assert 0 < err <= bound
    assert secure.secure_aggregation.last["included"] == 6


def test_secagg_plus_with_dropouts_aggregates_the_survivors_only():
    sim = InProcessSimulation.from_config(
        cfg(
            "secure_aggregation.enabled=true",
            "secure_aggregation.graph='secagg+'",
            "secure_aggregation.degree=4",
            "secure_aggregation.threshold=0.5",
            "secure_aggregation.dropout_masked=0.2",
            "secure_aggregation.seed=1",
        )
    )
    summaries = [sim.run_round() for _ in range(2)]
    last = sim.secure_aggregation.last
    assert "aborted" not in last and last["dropped"] > 0
    assert summaries[-1].num_results == last["included"] == 6 - last["dropped"]
    assert summaries[-1].version == 2


def test_an_aborted_round_applies_nothing_and_the_next_round_runs():
    sim = InProcessSimulation.from_config(
        cfg("secure_aggregation.enabled=true", "secure_aggregation.dropout_share=1.0")
    )
    g0 = sim.global_params.clone()
    s = sim.run_round()
    assert s.num_results == 0 and s.version == 0 and math.isnan(s.train_loss)
    assert "fewer" in sim.secure_aggregation.last["aborted"] or "threshold" in sim.secure_aggregation.last["aborted"]
    assert torch.equal(sim.global_params, g0)
    sim.cfg.secure_aggregation.dropout_share = 0.0
    assert sim.run_round().version == 1


def test_no_headroom_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match="bits = 31 with 6 clients needs a 34-bit modulus.*at most 29"):
        InProcessSimulation.from_config(cfg("secure_aggregation.enabled=true", "secure_aggregation.bits=31"))
    with pytest.raises(ConfigError, match="secure_aggregation.graph"):
        cfg("secure_aggregation.graph='ring'")


def test_same_config_same_numbers():
    extra = ("secure_aggregation.enabled=true", "secure_aggregation.dropout_masked=0.2")

    def final(seed):
        sim = InProcessSimulation.from_config(cfg(*extra, f"secure_aggregation.seed={seed}"))
        sim.run_round()
        return sim.global_params.clone()

    a, b, c = final(1), final(1), final(2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
