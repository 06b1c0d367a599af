"""Exact averaging within groups of a virtual grid (``gossip.algorithm = "group_average"``).

Every peer trains, then the peers average exactly within small groups of a virtual grid
(p2p/group_average.py: the same protocol objects ``shoal peer`` drives over HTTPS),
through ``gossip.group_levels`` of the grid's axes per exchange (0 = all: the global
average on a full grid) and ``gossip.exchanges_per_round`` exchanges per round; slice
messages cross the same virtual network (latency, loss, partitions; a message to an
offline peer is refused), and peers that churn out vanish mid-round. An attacker
(``[attack]``) takes part with its forged model; every honest peer adopts its group's
average through its merge bound (clipped to the radius, within the drift budget).
"""

from __future__ import annotations

import heapq
import logging
from typing import Any

import numpy as np

from shoal.p2p.grid_average import GridAverage, grid_path
from shoal.p2p.group_average import Refusal, SliceMessage, grid_dims
from shoal.p2p.model_wire import encode_slice
from shoal.seeding import derive_seed

from .network import GossipNetwork

log = logging.getLogger(__name__)


class GroupAverage:
    """``gossip.exchanges_per_round`` = m exchanges per round, each along the grid's next
    axis (m = d on a full grid gives every peer the exact global average). Each phase waits
    at most ``gossip.timeout``; a refused message reaches its sender after one latency, as a
    refused connection. Every peer knows every peer (the directory real peers build by
    gossip), offline ones included. A peer that goes offline this round (churn) trains,
    starts, and vanishes at a uniformly random moment of the round's m exchanges; it keeps
    the model it had then. An exchange lasts until every group is done (deadlines included)."""

    leave_mid_round = True

    def __init__(self, net: GossipNetwork):
        self.net = net
        self.stats = {"groups": 0, "incomplete": 0, "repaired_slices": 0, "late": 0, "vanished": 0}
        self.last_groups: list[list[int]] = []
        # the weight behind each model: its examples (or 1), then the summed weight of the group
        # average it holds, so that d exchanges on a full grid give the global weighted average
        self.weight: dict[int, float] = {}
        dims = "x".join(map(str, grid_dims(net.n, net.g.group_size)))
        log.info("group averaging of %d peers on a %s grid", net.n, dims)

    def run_round(self) -> None:
        net, g = self.net, self.net.g
        start = float(net.round - 1)
        net.train(net.online_peers())
        m = g.exchanges_per_round
        vanish = {int(i): float(net.rng.random()) * m for i in np.flatnonzero(net.leaving)}
        gone: set[int] = set()
        self.weight = {i: (float(net.shared_size(i)) if g.group_weights == "examples" else 1.0) for i in range(net.n)}
        for s in range(m):
            at = {i: start + (u - s) for i, u in vanish.items() if s <= u < s + 1}
            self.exchange((net.round - 1) * m + s, start, at, gone)
        net.online &= ~net.leaving

    def exchange(self, step: int, start: float, vanish_at: dict[int, float], gone: set[int]) -> None:
        """One group-averaging exchange of every online peer not ``gone``; adds those that vanish."""
        net = self.net
        g = net.g
        seed = net.cfg.simulation.seed
        paths = {p: grid_path(net.ids, p, step, g.group_size, g.group_levels, seed) for p in net.ids}
        groups = sorted({pth[0] for pth in paths.values()})
        self.last_groups = [[net.index[p] for p in grp] for grp in groups]
        queue: list[tuple[float, int, str, Any]] = []
        seq = 0

        def push(t: float, kind: str, item: Any) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(queue, (t, seq, kind, item))

        def delay() -> float:
            return float(net.rng.exponential(g.latency)) if g.latency > 0 else 0.0

        objs: dict[int, GridAverage] = {}
        self.stats["groups"] += sum(len(grp) >= 2 for grp in groups)
        for p, path in paths.items():
            i = net.index[p]
            if net.online[i] and i not in gone and any(len(grp) >= 2 for grp in path):
                own = net.models[i]
                if net.attackers[i]:  # an attacker takes part with its forged model (network.forge)
                    own = net.forge(own.clone(), derive_seed(seed, 0x6A7, step, i))
                objs[i] = GridAverage(p, path, step, own, self.weight[i], start, g.timeout, net.nodes[i].merge_bound)
                push(start, "start", i)
        for i, t in vanish_at.items():
            push(t, "vanish", i)
        scheduled: dict[int, float] = {}

        def send(src: int, msgs: list[SliceMessage], t: float) -> None:
            for msg in msgs:
                net.bytes_sent[src] += len(encode_slice(msg, net.spec))
                dst = net.index[msg.target]
                if net.rng.random() < g.loss or net.partitioned(src, dst):
                    net.lost += 1
                    continue
                push(t + delay(), "msg", msg)
            nxt = objs[src].next_deadline()
            if nxt is not None and scheduled.get(src) != nxt:
                scheduled[src] = nxt
                push(max(nxt, t), "tick", src)

        while queue:
            t, _, kind, item = heapq.heappop(queue)
            if kind == "vanish":
                gone.add(item)
                self.stats["vanished"] += 1
                continue
            if kind == "start":
                if item not in gone:
                    send(item, objs[item].start(), t)
                continue
            if kind == "tick":
                if item not in gone and not objs[item].done:
                    send(item, objs[item].tick(t), t)
                continue
            if kind == "refused":
                src, dst = item
                if src not in gone:
                    send(src, objs[src].on_unreachable(net.ids[dst], t), t)
                continue
            msg: SliceMessage = item
            src, dst = net.index[msg.sender], net.index[msg.target]
            if dst in gone or dst not in objs:  # offline or vanished: the connection is refused
                push(t + delay(), "refused", (src, dst))
                continue
            try:
                send(dst, objs[dst].on_message(msg, t), t)
            except Refusal as e:
                net.rejected += 1
                log.debug("%s refused a slice from %s: %s", msg.target, msg.sender, e)
        for i, obj in objs.items():
            if i in gone:
                continue
            res = obj.result()
            net.nodes[i].adopt(res.values)  # through the peer's merge bound, as a real peer does
            self.weight[i] = res.weight
            self.stats["late"] += res.late
            self.stats["repaired_slices"] += res.repaired
            self.stats["incomplete"] += int(not res.complete)

    def metrics(self) -> dict[str, float]:
        return {f"group_{k}": v for k, v in self.stats.items()}
