"""Synchronous D-PSGD (``gossip.algorithm = "dpsgd"``): local work, then ``X <- W X``.

``W`` is the topology's mixing matrix; links lost with probability ``gossip.loss`` in a
round, and offline peers, fall back on the diagonal. With ``gossip.exchanges_per_round``
= m > 1 it mixes m times per round (``X <- W^m X``, m messages per link): more
communication, the same local work. Mixing goes through the ``[robust]`` rule when one is
set (p2p/robust.py); otherwise, when models travel encoded or forged, each neighbour's model
passes the receiving peer's merge bound first, as in ``shoal peer``.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from shoal.p2p.dpsgd import gossip_average, mixing_matrix, spectral_gap
from shoal.p2p.robust import robust_gossip_average, robust_mixing

from .network import GossipNetwork

log = logging.getLogger(__name__)


class DPSGD:
    leave_mid_round = False

    def __init__(self, net: GossipNetwork):
        self.net = net
        g = net.g
        self.w = mixing_matrix(g.topology, net.n, g.degree, g.rewire, net.cfg.simulation.seed).to(net.device)
        log.info("D-PSGD on a %s of %d peers, spectral gap %.4f", g.topology, net.n, spectral_gap(self.w))

    def run_round(self) -> None:
        net, w = self.net, self.w
        alive = torch.as_tensor(net.online)
        net.train(net.online_peers())
        if net.g.loss > 0:  # each link is down this round with probability `loss`, both ways
            up = torch.as_tensor(net.rng.random((net.n, net.n)) >= net.g.loss, device=w.device)
            up = torch.triu(up, 1)
            up = up | up.T
            w = w * up
            w = w + torch.diag(1.0 - w.sum(1))
        live = np.flatnonzero(net.online)
        a = torch.as_tensor(net.online, device=w.device, dtype=w.dtype)
        w = w * a[:, None] * a[None, :]  # absent nodes: their weight moves to the diagonal
        w = w + torch.diag(1.0 - w.sum(1))
        nbrs = (w[live][:, live] > 0).sum(1).cpu().numpy() - 1
        for _ in range(net.g.exchanges_per_round):  # m gossip steps per round: X <- W^m X
            if not net.wire and not robust_mixing(net.cfg) and self.unbounded(w, live):
                self.adopt(gossip_average(w, net.models, alive).float(), live)
                net.bytes_sent[live] += nbrs * net.model_bytes
                continue
            sent, ok = net.models.clone(), torch.ones(net.n, dtype=torch.bool, device=w.device)
            for k, i in enumerate(live):  # each node encodes its model once and sends it to every neighbour
                size, params = net.on_wire(
                    net.models[i], int(i), {"age": net.nodes[i].age, "num_examples": 1, "sender": net.ids[i]}
                )
                net.bytes_sent[i] += size * int(nbrs[k])
                if params is None:
                    ok[i] = False
                else:
                    sent[i] = params
            wk = w * ok[None, :].to(w.dtype)  # a rejected model is not mixed in: its weight stays home
            wk = wk + torch.diag(1.0 - wk.sum(1))
            if robust_mixing(net.cfg):
                mixed, clipped = robust_gossip_average(wk, sent.double(), net.models.double(), net.cfg)
                net.mix_bounded += clipped
            else:
                mixed = self.bounded_mix(wk, sent, live)
            self.adopt(mixed.float(), live)

    def unbounded(self, w: torch.Tensor, live: np.ndarray) -> bool:
        """True when every online peer's neighbours lie within its merge radius (each distance
        takes the neighbour's slot of the peer's window, as DpsgdStep.result records it): then
        the bounded mix is the plain ``W X``. A restarted or drifted peer makes it False, and the
        round mixes through each peer's bound (its vote included)."""
        net = self.net
        dist = torch.cdist(net.models.double(), net.models.double())
        within = True
        for i in live.tolist():
            bound = net.nodes[i].merge_bound
            for j in torch.nonzero(w[i] > 0).flatten().tolist():
                if j != i:
                    bound.observe(net.ids[j], float(dist[i, j]))
                    within = within and not float(dist[i, j]) > bound.radius()
        return within

    def bounded_mix(self, w: torch.Tensor, sent: torch.Tensor, live: np.ndarray) -> torch.Tensor:
        """Each online peer's row of the mix with every neighbour's model through that peer's
        merge bound first, as DpsgdStep.result does for a real peer: ``x_i + sum_j W_ij
        (bound_i(x_j) - x_i)``; a model the bound refuses leaves its weight on the diagonal.
        Equal to ``W X`` when the bound never acts (honest peers, plain messages: the fast path
        above)."""
        net = self.net
        mixed = net.models.double().clone()
        for i in live:
            i = int(i)
            node, own = net.nodes[i], net.models[i]
            before = node.merge_bound.clipped + node.merge_bound.refused
            for j in torch.nonzero(w[i] > 0).flatten().tolist():
                if j == i:
                    continue
                x = node.merge_bound.apply(own, sent[j], net.ids[j])
                if x is not None:
                    mixed[i] += float(w[i, j]) * (x.double() - own.double())
            node.bounded += node.merge_bound.clipped + node.merge_bound.refused - before
        return mixed

    def adopt(self, mixed: torch.Tensor, live: np.ndarray) -> None:
        """Each online peer takes its row of the mix through its merge bound (as DpsgdStep's peer
        does); offline rows are unchanged by the mix."""
        for i in live:
            self.net.nodes[int(i)].adopt(mixed[int(i)])

    def metrics(self) -> dict[str, float]:
        return {}
