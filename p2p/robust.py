"""Robust merging for decentralized training, and the settings it can and cannot serve.

Push-pull gossip merges one received model at a time, so a rule over many inputs
(median, trimmed mean, Krum) has nothing to choose from; there the defence is the merge
rule's norm bound (p2p/merge.py: self-centered clipping of ``other - own``).

D-PSGD (p2p/dpsgd.py) mixes a node's model with all its neighbours' at once, so any
``[robust]`` rule applies: node ``i``'s new model is

    x_i + R({x_j - x_i : j in N(i) + {i}}, weights W_ij)

with ``R`` the rule of ``aggregation.robust.make_aggregator`` (norm bounding in front if
``robust.norm_bound`` > 0). With ``R`` the weighted mean this is exactly ``X <- W X``
(rows of W sum to 1); with the norm bound it is self-centered clipping (He, Karimireddy
and Jaggi 2022, arXiv:2202.01545, eq. (SCClip)); with the coordinate-wise median or
trimmed mean over the neighbourhood it is the screening of BRIDGE (Yang and Bajwa 2019,
"BRIDGE: Byzantine-resilient decentralized gradient descent"), applied to models after
the local step. The rules are unweighted (see aggregation/robust.py), so a node's own
model counts once, like each neighbour's. With ``gossip.bound_mode = "reject"`` the
norm bound screens instead of clipping: a neighbour's model farther than
``robust.norm_bound`` from the node's own is left out (its weight stays with the node),
as in the push-pull merge.
"""

from __future__ import annotations

import dataclasses

import torch

from shoal.aggregation.robust import make_aggregator
from shoal.config import Config
from shoal.config.rules import check_gossip_settings

from .merge import MergeBound
from .settings import robust_mixing

__all__ = ["check_gossip_settings", "make_merge_bound", "robust_gossip_average", "robust_mixing"]


def make_merge_bound(cfg: Config) -> MergeBound:
    """A peer's safe-merge bound from ``gossip.merge_bound``, ``merge_radius``, ``max_drift``,
    ``merge_far``, ``max_abs`` and ``bound_mode``."""
    g = cfg.gossip
    return MergeBound(g.merge_bound, g.max_abs, g.bound_mode, g.merge_radius, g.max_drift, far=g.merge_far)


def robust_gossip_average(
    w: torch.Tensor, received: torch.Tensor, own: torch.Tensor, cfg: Config
) -> tuple[torch.Tensor, int]:
    """One robust D-PSGD mixing step.

    ``w``: the (n x n) mixing weights in force (lost links and rejected senders already
    moved to the diagonal); ``received[j]``: the model node j sent its neighbours (an
    attacker's may differ from its own); ``own[i]``: node i's own model. Returns the
    new models, one row per node, and how many received models the norm bound clipped
    or left out.
    """
    out = own.clone()
    clipped = 0
    screen = cfg.robust.norm_bound if cfg.gossip.bound_mode == "reject" else 0.0
    rule = dataclasses.replace(cfg.robust, norm_bound=0.0) if screen else cfg.robust
    for i in range(w.shape[0]):
        row = w[i]
        agg = make_aggregator(rule, own.shape[1], own.device)
        kept = float(row[i])
        for j in torch.nonzero(row > 0).flatten().tolist():
            if j == i:
                continue
            d = received[j] - own[i]
            if screen and float(torch.linalg.vector_norm(d)) > screen:
                clipped += 1
                kept += float(row[j])
                continue
            agg.add(d, float(row[j]))
        if kept > 0:
            agg.add(torch.zeros_like(own[i]), kept)
        if agg.count:
            out[i] = own[i] + agg.mean()
        clipped += getattr(agg, "clipped", 0)
    return out, clipped
