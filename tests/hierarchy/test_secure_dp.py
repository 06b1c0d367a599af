"""Distributed DP through edges with secure aggregation, in the simulator: each client's noise share
is sized for t survivors of the whole cohort and masked before it leaves the client (an edge adds
masked vectors only); the root counts the clients inside the edges' masked sums for t, so the
accountant is flat's and the sum carries the noise the analysis says; a lost edge that takes the
survivors below t aborts the round with nothing released."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.aggregation.dp import share_std
from shoal.aggregation.secagg.encoding import noise_range
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.simulations.hierarchy import HierarchicalRound
from shoal.simulations.inprocess import InProcessSimulation

from ..simulations.test_privacy_sound import BASE as FLAT_BASE  # the 2NN's 54,410 coordinates: a std to +-0.6%

BASE = [
    *FLAT_BASE,  # noisy and noiseless runs select the same clients and draw the same noise
    "simulation.batch_clients=1",
    'privacy.mode="distributed"',
    'privacy.sampling="fixed"',
    "secure_aggregation.enabled=true",
    "secure_aggregation.bits=20",
]
Z, C, T = 3.0, 1.0, 3  # 5 clients, full graph, threshold 0.5: t = floor(2.5) + 1
CLIP = f"secure_aggregation.clip={noise_range(C, share_std(C, Z, T))}"


def one_round(*sets: str, z: float) -> tuple[InProcessSimulation, torch.Tensor]:
    sim = InProcessSimulation.from_config(
        load_config(None, [*BASE, CLIP, f"privacy.clip_norm={C}", *sets, f"privacy.noise_multiplier={z}"])
    )
    g0 = sim.global_params.double().clone()
    sim.run_round()
    return sim, sim.global_params.double() - g0


def sum_noise(*sets: str) -> tuple[InProcessSimulation, torch.Tensor, torch.Tensor]:
    """(the noisy run, its step, the noise the round's sum carried: (noisy - noiseless step) * K)."""
    sim, noisy = one_round(*sets, z=Z)
    _, clean = one_round(*sets, z=0.0)
    return sim, noisy, (noisy - clean) * sim.rounds.strategy.aggregator.expected_clients


@pytest.mark.timeout(120)
def test_through_edges_the_sum_and_the_noise_are_flat_secure_aggregations() -> None:
    """Two edges: the same t, the same model bit for bit as flat secure aggregation (the same
    encodings and shares, summed mod 2^32 in another order), and the sum's noise std is
    z C sqrt(5/3): five shares of z^2 C^2 / 3 each, at least the z C the accountant assumes."""
    flat, flat_step, _ = sum_noise()
    hier, hier_step, noise = sum_noise("hierarchy.edges=2")
    assert isinstance(hier.runner, HierarchicalRound) and not hier.runner.summing
    assert hier.runner.reported == ["edge-000", "edge-001"]
    sa = hier.runner.secure
    assert sa is not None and sa.noise_shares == flat.secure_aggregation.noise_shares == T
    assert sa.last["included"] == 5
    assert torch.equal(hier_step, flat_step)
    assert float(noise.std()) == pytest.approx(Z * C * math.sqrt(5 / 3), rel=0.03)
    assert float(noise.std()) >= Z * C
    links = hier.runner.links.total
    assert links["edge_root_up"] < links["client_edge_up"]  # 2 masked sums instead of 5 masked inputs


@pytest.mark.timeout(120)
def test_through_edges_epsilon_is_flats() -> None:
    """The accountant is flat's: the same epsilon after the same rounds, for the continuous and the
    discrete Gaussian (whose accountant is sized from the same t)."""
    small = ['model.name="logreg"', "secure_aggregation.clip=15", "privacy.noise_multiplier=3"]
    for mech in ("gaussian", "discrete_gaussian"):
        sets = [*BASE, *small, f'privacy.mechanism="{mech}"']
        if mech == "discrete_gaussian":
            sets += ["privacy.bits=20", 'privacy.sampling="poisson"']  # its accountant's
        sims = [InProcessSimulation.from_config(load_config(None, [*sets, *x])) for x in ([], ["hierarchy.edges=2"])]
        for sim in sims:
            for _ in range(2):
                sim.run_round()
        flat, hier = (sim.privacy.accountant for sim in sims)
        assert isinstance(sims[1].runner, HierarchicalRound) and sims[1].rounds.version == 2
        assert type(hier) is type(flat) and hier.describe() == flat.describe()
        assert hier.epsilon == flat.epsilon > 0 and hier.state_dict() == flat.state_dict()


@pytest.mark.timeout(120)
def test_a_lost_edge_below_t_aborts_the_round_with_nothing_released() -> None:
    """12 clients under 3 edges, t = 11 (privacy.min_survivors = 0.9): a round that loses an edge
    keeps at most 8 masked inputs, fewer than t: it aborts, the model stays, and it is charged."""
    sets = [
        'model.name="logreg"',
        "simulation.num_clients=12",
        "simulation.clients_per_round=12",
        "privacy.min_survivors=0.9",
        "privacy.noise_multiplier=1",
        "secure_aggregation.clip=20",
        "hierarchy.edges=3",
        "hierarchy.edge_failure=0.3",
    ]
    sim = InProcessSimulation.from_config(load_config(None, [*BASE, *sets]))
    assert sim.runner.secure is not None and sim.runner.secure.noise_shares == 11
    aborted = 0
    for r in range(6):
        before = sim.global_params.clone()
        sim.runner.secure.last = {}
        sim.run_round()
        included = sim.runner.secure.last.get("included", 0)
        if included:  # no edge lost, or lost after its masked sum reached the root: all 12 are in
            assert included == 12 and not torch.equal(sim.global_params, before)
        else:  # an edge lost before its sum arrived: 8 masked inputs, fewer than t, nothing released
            assert sim.runner.lost and torch.equal(sim.global_params, before)
            aborted += 1
        assert sim.privacy.accountant.rounds == r + 1  # every started round is charged
    assert 0 < aborted < 6 and sim.rounds.version == 6 - aborted


def test_distributed_dp_through_edges_needs_secure_aggregation() -> None:
    with pytest.raises(ConfigError, match="distributed DP runs through edges with secure aggregation only"):
        load_config(None, [*BASE[:-2], "hierarchy.edges=2"])
    with pytest.raises(ConfigError, match="privacy.mode = 'central'"):
        load_config(
            None, [*BASE[:-6], 'privacy.mode="central"', "secure_aggregation.enabled=true", "hierarchy.edges=2"]
        )
