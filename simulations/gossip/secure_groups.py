"""Secure averaging in random groups (``gossip.algorithm = "secure_groups"``).

Every online peer trains, then random groups of ``gossip.group_size`` peers average
securely (aggregation/secagg/group.py: Bonawitz et al.'s protocol among the members, one
relaying): each member learns only its group's example-weighted average. What is masked
is the model's offset from the shared seeded initial model, in fixed point clipped to
``secure_aggregation.clip`` per entry. Injected ``secure_aggregation.dropout_*`` rates drop
members at each stage; a group left below the threshold keeps its models (the round is
aborted for that group).
"""

from __future__ import annotations

import logging

import torch

from shoal.aggregation.secagg import SecAggAborted
from shoal.aggregation.secagg.group import secure_group_average
from shoal.aggregation.secagg.memory import STAGES, injected_dropouts
from shoal.seeding import derive_seed

from .network import GossipNetwork

log = logging.getLogger(__name__)


class SecureGroups:
    leave_mid_round = False

    def __init__(self, net: GossipNetwork):
        self.net = net
        self.last_groups: list[list[int]] = []

    def run_round(self) -> None:
        net = self.net
        sa = net.cfg.secure_aggregation
        live = net.online_peers()
        net.train(live)
        order = net.rng.permutation(live).tolist()
        size = net.g.group_size
        groups = [order[a : a + size] for a in range(0, len(order), size)]
        if len(groups) > 1 and len(groups[-1]) < 2:  # no group of one: it joins the previous
            groups[-2].extend(groups.pop())
        self.last_groups = groups
        rates = [getattr(sa, f"dropout_{s}") for s in STAGES]
        for gi, members in enumerate(groups):
            if len(members) < 2:
                continue
            ids = [net.ids[i] for i in members]
            offsets = {p: (net.models[i] - net.init).detach().cpu().numpy() for p, i in zip(ids, members)}
            weights = {p: float(net.shared_size(i)) for p, i in zip(ids, members)}
            drop_at = injected_dropouts(ids, rates, net.rng.random((len(ids), len(STAGES))))
            session = f"shoal-gossip/{net.cfg.simulation.seed}/{net.round}/{gi}".encode()
            try:
                out = secure_group_average(
                    offsets,
                    weights,
                    session=session,
                    clip=sa.clip,
                    bits=sa.bits,
                    threshold=sa.threshold,
                    drop_at=drop_at,
                    seed=derive_seed(sa.seed, net.cfg.simulation.seed, net.round, gi),
                )
            except SecAggAborted as e:
                net.aborted_groups += 1
                log.debug("round %d group %d aborted: %s", net.round, gi, e)
                continue
            avg = net.init + torch.from_numpy(out.mean).to(net.models.dtype).to(net.models.device)
            for p, i in zip(ids, members):
                net.bytes_sent[i] += out.cost.sent.get(p, 0)
                if p in out.included:
                    net.nodes[i].adopt(avg, clip=False)  # through the peer's merge bound, as a real peer does

    def metrics(self) -> dict[str, float]:
        return {}
