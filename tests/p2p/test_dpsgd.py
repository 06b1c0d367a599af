"""D-PSGD mixing matrices: symmetric, doubly stochastic, connected (spectral gap > 0)."""

from __future__ import annotations

import pytest
import torch

from shoal.p2p.dpsgd import TOPOLOGIES, gossip_average, mixing_matrix, spectral_gap, topology_edges


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("n", [8, 30])
def test_mixing_matrices_are_symmetric_doubly_stochastic_with_a_gap(name, n):
    w = mixing_matrix(name, n, degree=4, seed=3)
    assert torch.allclose(w, w.T)
    assert (w >= 0).all()
    assert torch.allclose(w.sum(0), torch.ones(n, dtype=w.dtype))
    assert torch.allclose(w.sum(1), torch.ones(n, dtype=w.dtype))
    assert spectral_gap(w) > 1e-6


def test_topology_degrees():
    assert all(len([e for e in topology_edges("ring", 10) if i in e]) == 2 for i in range(10))
    assert all(len([e for e in topology_edges("torus", 12) if i in e]) == 4 for i in range(12))
    assert all(len([e for e in topology_edges("regular", 20, degree=3) if i in e]) == 3 for i in range(20))
    assert len(topology_edges("complete", 6)) == 15


def test_denser_topologies_mix_faster():
    assert spectral_gap(mixing_matrix("ring", 30)) < spectral_gap(mixing_matrix("torus", 30)) < spectral_gap(
        mixing_matrix("complete", 30))


def test_gossip_average_preserves_the_mean_and_reaches_consensus():
    torch.manual_seed(0)
    x = torch.randn(16, 5, dtype=torch.float64)
    w = mixing_matrix("ring", 16)
    y = x
    for _ in range(400):
        y = gossip_average(w, y)
    assert torch.allclose(y.mean(0), x.mean(0))
    assert (y - y.mean(0)).abs().max() < 1e-3


def test_absent_nodes_keep_their_models_and_the_live_mean_is_kept():
    x = torch.arange(8, dtype=torch.float64)[:, None]
    alive = torch.tensor([True] * 6 + [False] * 2)
    y = gossip_average(mixing_matrix("complete", 8), x, alive)
    assert torch.equal(y[6:], x[6:])
    assert torch.allclose(y[:6].mean(), x[:6].mean())


def test_impossible_regular_graph_is_refused():
    with pytest.raises(ValueError):
        topology_edges("regular", 5, degree=3)


@pytest.mark.parametrize("n, k", [(30, 6), (100, 8)])
def test_dense_random_regular_graphs_are_drawn(n, k):
    edges = topology_edges("regular", n, degree=k)
    assert len(edges) == n * k // 2 and all(a != b for a, b in edges)
    assert all(len([e for e in edges if i in e]) == k for i in range(n))
