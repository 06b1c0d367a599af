"""Push-pull gossip (``gossip.algorithm = "gossip"``): asynchronous exchanges and Cyclon shuffles.

In each round every online peer wakes once at a random time, trains one round of local
work (``[train]``, as a FedAvg client would) on its own shard, starts
``exchanges_per_round`` push-pull exchanges and one Cyclon shuffle. (Spacing the
exchanges evenly over the round instead was measured on FEMNIST: lower consensus
distance, no better mean peer accuracy; docs/results.md.) Merges bound the received
model's pull to ``robust.norm_bound`` (p2p/merge.py: clip or reject, per ``gossip.bound_mode``).
"""

from __future__ import annotations

from .network import GossipNetwork


class PushPullGossip:
    leave_mid_round = False

    def __init__(self, net: GossipNetwork):
        self.net = net

    def run_round(self) -> None:
        net = self.net
        start = float(net.round - 1)
        order = net.online_peers()
        wake = start + net.rng.random(len(order))
        for t, i in sorted(zip(wake.tolist(), order)):
            net.drain(t)
            if not net.online[i]:
                continue
            node = net.nodes[i]
            node.expire(t)
            node.membership.expire(t)
            net.train([i])  # at its wake time: what it trains on depends on what it merged before
            for _ in range(net.g.exchanges_per_round):
                msg = node.start_exchange(t)
                if msg is not None:
                    net.send(msg, t)
            req = node.membership.start_shuffle(t)
            if req is not None:
                net.send(req, t)
        net.drain(start + 1.0)

    def metrics(self) -> dict[str, float]:
        return {}
