"""Robust D-PSGD mixing: the mean is X <- W X; the bound clips or screens; median resists."""

from __future__ import annotations

import torch

from shoal.config import load_config
from shoal.p2p.dpsgd import mixing_matrix
from shoal.p2p.robust import robust_gossip_average

W = mixing_matrix("regular", 10, 4, seed=0)


def _models():
    return torch.randn(10, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_mean_with_a_loose_bound_is_the_plain_mixing_step():
    x = _models()
    out, clipped = robust_gossip_average(W, x, x, load_config(None, ["robust.norm_bound=1e9"]))
    assert torch.allclose(out, W @ x, atol=1e-6) and clipped == 0


def test_a_hostile_neighbour_is_clipped_screened_or_outvoted():
    x = _models()
    sent = x.clone()
    sent[3] = 1e6  # node 3 sends garbage to its neighbours
    nbrs = [i for i in range(10) if i != 3 and W[i, 3] > 0]
    plain, _ = robust_gossip_average(W, sent, x, load_config(None, ["robust.norm_bound=1e9"]))
    assert all(float(plain[i].abs().max()) > 1e4 for i in nbrs)
    clip, n_clip = robust_gossip_average(W, sent, x, load_config(None, ["robust.norm_bound=1.0"]))
    assert n_clip >= len(nbrs)
    assert all(float((clip[i] - x[i]).norm()) <= 1.0 + 1e-6 for i in nbrs)
    screen, n_screen = robust_gossip_average(
        W, sent, x, load_config(None, ["robust.norm_bound=100.0", 'gossip.bound_mode="reject"'])
    )
    assert n_screen == len(nbrs)
    for i in nbrs:  # node 3's weight stayed with i; the rest is the plain mix
        w = W[i].clone()
        w[i] += w[3]
        w[3] = 0
        assert torch.allclose(screen[i], w @ x, atol=1e-6)
    med, _ = robust_gossip_average(W, sent, x, load_config(None, ['robust.rule="median"']))
    assert all(float(med[i].abs().max()) < 10 for i in nbrs)
