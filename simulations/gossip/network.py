"""The virtual network and the peer population every gossip algorithm runs on.

Every peer is a :class:`~shoal.p2p.gossip.GossipNode` with a Cyclon
:class:`~shoal.p2p.membership.Membership`, the same objects ``shoal peer`` drives over
HTTP. The transport is an event queue on a virtual clock measured in rounds: messages
take an exponential delay (``gossip.latency`` rounds on average), are lost with
probability ``gossip.loss``, never cross a partition, and never reach a peer that is
offline. Peers are data, not model copies: all models are rows of one (peers x
parameters) float32 tensor; their local training goes through one :class:`PeerPool`.

Churn is a two-state Markov chain per peer whose stationary offline share is
``gossip.churn`` and whose mean offline spell is ``gossip.churn_period`` rounds.

Attacks (``[attack]``). A seeded ``attack.fraction`` of the peers follow the protocol but
send a forged model in every message: relative to the initial model ``x0`` that every
peer shares, ``sign_flip`` sends ``x0 - scale (x - x0)``, ``scale`` sends
``x0 + scale (x - x0)``, ``gaussian`` sends ``x + N(0, scale^2)``, ``nan`` / ``inf`` a
model full of NaN / Inf; ``label_flip`` attackers train on flipped labels. Metrics are
over the honest peers only.

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
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, Self

import numpy as np
import torch

from shoal import assembly
from shoal.assembly import GossipParts, task_label
from shoal.client.pipeline import ClientPipeline
from shoal.config import Config
from shoal.errors import WireError
from shoal.p2p.freshness import Stale
from shoal.p2p.gossip import GossipNode, ModelMessage
from shoal.p2p.membership import Membership, ShuffleRequest, ShuffleResponse
from shoal.p2p.merge import MergeRule
from shoal.p2p.model_wire import decode_gossip_model, encode_gossip_model
from shoal.p2p.robust import make_merge_bound
from shoal.privacy_plan import LOCAL_UPLOAD_EXAMPLES, plan_of
from shoal.seeding import derive_seed
from shoal.task import SimulationData, Task
from shoal.wire import encode_model

from ..attacks import choose_attackers, flip_labels, label_count
from ..inprocess import weighted_means

log = logging.getLogger(__name__)

FORGET_AFTER = 20.0  # rounds before a directory entry no one vouched for is forgotten (p2p/service.py: seconds)

Message = ModelMessage | ShuffleRequest | ShuffleResponse


def peer_id(i: int) -> str:
    return f"peer-{i:05d}"


class PeerPool(Protocol):
    """Who runs the peers' local training: this process (LocalPeers) or workers elsewhere."""

    def train(self, indices: list[int], models: torch.Tensor, round: int) -> Iterator[tuple[int, torch.Tensor]]:
        """One round of local work for each peer in ``indices``, each from its row of ``models``:
        yields (peer, its new row). A whole list lets a distributed pool batch the peers."""
        ...


class LocalPeers:
    """The peers train here, one after another, with the network's trainer (DP-SGD with
    privacy.mode = 'local')."""

    def __init__(self, net: GossipNetwork):
        self.net = net

    def train(self, indices: list[int], models: torch.Tensor, round: int) -> Iterator[tuple[int, torch.Tensor]]:
        net = self.net
        for i in indices:
            net.pipeline.local_step(models[i], net.shards.data(i), derive_seed(net.cfg.simulation.seed, round, i))
            yield i, net.trainer.flat.clone()


def peer_nodes(
    cfg: Config, ids: list[str], models: torch.Tensor, shared: list[int], rng: np.random.Generator
) -> list[GossipNode]:
    """Peer i's GossipNode: its model is row i of ``models``, it tells others ``shared[i]``
    examples, and its Cyclon membership starts from a random view of others (never itself)."""
    g, n, seed = cfg.gossip, len(ids), cfg.simulation.seed
    rule = MergeRule(g.merge, g.staleness_exponent, g.max_age_gap, cfg.robust.norm_bound, g.bound_mode)
    k0 = min(g.view_size, n - 1)
    nodes = []
    for i in range(n):
        others = [j for j in rng.choice(n - 1, size=k0, replace=False)]
        boot = tuple(ids[j if j < i else j + 1] for j in others)
        m = Membership(
            ids[i],
            g.view_size,
            g.shuffle_length,
            g.timeout,
            g.max_failures,
            quarantine=10 * g.churn_period,
            forget_after=FORGET_AFTER,
            seed=derive_seed(seed, 0xC1C, i),
            bootstrap_peers=boot,
            samplers=g.samplers,
            push_share=g.push_share,
            pull_share=g.pull_share,
            # seeded keys so a run repeats (``shoal peer`` draws them from the OS); the simulated
            # attackers never read them
            sampler_keys=random.Random(derive_seed(seed, 0x5A3, i)).randbytes,
        )
        nodes.append(GossipNode(m, models[i], shared[i], rule, g.timeout, make_merge_bound(cfg)))
    return nodes


class GossipNetwork:
    """Peers, virtual network, churn and attackers built from a Config; no algorithm logic."""

    def __init__(self, parts: GossipParts, peers: Callable[[GossipNetwork], PeerPool] | None = None):
        if not isinstance(parts, GossipParts):
            raise TypeError(
                f"{type(self).__name__} takes the parts shoal.assembly builds, not a {type(parts).__name__}: "
                f"{type(self).__name__}.from_config(cfg, data, task) builds them"
            )
        self.parts = parts
        self.cfg = cfg = parts.cfg
        sim, g = cfg.simulation, cfg.gossip
        self.g = g
        self.device, self.task, self.data, self.shards = parts.device, parts.task, parts.data, parts.shards
        self.trainer = parts.client.trainer  # DP-SGD with privacy.mode = 'local'
        self.pipeline = ClientPipeline(parts.client.program)  # a peer's local step, seeded as every client's
        self.spec = self.trainer.spec
        self.test, self.client_test = parts.test, parts.client_test
        self.num_classes: int | None = getattr(self.task, "num_classes", None)
        self.task_label = task_label(cfg, self.task)
        n = len(self.shards)
        self.n = n
        self.init = self.trainer.flat.detach().clone()
        self.models = self.init.repeat(n, 1)  # row i is peer i's model
        self.rng = np.random.default_rng(derive_seed(sim.seed, 0x6055))
        self.ids = [peer_id(i) for i in range(n)]
        self.index = {p: i for i, p in enumerate(self.ids)}
        self.nodes = peer_nodes(cfg, self.ids, self.models, [self.shared_size(i) for i in range(n)], self.rng)
        self.online = np.ones(n, dtype=bool)
        self.leaving = np.zeros(n, dtype=bool)
        if g.churn > 0:
            self.online = self.rng.random(n) >= g.churn
        self.round = 0
        self.trained: list[int] = []  # every local training so far this round, in order (privacy accounting)
        self._queue: list[tuple[float, int, Message]] = []
        self._seq = 0
        # Sizes of what travels, measured on the real wire encodings.
        self.model_bytes = len(
            encode_model(self.init, self.spec, 0, {"age": 0, "num_examples": 1, "sender": self.ids[0]})
        )
        self.bytes_sent = np.zeros(n, dtype=np.int64)
        self.lost = 0
        self.rejected = 0
        self.mix_bounded = 0  # received models clipped by robust.norm_bound outside the nodes (D-PSGD mixing)
        self.aborted_groups = 0  # groups whose averaging aborted (secure groups left below the threshold)
        self.max_bytes = self.model_bytes + (1 << 20)
        atk = cfg.attack
        self.attackers = self._choose_attackers()
        c = cfg.compression
        self.wire = c.encoding != "dense" or c.zstd or (atk.kind not in ("none", "label_flip") and atk.fraction > 0)
        self._msgs = 0
        self.honest = np.flatnonzero(~self.attackers)
        eval_n = len(self.honest) if g.eval_peers == 0 else min(g.eval_peers, len(self.honest))
        self.eval_idx = np.sort(self.rng.choice(self.honest, size=eval_n, replace=False))
        self.peers: PeerPool = (peers or LocalPeers)(self)
        log.info(
            "gossip simulation: %d peers, %s (%d parameters), %s", n, self.task_label, self.spec.numel, g.algorithm
        )

    def _choose_attackers(self) -> np.ndarray:
        """``attack.fraction`` of the peers, seeded (a boolean mask); label flippers' labels flipped."""
        atk, n = self.cfg.attack, self.n
        attackers = np.zeros(n, dtype=bool)
        if atk.kind != "none" and atk.fraction > 0:
            for p in choose_attackers(self.ids, atk.fraction, self.cfg.simulation.seed):
                attackers[self.index[p]] = True
            if atk.kind == "label_flip":
                for i in np.flatnonzero(attackers).tolist():
                    flip_labels(self.shards.get(int(i))[1], label_count(self))
            log.info("attack %s: %d of %d peers", atk.kind, int(attackers.sum()), n)
        return attackers

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        data: SimulationData | None = None,
        task: Task | None = None,
        peers: Callable[[GossipNetwork], PeerPool] | None = None,
    ) -> Self:
        """The network of ``cfg``, its parts built by shoal.assembly (``data`` and ``task`` default to
        the config's task and its simulation data); ``peers`` makes the pool that trains the peers."""
        return cls(assembly.build(cfg, task, "gossip", data=data), peers)

    # --- the virtual network -------------------------------------------------------------

    def partitioned(self, a: int, b: int) -> bool:
        g = self.g
        if not g.partition_start <= self.round - 1 < g.partition_end:
            return False
        return (a < self.n // 2) != (b < self.n // 2)

    def forge(self, params: torch.Tensor, seed: int) -> torch.Tensor:
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

    def on_wire(self, params: torch.Tensor, src: int, extra: dict[str, Any]) -> tuple[int, torch.Tensor | None]:
        """(encoded size, the model the receiver decodes; None if validation rejects it)."""
        self._msgs += 1
        seed = derive_seed(self.cfg.simulation.seed, 0x3E55, self.round, self._msgs)
        if src >= 0 and self.attackers[src]:
            params = self.forge(params, seed)
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

    def send(self, msg: Message, now: float) -> None:
        """Put ``msg`` on the wire. A message to an address no peer has (one an attacker made up)
        goes nowhere: its sender times out. One from a made-up sender is sent by an attacker
        (bench/byzantine_gossip.py), its bytes uncounted."""
        src, dst = self.index.get(msg.sender, -1), self.index.get(msg.target)
        if dst is None:
            self.lost += 1
            return
        if isinstance(msg, ModelMessage) and self.wire:
            size, params = self.on_wire(
                msg.params, src, {"age": msg.age, "num_examples": msg.num_examples, "sender": msg.sender}
            )
            self.bytes_sent[max(src, 0)] += size
            if params is None:
                return  # rejected by the receiver's validation: never merged, the sender times out
            msg = dataclasses.replace(msg, params=params)
        elif src >= 0:
            self.bytes_sent[src] += self._size(msg)
        if self.rng.random() < self.g.loss or (src >= 0 and self.partitioned(src, dst)):
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
                return
            try:
                answer = node.on_push(msg, now)
            except Stale:  # a replayed or out-of-order push: refused, moves nothing; the sender times out
                self.rejected += 1
                return
            self.send(answer, now)
        elif isinstance(msg, ShuffleRequest):
            self.send(node.membership.on_shuffle_request(msg, now), now)
        else:
            node.membership.on_shuffle_response(msg, now)

    def drain(self, until: float) -> None:
        """Deliver every queued message due before ``until``, in time order."""
        while self._queue and self._queue[0][0] < until:
            t, _, msg = heapq.heappop(self._queue)
            self._deliver(msg, t)

    # --- churn and local work ------------------------------------------------------------

    def churn(self, leave_mid_round: bool = False) -> None:
        """This round's comings and goings; with ``leave_mid_round`` the leavers stay online,
        marked in ``leaving``, for an algorithm that lets them vanish during the round."""
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
        if leave_mid_round:
            self.leaving = leaving
            self.online = self.online | returning
            return
        self.online = (self.online & ~leaving) | returning

    def train(self, indices: list[int]) -> None:
        """One round of local work for these peers, through the peer pool: the one place peers
        train, so ``trained`` lists every local training (what DP-SGD's accounting charges)."""
        for i, row in self.peers.train(indices, self.models, self.round):
            self.trained.append(i)
            self.nodes[i].local_update(row)

    def online_peers(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.online)]

    def shared_size(self, i: int) -> int:
        """The example count peer ``i`` tells others (merge and group weights): its shard's size,
        or 1 under local DP, where the count is data-dependent and not noised (p2p/peer.py does the same)."""
        return LOCAL_UPLOAD_EXAMPLES if plan_of(self.cfg).dp_sgd else self.shards.size(i)

    # --- metrics -------------------------------------------------------------------------

    def peer_metrics(self, extra: Mapping[str, float]) -> dict[str, float]:
        """Metrics over the honest peers (all peers when there is no attack); ``extra`` are the
        algorithm's own counters."""
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
            **extra,
            "messages_lost": int(self.lost),
            "mean_age": float(np.mean([nd.age for nd in self.nodes])),
            "mean_view_size": float(np.mean([len(nd.membership.view) for nd in self.nodes])),
        }
