"""Hundreds of gossip peers in one process on a virtual network (``simulation.mode = "gossip"``).

Every peer is a :class:`~shoal.p2p.gossip.GossipNode` with a Cyclon
:class:`~shoal.p2p.membership.Membership`, the same objects ``shoal peer`` drives over
HTTP. The transport here is an event queue on a virtual clock measured in rounds:
messages take an exponential delay (``gossip.latency`` rounds on average), are lost
with probability ``gossip.loss``, never cross a partition, and never reach a peer that
is offline. In each round every online peer wakes once at a random time, trains one
round of local work (``[train]``, as a FedAvg client would) on its own shard, starts
``exchanges_per_round`` push-pull exchanges and one Cyclon shuffle. (Spacing the
exchanges evenly over the round instead was measured on FEMNIST: lower consensus
distance, no better mean peer accuracy; docs/results.md.)

Peers are data, not model copies: all models are rows of one (peers x parameters)
float32 tensor, and one LocalTrainer trains every peer in turn. With
``gossip.algorithm = "dpsgd"`` the same peers run synchronous D-PSGD instead: local
work, then ``X <- W X`` with the topology's mixing matrix (links lost with
probability ``gossip.loss`` in a round fall back on the diagonal).

With ``gossip.algorithm = "group_average"`` every peer trains, then the peers average
exactly within small groups of a virtual grid (p2p/group_average.py: the same protocol
objects ``shoal peer`` drives over HTTPS), through ``gossip.group_levels`` of the grid's
axes per exchange (0 = all: the global average on a full grid) and
``gossip.exchanges_per_round`` exchanges per round; slice messages cross the same virtual
network (latency, loss, partitions; a message to an offline peer is refused), and peers
that churn out vanish mid-round.

Churn is a two-state Markov chain per peer whose stationary offline share is
``gossip.churn`` and whose mean offline spell is ``gossip.churn_period`` rounds.

With ``gossip.exchanges_per_round`` = m > 1, D-PSGD mixes m times per round
(``X <- W^m X``, m messages per link): more communication, the same local work.

Attacks and robustness (``[attack]``, ``[robust]``). A seeded ``attack.fraction`` of the
peers follow the protocol but send a forged model in every message: relative to the
initial model ``x0`` that every peer shares, ``sign_flip`` sends ``x0 - scale (x - x0)``,
``scale`` sends ``x0 + scale (x - x0)``, ``gaussian`` sends ``x + N(0, scale^2)``,
``nan`` / ``inf`` a model full of NaN / Inf; ``label_flip`` attackers train on flipped
labels. Metrics are over the honest peers only. Push-pull merges bound the received
model's pull to ``robust.norm_bound`` (p2p/merge.py: clip or reject, per
``gossip.bound_mode``); D-PSGD mixes through the ``[robust]`` rule (p2p/robust.py).

The wire (``[compression]``). With a non-dense encoding, zstd, or an attack on, every
model message is encoded (p2p/model_wire.py: dense or q8, optionally zstd), counted at
its encoded size and decoded and validated as the receiver would; a message that fails
validation is rejected (counted, never merged; the sender sees no answer). Otherwise
every model message has the same size, measured once on the real encoding.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.aggregation.secagg import SecAggAborted
from shoal.aggregation.secagg.group import secure_group_average
from shoal.aggregation.secagg.memory import STAGES, injected_dropouts
from shoal.assembly import initial_model, task_from_config, task_label
from shoal.client.device import select_device
from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.errors import WireError
from shoal.p2p.dpsgd import gossip_average, mixing_matrix, spectral_gap
from shoal.p2p.gossip import GossipNode, ModelMessage
from shoal.p2p.group_average import GridAverage, Refusal, SliceMessage, grid_dims, grid_path
from shoal.p2p.membership import Membership, ShuffleRequest, ShuffleResponse
from shoal.p2p.merge import MergeRule
from shoal.p2p.model_wire import decode_gossip_model, encode_gossip_model, encode_slice
from shoal.p2p.robust import robust_gossip_average, robust_mixing
from shoal.seeding import derive_seed
from shoal.task import SimulationData, Task, check_loss
from shoal.wire import encode_model

from .attacks import choose_attackers, flip_labels, label_count
from .client_data import ClientShards, check_simulation_data, load_simulation_data, on_device
from .inprocess import weighted_means
from .run_loop import OnRecord, RunLoop, Step

log = logging.getLogger(__name__)

Message = ModelMessage | ShuffleRequest | ShuffleResponse


def peer_id(i: int) -> str:
    return f"peer-{i:05d}"


class GossipSimulation:
    """Peers, virtual network and churn built from a Config; ``run_round`` advances one round."""

    def __init__(self, cfg: Config, data: SimulationData | None = None, task: Task | None = None):
        self.cfg = cfg
        sim, g = cfg.simulation, cfg.gossip
        self.g = g
        self.device = select_device(sim.device)
        self.task = task if task is not None else task_from_config(cfg)
        self.data = load_simulation_data(self.task, cfg) if data is None else check_simulation_data(self.task, data)
        model = initial_model(cfg, self.task).to(self.device)  # every peer starts from the same model
        self.shards = ClientShards(self.data.train, self.device)
        check_loss(self.task, model, self.shards.data(0), self.device)
        self.trainer = LocalTrainer(model, cfg.train, self.device, task=self.task)
        self.spec = self.trainer.spec
        self.test = on_device(self.data.test, self.device)
        self.client_test = (
            None if self.data.client_test is None else [on_device(d, self.device) for d in self.data.client_test]
        )
        self.num_classes: int | None = getattr(self.task, "num_classes", None)
        self.task_label = task_label(cfg, self.task)
        n = len(self.shards)
        self.n = n
        self.init = self.trainer.flat.detach().clone()
        self.models = self.init.repeat(n, 1)  # row i is peer i's model
        self.rng = np.random.default_rng(derive_seed(sim.seed, 0x6055))
        self.ids = [peer_id(i) for i in range(n)]
        self.index = {p: i for i, p in enumerate(self.ids)}
        rule = MergeRule(g.merge, g.staleness_exponent, g.max_age_gap, cfg.robust.norm_bound, g.bound_mode)
        k0 = min(g.view_size, n - 1)
        self.nodes: list[GossipNode] = []
        for i in range(n):
            others = [j for j in self.rng.choice(n - 1, size=k0, replace=False)]
            boot = tuple(self.ids[j if j < i else j + 1] for j in others)  # a random initial view, never self
            m = Membership(
                self.ids[i],
                g.view_size,
                g.shuffle_length,
                g.timeout,
                g.max_failures,
                quarantine=10 * g.churn_period,
                seed=derive_seed(sim.seed, 0xC1C, i),
                bootstrap_peers=boot,
            )
            self.nodes.append(GossipNode(m, self.models[i], self.shards.size(i), rule, g.timeout))
        self.online = np.ones(n, dtype=bool)
        self.leaving = np.zeros(n, dtype=bool)
        if g.churn > 0:
            self.online = self.rng.random(n) >= g.churn
        self.round = 0
        self._queue: list[tuple[float, int, Message]] = []
        self._seq = 0
        # Sizes of what travels, measured on the real wire encodings.
        self.model_bytes = len(
            encode_model(self.init, self.spec, 0, {"age": 0, "num_examples": 1, "sender": self.ids[0]})
        )
        self.bytes_sent = np.zeros(n, dtype=np.int64)
        self.lost = 0
        self.rejected = 0
        self.mix_bounded = 0  # D-PSGD: received models clipped by robust.norm_bound
        self.aborted_groups = 0  # secure_groups: groups left below the protocol's threshold
        self.group_stats = {"groups": 0, "incomplete": 0, "repaired_slices": 0, "late": 0, "vanished": 0}
        self.max_bytes = self.model_bytes + (1 << 20)
        atk = cfg.attack
        self.attackers = np.zeros(n, dtype=bool)
        if atk.kind != "none" and atk.fraction > 0:
            for p in choose_attackers(self.ids, atk.fraction, sim.seed):
                self.attackers[self.index[p]] = True
            if atk.kind == "label_flip":
                for i in np.flatnonzero(self.attackers).tolist():
                    flip_labels(self.shards.get(int(i))[1], label_count(self))
            log.info("attack %s: %d of %d peers", atk.kind, int(self.attackers.sum()), n)
        c = cfg.compression
        self.wire = c.encoding != "dense" or c.zstd or (atk.kind not in ("none", "label_flip") and atk.fraction > 0)
        self._msgs = 0
        self.w = None
        if g.algorithm == "dpsgd":
            self.w = mixing_matrix(g.topology, n, g.degree, g.rewire, sim.seed).to(self.device)
            log.info("D-PSGD on a %s of %d peers, spectral gap %.4f", g.topology, n, spectral_gap(self.w))
        if g.algorithm == "group_average":
            log.info("group averaging of %d peers on a %s grid", n, "x".join(map(str, grid_dims(n, g.group_size))))
        self.honest = np.flatnonzero(~self.attackers)
        eval_n = len(self.honest) if g.eval_peers == 0 else min(g.eval_peers, len(self.honest))
        self.eval_idx = np.sort(self.rng.choice(self.honest, size=eval_n, replace=False))
        log.info(
            "gossip simulation: %d peers, model %s (%d parameters), %s", n, cfg.model.name, self.spec.numel, g.algorithm
        )

    # --- the virtual network -------------------------------------------------------------

    def _partitioned(self, a: int, b: int) -> bool:
        g = self.g
        if not g.partition_start <= self.round - 1 < g.partition_end:
            return False
        return (a < self.n // 2) != (b < self.n // 2)

    def _forge(self, params: torch.Tensor, seed: int) -> torch.Tensor:
        """What an attacker sends instead of its model ``params`` (module docstring)."""
        a = self.cfg.attack
        match a.kind:
            case "sign_flip":
                return self.init - a.scale * (params - self.init)
            case "scale":
                return self.init + a.scale * (params - self.init)
            case "gaussian":
                gen = torch.Generator().manual_seed(seed)
                return params + (torch.randn(params.shape, generator=gen) * a.scale).to(params.device)
            case "nan":
                return torch.full_like(params, float("nan"))
            case "inf":
                return torch.full_like(params, float("inf"))
        return params

    def _on_wire(self, params: torch.Tensor, src: int, extra: dict[str, Any]) -> tuple[int, torch.Tensor | None]:
        """(encoded size, the model the receiver decodes; None if validation rejects it)."""
        self._msgs += 1
        seed = derive_seed(self.cfg.simulation.seed, 0x3E55, self.round, self._msgs)
        if self.attackers[src]:
            params = self._forge(params, seed)
        body = encode_gossip_model(params, self.spec, 0, extra, self.cfg.compression, seed)
        try:
            received, _ = decode_gossip_model(body, self.spec, self.max_bytes)
        except WireError as e:
            self.rejected += 1
            log.debug("rejected a model from %s: %s", self.ids[src], e)
            return len(body), None
        return len(body), received.to(params.device)

    def _size(self, msg: Message) -> int:
        if isinstance(msg, ModelMessage):
            return self.model_bytes
        return len(json.dumps({"sender": msg.sender, "entries": msg.entries}))

    def _send(self, msg: Message, now: float) -> None:
        src, dst = self.index[msg.sender], self.index[msg.target]
        if isinstance(msg, ModelMessage) and self.wire:
            size, params = self._on_wire(
                msg.params, src, {"age": msg.age, "num_examples": msg.num_examples, "sender": msg.sender}
            )
            self.bytes_sent[src] += size
            if params is None:
                return  # rejected by the receiver's validation: never merged, the sender times out
            msg = dataclasses.replace(msg, params=params)
        else:
            self.bytes_sent[src] += self._size(msg)
        if self.rng.random() < self.g.loss or self._partitioned(src, dst):
            self.lost += 1
            return
        delay = self.rng.exponential(self.g.latency) if self.g.latency > 0 else 0.0
        self._seq += 1
        heapq.heappush(self._queue, (now + delay, self._seq, msg))

    def _deliver(self, msg: Message, now: float) -> None:
        dst = self.index[msg.target]
        if not self.online[dst]:
            return  # the sender times out
        node = self.nodes[dst]
        if isinstance(msg, ModelMessage):
            if msg.reply:
                node.on_reply(msg, now)
            else:
                self._send(node.on_push(msg, now), now)
        elif isinstance(msg, ShuffleRequest):
            self._send(node.membership.on_shuffle_request(msg, now), now)
        else:
            node.membership.on_shuffle_response(msg, now)

    def _drain(self, until: float) -> None:
        while self._queue and self._queue[0][0] < until:
            t, _, msg = heapq.heappop(self._queue)
            self._deliver(msg, t)

    # --- churn and local work ------------------------------------------------------------

    def _churn(self) -> None:
        g = self.g
        self.leaving = np.zeros(self.n, dtype=bool)
        if g.churn <= 0:
            return
        back = 1.0 / g.churn_period
        leave = g.churn / ((1 - g.churn) * g.churn_period)
        u = self.rng.random(self.n)
        returning = ~self.online & (u < back)
        leaving = self.online & (u < leave)
        if g.churn_reset:
            for i in np.flatnonzero(returning):
                self.nodes[i].restart(self.init)
        if g.algorithm == "group_average":  # leavers vanish during this round's exchange (see there)
            self.leaving = leaving
            self.online = self.online | returning
            return
        self.online = (self.online & ~leaving) | returning

    def _train(self, i: int) -> None:
        self.trainer.fit(self.models[i], self.shards.data(i), derive_seed(self.cfg.simulation.seed, self.round, i))
        self.nodes[i].local_update(self.trainer.flat)

    def run_round(self) -> None:
        self.round += 1
        self._churn()
        start = float(self.round - 1)
        if self.w is not None:
            self._dpsgd_round(self.w)
            return
        if self.g.algorithm == "secure_groups":
            self._secure_groups_round()
            return
        if self.g.algorithm == "group_average":
            self._group_average_round(start)
            return
        order = np.flatnonzero(self.online)
        wake = start + self.rng.random(len(order))
        for t, i in sorted(zip(wake.tolist(), order.tolist())):
            self._drain(t)
            if not self.online[i]:
                continue
            node = self.nodes[i]
            node.expire(t)
            node.membership.expire(t)
            self._train(i)
            for _ in range(self.g.exchanges_per_round):
                msg = node.start_exchange(t)
                if msg is not None:
                    self._send(msg, t)
            req = node.membership.start_shuffle(t)
            if req is not None:
                self._send(req, t)
        self._drain(start + 1.0)

    def _secure_groups_round(self) -> None:
        """Every online peer trains, then random groups of ``gossip.group_size`` peers
        average securely (aggregation/secagg/group.py: Bonawitz et al.'s protocol among
        the members, one relaying): each member learns only its group's example-weighted
        average. What is masked is the model's offset from the shared seeded initial
        model, in fixed point clipped to ``secure_aggregation.clip`` per entry. Injected
        ``secure_aggregation.dropout_*`` rates drop members at each stage; a group left
        below the threshold keeps its models (the round is aborted for that group)."""
        sa = self.cfg.secure_aggregation
        live = [int(i) for i in np.flatnonzero(self.online)]
        for i in live:
            self._train(i)
        order = self.rng.permutation(live).tolist()
        size = self.g.group_size
        groups = [order[a : a + size] for a in range(0, len(order), size)]
        if len(groups) > 1 and len(groups[-1]) < 2:  # no group of one: it joins the previous
            groups[-2].extend(groups.pop())
        self.last_groups = groups
        rates = [getattr(sa, f"dropout_{s}") for s in STAGES]
        for gi, members in enumerate(groups):
            if len(members) < 2:
                continue
            ids = [self.ids[i] for i in members]
            offsets = {p: (self.models[i] - self.init).detach().cpu().numpy() for p, i in zip(ids, members)}
            weights = {p: float(self.shards.size(i)) for p, i in zip(ids, members)}
            drop_at = injected_dropouts(ids, rates, self.rng.random((len(ids), len(STAGES))))
            session = f"shoal-gossip/{self.cfg.simulation.seed}/{self.round}/{gi}".encode()
            try:
                out = secure_group_average(
                    offsets,
                    weights,
                    session=session,
                    clip=sa.clip,
                    bits=sa.bits,
                    threshold=sa.threshold,
                    drop_at=drop_at,
                    seed=derive_seed(sa.seed, self.cfg.simulation.seed, self.round, gi),
                )
            except SecAggAborted as e:
                self.aborted_groups += 1
                log.debug("round %d group %d aborted: %s", self.round, gi, e)
                continue
            avg = self.init + torch.from_numpy(out.mean).to(self.models.dtype).to(self.models.device)
            for p, i in zip(ids, members):
                self.bytes_sent[i] += out.cost.sent.get(p, 0)
                if p in out.included:
                    self.models[i].copy_(avg)

    def _group_average_round(self, start: float) -> None:
        """Every online peer trains, then the peers average exactly within the groups of the
        virtual grid (p2p/group_average.py, the objects ``shoal peer`` runs),
        ``gossip.exchanges_per_round`` = m times (each time along the grid's next axis: m = d on
        a full grid gives every peer the exact global average), over the virtual network: slice
        messages take the latency, are lost with ``gossip.loss``, never cross a partition; a
        message to an offline peer is refused (the sender learns it after one latency, as a
        refused connection); each phase waits at most ``gossip.timeout``. Every peer knows every
        peer (the directory real peers build by gossip), offline ones included. A peer that goes
        offline this round (churn) trains, starts, and vanishes at a uniformly random moment of
        the round's m exchanges, mid-exchange or between them; it keeps the model it had then.
        An exchange lasts until every group is done (deadlines included)."""
        g = self.g
        for i in np.flatnonzero(self.online):
            self._train(int(i))
        m = g.exchanges_per_round
        vanish = {int(i): float(self.rng.random()) * m for i in np.flatnonzero(self.leaving)}
        gone: set[int] = set()
        # the weight behind each model: its examples (or 1), then the summed weight of the group
        # average it holds, so that d exchanges on a full grid give the global weighted average
        self.ga_weight = {
            i: (float(self.shards.size(i)) if g.group_weights == "examples" else 1.0) for i in range(self.n)
        }
        for s in range(m):
            at = {i: start + (u - s) for i, u in vanish.items() if s <= u < s + 1}
            self._group_exchange((self.round - 1) * m + s, start, at, gone)
        self.online &= ~self.leaving

    def _group_exchange(self, step: int, start: float, vanish_at: dict[int, float], gone: set[int]) -> None:
        """One group-averaging exchange of every online peer not ``gone``; adds those that vanish."""
        g = self.g
        seed = self.cfg.simulation.seed
        paths = {p: grid_path(self.ids, p, step, g.group_size, g.group_levels, seed) for p in self.ids}
        groups = sorted({pth[0] for pth in paths.values()})
        self.last_groups = [[self.index[p] for p in grp] for grp in groups]
        queue: list[tuple[float, int, str, Any]] = []
        seq = 0

        def push(t: float, kind: str, item: Any) -> None:
            nonlocal seq
            seq += 1
            heapq.heappush(queue, (t, seq, kind, item))

        def delay() -> float:
            return float(self.rng.exponential(g.latency)) if g.latency > 0 else 0.0

        objs: dict[int, GridAverage] = {}
        self.group_stats["groups"] += sum(len(grp) >= 2 for grp in groups)
        for p, path in paths.items():
            i = self.index[p]
            if self.online[i] and i not in gone and any(len(grp) >= 2 for grp in path):
                objs[i] = GridAverage(p, path, step, self.models[i], self.ga_weight[i], start, g.timeout)
                push(start, "start", i)
        for i, t in vanish_at.items():
            push(t, "vanish", i)
        scheduled: dict[int, float] = {}

        def send(src: int, msgs: list[SliceMessage], t: float) -> None:
            for msg in msgs:
                self.bytes_sent[src] += len(encode_slice(msg, self.spec))
                dst = self.index[msg.target]
                if self.rng.random() < g.loss or self._partitioned(src, dst):
                    self.lost += 1
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
                self.group_stats["vanished"] += 1
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
                    send(src, objs[src].on_unreachable(self.ids[dst], t), t)
                continue
            msg: SliceMessage = item
            src, dst = self.index[msg.sender], self.index[msg.target]
            if dst in gone or dst not in objs:  # offline or vanished: the connection is refused
                push(t + delay(), "refused", (src, dst))
                continue
            try:
                send(dst, objs[dst].on_message(msg, t), t)
            except Refusal as e:
                self.rejected += 1
                log.debug("%s refused a slice from %s: %s", msg.target, msg.sender, e)
        for i, obj in objs.items():
            if i in gone:
                continue
            res = obj.result()
            self.models[i].copy_(res.values)
            self.ga_weight[i] = res.weight
            self.group_stats["late"] += res.late
            self.group_stats["repaired_slices"] += res.repaired
            self.group_stats["incomplete"] += int(not res.complete)

    def _dpsgd_round(self, w: torch.Tensor) -> None:
        """One D-PSGD round with the mixing matrix ``w`` (``self.w``)."""
        alive = torch.as_tensor(self.online)
        for i in np.flatnonzero(self.online):
            self._train(int(i))
        if self.g.loss > 0:  # each link is down this round with probability `loss`, both ways
            up = torch.as_tensor(self.rng.random((self.n, self.n)) >= self.g.loss, device=w.device)
            up = torch.triu(up, 1)
            up = up | up.T
            w = w * up
            w = w + torch.diag(1.0 - w.sum(1))
        live = np.flatnonzero(self.online)
        a = torch.as_tensor(self.online, device=w.device, dtype=w.dtype)
        w = w * a[:, None] * a[None, :]  # absent nodes: their weight moves to the diagonal
        w = w + torch.diag(1.0 - w.sum(1))
        nbrs = (w[live][:, live] > 0).sum(1).cpu().numpy() - 1
        for _ in range(self.g.exchanges_per_round):  # m gossip steps per round: X <- W^m X
            if not self.wire and not robust_mixing(self.cfg):
                self.models.copy_(gossip_average(w, self.models, alive).float())
                self.bytes_sent[live] += nbrs * self.model_bytes
                continue
            sent, ok = self.models.clone(), torch.ones(self.n, dtype=torch.bool, device=w.device)
            for k, i in enumerate(live):  # each node encodes its model once and sends it to every neighbour
                size, params = self._on_wire(
                    self.models[i], int(i), {"age": self.nodes[i].age, "num_examples": 1, "sender": self.ids[i]}
                )
                self.bytes_sent[i] += size * int(nbrs[k])
                if params is None:
                    ok[i] = False
                else:
                    sent[i] = params
            wk = w * ok[None, :].to(w.dtype)  # a rejected model is not mixed in: its weight stays home
            wk = wk + torch.diag(1.0 - wk.sum(1))
            if robust_mixing(self.cfg):
                mixed, clipped = robust_gossip_average(wk, sent.double(), self.models.double(), self.cfg)
                self.mix_bounded += clipped
            else:
                own = self.models.double()
                mixed = wk.to(own.dtype) @ sent.double() + torch.diag(wk).to(own.dtype)[:, None] * (own - sent.double())
            self.models.copy_(mixed.float())

    # --- metrics -------------------------------------------------------------------------

    def evaluate(self) -> dict[str, float]:
        """Metrics over the honest peers (all peers when there is no attack)."""
        per_peer = []
        for i in self.eval_idx:
            if self.test is not None:
                per_peer.append(self.trainer.evaluate_data(self.models[int(i)], self.test))
        honest = self.models[torch.as_tensor(self.honest, device=self.models.device)]
        mean_model = honest.mean(0)
        consensus = float((honest - mean_model).norm(dim=1).mean())
        out: dict[str, float] = {}
        if per_peer and self.test is not None:
            names = [k for k in per_peer[0] if k != "num_examples"]
            out.update({f"test_{k}": float(np.mean([p[k] for p in per_peer])) for k in names})
            if "accuracy" in names:
                accs = [p["accuracy"] for p in per_peer]
                out.update(
                    peer_accuracy_mean=float(np.mean(accs)),
                    peer_accuracy_min=float(np.min(accs)),
                    peer_accuracy_max=float(np.max(accs)),
                )
            avg = self.trainer.evaluate_data(mean_model, self.test)
            out.update({f"average_model_{k}": v for k, v in avg.items() if k != "num_examples"})
        if self.client_test is not None:  # each peer's own model on its own test data
            results = [
                self.trainer.evaluate_data(self.models[int(i)], own, summarize=False)
                for i in self.eval_idx
                if (own := self.client_test[int(i)]) is not None
            ]
            out.update({f"fed_{k}": v for k, v in weighted_means(results, self.task).items()})
        return {
            **out,
            "consensus_distance": consensus,
            "bytes_sent_per_peer": float(self.bytes_sent.mean()),
            "bytes_sent_per_peer_per_round": float(self.bytes_sent.mean()) / max(self.round, 1),
            "attackers": int(self.attackers.sum()),
            "rejected_messages": int(self.rejected),
            "bounded_merges": int(sum(nd.bounded for nd in self.nodes)) + self.mix_bounded,
            "online_peers": int(self.online.sum()),
            "aborted_groups": int(self.aborted_groups),
            **({f"group_{k}": v for k, v in self.group_stats.items()} if self.g.algorithm == "group_average" else {}),
            "messages_lost": int(self.lost),
            "mean_age": float(np.mean([nd.age for nd in self.nodes])),
            "mean_view_size": float(np.mean([len(nd.membership.view) for nd in self.nodes])),
        }


def run_gossip_simulation(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: OnRecord | None = None,
) -> dict[str, Any]:
    """Run ``simulation.rounds`` gossip rounds through the run loop (metrics.jsonl, summary.json, plots)."""
    sim_cfg = cfg.simulation
    t0 = time.perf_counter()
    sim = GossipSimulation(cfg)
    setup_s = time.perf_counter() - t0
    with RunLoop(cfg, out_dir, sim_cfg.rounds, sim.task_label, progress=progress, on_record=on_record) as loop:
        for r in range(1, sim_cfg.rounds + 1):
            sim.run_round()
            due = r % sim_cfg.eval_every == 0 or r == sim_cfg.rounds
            loop.step(Step(1, {"round": r, **sim.evaluate()} if due else None))
        last = loop.last
        return loop.finish(
            {
                "final_average_model_accuracy": last.get("average_model_accuracy"),
                "final_consensus_distance": last.get("consensus_distance"),
                "bytes_sent_per_peer": last.get("bytes_sent_per_peer"),
                "bytes_sent_per_peer_per_round": last.get("bytes_sent_per_peer_per_round"),
                "rounds": sim_cfg.rounds,
                "num_clients": sim.n,
                "num_parameters": sim.spec.numel,
                "device": str(sim.device),
            },
            setup_s,
            title=f"{sim.task_label} / {cfg.gossip.algorithm}",
        )
