"""D-PSGD mixing matrices: symmetric, doubly stochastic, connected (spectral gap > 0)."""

from __future__ import annotations

import pytest
import torch

from shoal.p2p.dpsgd import TOPOLOGIES, DpsgdStep, gossip_average, mixing_matrix, spectral_gap, topology_edges
from shoal.p2p.merge import MergeBound


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
    assert (
        spectral_gap(mixing_matrix("ring", 30))
        < spectral_gap(mixing_matrix("torus", 30))
        < spectral_gap(mixing_matrix("complete", 30))
    )


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


def test_a_mixing_step_between_view_partners_keeps_the_sum_and_refuses_beyond_its_degree():
    import pytest

    from shoal.p2p.dpsgd import DpsgdStep, MixMessage
    from shoal.p2p.group_average import Refusal

    g = torch.Generator().manual_seed(0)
    ids = [f"n{i}" for i in range(5)]
    x = {p: torch.randn(7, generator=g) for p in ids}
    steps = {p: DpsgdStep(p, 3, x[p], [ids[(i + 1) % 5]], degree=4, close_at=1.0) for i, p in enumerate(ids)}
    for p, st in steps.items():
        for req in st.start():
            steps[p].on_reply(steps[req.target].on_request(req, 0.1), 0.2)
    mixed = {p: st.result() for p, st in steps.items()}
    assert torch.allclose(sum(mixed.values()), sum(x.values()), atol=1e-5)  # doubly stochastic: the mean stays
    for p in ids:  # each node mixed its two ring neighbours at weight 1/5
        i = ids.index(p)
        nb = [x[ids[(i + 1) % 5]], x[ids[(i - 1) % 5]]]
        assert torch.allclose(mixed[p], x[p] + sum(n - x[p] for n in nb) / 5, atol=1e-6)
    st = DpsgdStep("a", 0, x["n0"], ["b"], degree=2, close_at=1.0)
    st.start()
    st.on_request(MixMessage("c", "a", 0, x["n1"]), 0.1)
    with pytest.raises(Refusal) as e:
        st.on_request(MixMessage("d", "a", 0, x["n2"]), 0.1)
    assert e.value.code == "busy"
    with pytest.raises(Refusal) as e:
        st.on_request(MixMessage("d", "a", 1, x["n2"]), 0.1)
    assert e.value.code == "stale_round"
    st.on_unreachable("b", 0.2)  # the partner never answered: its weight stays home
    st.tick(1.0)
    with pytest.raises(Refusal) as e:
        st.on_request(MixMessage("c", "a", 0, x["n1"]), 1.0)
    assert e.value.code == "closed"
    assert torch.allclose(st.result(), x["n0"] + (x["n1"] - x["n0"]) / 3, atol=1e-6)


def test_the_simulators_matrix_form_gives_the_same_models_as_mixing_steps():
    """simulations/gossip/dpsgd.py mixes all peers at once (``X <- W X``); deployed peers run one
    DpsgdStep each. On the same graph (a ring: each node asks its successor, degree 2, so every
    edge weighs 1/3 as the ring's Metropolis-Hastings matrix does) both give the same models,
    and through the same merge bound both adopt them alike."""
    from shoal.p2p.dpsgd import DpsgdStep, gossip_average, mixing_matrix
    from shoal.p2p.merge import MergeBound

    n = 6
    ids = [f"https://127.0.0.1:{9000 + i}" for i in range(n)]
    x = torch.randn(n, 11, generator=torch.Generator().manual_seed(2))
    steps = [DpsgdStep(ids[i], 5, x[i], [ids[(i + 1) % n]], degree=2, close_at=1.0) for i in range(n)]
    for st in steps:
        for req in st.start():
            st.on_reply(steps[ids.index(req.target)].on_request(req, 0.1), 0.2)
    per_node = torch.stack([st.result() for st in steps])
    matrix = gossip_average(mixing_matrix("ring", n), x).float()
    assert torch.allclose(per_node, matrix, atol=1e-6)
    tight = [MergeBound(radius=0.05, far=0.0), MergeBound(radius=0.05, far=0.0)]  # the bound clips, both forms alike
    a = [tight[0].apply(x[i], per_node[i]) for i in range(n)]
    b = [tight[1].apply(x[i], matrix[i]) for i in range(n)]
    assert tight[0].clipped == tight[1].clipped > 0
    assert all(u is not None and v is not None and torch.allclose(u, v, atol=1e-6) for u, v in zip(a, b))


def _drag(per_neighbour: bool, steps: int = 150, far: float = 0.0) -> float:
    """A peer mixing with three honest neighbours (near the honest model h) and one holder of
    the network token that sends a far-off model (every value 9,900: within max_abs) at every
    step; returns how far the peer ends from h. ``far = 0``: clipping alone, never refusing."""
    torch.manual_seed(0)
    h = torch.randn(200)
    bound = MergeBound(relative=2.0, max_abs=1e4, drift=0.0, far=far)  # no drift budget
    x = h.clone()
    for t in range(steps):
        bound.local_step(0.1)  # the peer's own training step
        st = DpsgdStep("me", t, x, [], degree=4, close_at=1.0)
        st.neighbours = {f"h{k}": h + 0.01 * torch.randn(200) for k in range(3)}
        st.neighbours["attacker"] = torch.full((200,), 9900.0)
        mixed = st.result(bound) if per_neighbour else st.result()
        x = bound.apply(x, mixed)  # the peer's adopt: the bound on the step's result too
        assert x is not None and bool(torch.isfinite(x).all())
    return float(torch.linalg.vector_norm(x - h))


def test_one_far_off_neighbour_cannot_drag_a_dpsgd_peer_away():
    """Self-centered clipping of each neighbour (the merge bound inside the mix) keeps the peer
    within a few honest-model norms of the honest model for good; clipping only the mixed result
    lets the one far-off model set the direction of every step, and the peer ends at max_abs."""
    h_norm = float(torch.linalg.vector_norm(torch.randn(200, generator=torch.Generator().manual_seed(0))))
    bounded = _drag(per_neighbour=True)
    dragged = _drag(per_neighbour=False)
    assert bounded < 3 * max(h_norm, 1.0), bounded
    assert dragged > 100 * bounded, (dragged, bounded)
    refused = _drag(per_neighbour=True, far=4.0)  # the default: a model beyond 4 radii is refused
    assert refused < 0.5 * bounded, (refused, bounded)  # what is left is the honest neighbours' noise
