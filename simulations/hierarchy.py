"""Virtual edge aggregators: a root, ``hierarchy.edges`` edges, the clients under them.

The round runner of an InProcessSimulation (in this process or with the clients on Ray
workers) when ``hierarchy.edges > 0``. The root is the simulation's SyncRounds: it selects
the round's clients as it does flat. Each selected client trains under its edge; each edge
sums its clients' updates in an :class:`~shoal.aggregation.partial.Accumulator` and sends
one sealed :class:`~shoal.aggregation.partial.Partial` up (encoded and decoded as on the
wire: its bytes are measured, and a float32 wire form rounds as a deployment's does); the
root's :class:`~shoal.aggregation.partial.PartialInbox` merges the partials and hands one
sum to the root's strategy (SyncRounds.submit_sum), which divides and steps the server
optimizer. The same objects a deployed edge (server/edge/intake.py, rounds.py) drives.

HierFAVG (Liu et al. 2020, "Client-Edge-Cloud Hierarchical Federated Learning"):
``hierarchy.edge_rounds = kappa_2`` edge aggregations per root round. In edge round k the
edge's clients train from the edge's model; the edge averages their updates into its model
(a plain mean, lr 1); after the last one it sends ``W_e (x_e - x_global)``, where ``W_e`` is
the weight of its last edge round's clients, so the root's mean is the weighted mean of the
edge models. With kappa_2 = 1 that is exactly flat FedAvg's sum.

Failures: ``hierarchy.edge_failure`` is the probability an edge is lost in a root round
(seeded): its clients' work never reaches the root, which counts them as drop-outs (late, as
flat rounds count clients that did not report), or, with ``hierarchy.reattach``, its clients
re-attach to the live edges (the list of edges, in turn) and report there. A round whose every
edge was lost is aborted with the model unchanged.

Secure aggregation (``[secure_aggregation] enabled = true``, one edge round per root round): the
round's whole cohort runs one protocol (aggregation/secagg/tiers.py): every message of a client
goes through its edge, which relays it and adds its clients' masked vectors modulo 2^32 into one
masked sum for the root; the root unmasks the total and divides. An edge that fails does so in the
middle of the protocol, at a stage drawn with the failure (seeded): its clients are the
protocol's drop-outs from then on (recovered as the protocol recovers any, or the round aborts
below its threshold); they do not re-attach within the round, since the cohort was fixed when
the keys were advertised.

Per-round figures in metrics.jsonl (``hier_*``): bytes on each link (client-edge both ways,
edge-root both ways; the root's ingress is ``hier_bytes_edge_root_up``), edges that
reported and edges lost; their totals go to summary.json. With a link model (``link_latency_s``,
``*_mbps``; simulations/link_time.py) the round's modelled communication time, through the edges
(``hier_comm_s``) and flat (``hier_comm_flat_s``, the same clients' transfers to the root).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from shoal.aggregation.partial import Accumulator, PartialInbox, decode_partial, encode_partial
from shoal.aggregation.secagg import SecAggAborted
from shoal.aggregation.secagg.memory import STAGES
from shoal.aggregation.secagg.tiers import run_through_edges
from shoal.config import HierarchyConfig
from shoal.privacy_plan import plan_of
from shoal.rounds import Assignment
from shoal.seeding import derive_seed, rng
from shoal.update import PartialSum, Update
from shoal.wire import encode_model

from .link_time import EdgeTraffic, LinkModel, flat_round_s, tree_round_s

if TYPE_CHECKING:
    from .inprocess import InProcessSimulation
    from .secure_rounds import SecureAggregationRounds

log = logging.getLogger(__name__)

_FAILURE_STREAM = 0xED6E  # seeds edge failures apart from client sampling


def edge_name(e: int) -> str:
    return f"edge-{e:03d}"


def assign_edges(client_ids: list[str], cfg: HierarchyConfig, seed: int) -> dict[str, str]:
    """Each client's edge: contiguous blocks of the client list, a hash of the id, or a seeded
    shuffle dealt round-robin (balanced, like contiguous, but mixing the list's order)."""
    n, e = len(client_ids), cfg.edges
    if e <= 0:
        raise ValueError("assign_edges needs hierarchy.edges > 0")
    if cfg.assignment == "contiguous":
        return {c: edge_name(i * e // n) for i, c in enumerate(client_ids)}
    if cfg.assignment == "hash":
        return {c: edge_name(int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest(), "little") % e)
                for c in client_ids}  # fmt: skip
    order = rng(seed, 0xED6F).permutation(n)
    return {client_ids[int(j)]: edge_name(k % e) for k, j in enumerate(order)}


class LinkBytes:
    """Bytes on each link of the tree, this round and since the start."""

    KEYS = ("client_edge_down", "client_edge_up", "edge_root_down", "edge_root_up")

    def __init__(self) -> None:
        self.round = dict.fromkeys(self.KEYS, 0)
        self.total = dict.fromkeys(self.KEYS, 0)

    def reset(self) -> None:
        self.round = dict.fromkeys(self.KEYS, 0)

    def add(self, key: str, n: int) -> None:
        self.round[key] += n
        self.total[key] += n


class HierarchicalRound:
    """The round runner of virtual edges (a SummingRunner: InProcessSimulation.run_round submits
    the root's merged sum with SyncRounds.submit_sum)."""

    def __init__(self, sim: InProcessSimulation):
        self.sim = sim
        self.cfg = sim.cfg.hierarchy
        self.edge_of = assign_edges(sim.client_ids, self.cfg, sim.cfg.simulation.seed)
        self.edges = sorted(set(self.edge_of.values()))
        self.links = LinkBytes()
        h = self.cfg
        self.link_model = LinkModel(h.link_latency_s, h.root_mbps, h.edge_mbps, h.client_mbps)
        self.comm: tuple[float, float] | None = None  # this round's modelled (tree, flat) seconds
        self.lost: list[str] = []
        self.reported: list[str] = []
        self.lost_total = 0
        self.reattached = self.reattached_total = 0
        self._model_bytes: tuple[int, int] | None = None
        self.secure: SecureAggregationRounds | None = None  # the encoding and protocol set-up, shared with flat
        if sim.cfg.secure_aggregation.enabled:
            from .secure_rounds import SecureAggregationRounds

            self.secure = SecureAggregationRounds(sim)
        self.lost_stage: dict[str, str] = {}  # secure aggregation: the stage each lost edge failed at
        # distributed DP through edges: the root's DP mean takes the unmasked result as flat secure
        # aggregation hands it over (updates), since it sizes and checks the noise shares itself
        self.summing = self.secure is None or not plan_of(sim.cfg).client_shares

    def updates(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        """Secure aggregation with distributed DP: one protocol over every selected client through the
        edges, its unmasked result as flat secure aggregation yields it (the root's DP mean counts
        the noise shares). Otherwise the root takes partial sums (partial_sums)."""
        if self.summing:
            raise TypeError("HierarchicalRound hands the root partial sums (partial_sums), not single updates")
        assert self.secure is not None
        yield from self._through_edges(tasks, global_params)

    def _model_size(self, params: torch.Tensor, version: int) -> int:
        if self._model_bytes is None or self._model_bytes[0] != version:
            self._model_bytes = (version, len(encode_model(params, self.sim.spec, version)))
        return self._model_bytes[1]

    def _lost_edges(self, round: int, edges: list[str]) -> set[str]:
        p = self.cfg.edge_failure
        if p <= 0:
            return set()
        draws = rng(self.sim.cfg.simulation.seed, round, _FAILURE_STREAM).random(len(self.edges))
        return {e for e in edges if draws[self.edges.index(e)] < p}

    def partial_sums(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[PartialSum]:
        sim = self.sim
        by_edge, lost = self._start(tasks)
        if not tasks:
            return
        r, version = tasks[0].round, tasks[0].version
        if self.secure is not None:
            yield from self._secure_sums(by_edge, lost, global_params, r, version)
            return
        alive = {e: ts for e, ts in sorted(by_edge.items()) if e not in lost}
        if lost and self.cfg.reattach:  # each orphan takes the next live edge of the list, in turn
            live = [e for e in self.edges if e not in lost]
            orphans = [t for e in sorted(lost) for t in by_edge[e]]
            for i, t in enumerate(orphans if live else []):
                alive.setdefault(live[i % len(live)], []).append(t)
            self.reattached = len(orphans) if live else 0
            self.reattached_total += self.reattached
            alive = dict(sorted(alive.items()))
        model_size = self._model_size(global_params, version)
        for _ in alive:  # the root's model to each edge; the edge serves its clients from its cache
            self.links.add("edge_root_down", model_size)
        inbox = PartialInbox(r, version, sim.spec.numel, sim.cfg.strategy.weighting, children=set(alive))
        uploads: dict[str, list[int]] = {}  # edge -> its clients' upload bytes in each edge round
        sums = self._edge_rounds(alive, global_params, r, version, model_size, uploads)
        traffic: list[EdgeTraffic] = []
        for e, part in sums.items():
            body = encode_partial(part.sealed(e), sim.spec.hash, self.cfg.partial_dtype)
            self.links.add("edge_root_up", len(body))
            traffic.append(EdgeTraffic(len(alive[e]), tuple(uploads[e]), len(body)))
            received = decode_partial(body, sim.spec.numel, sim.spec.hash, max_bytes=len(body))
            inbox.offer(received)
        if self.link_model.enabled:
            first = sum(t.up_bytes[0] for t in traffic)  # flat: one cycle of the same clients
            self.comm = (
                tree_round_s(self.link_model, model_size, traffic),
                flat_round_s(self.link_model, model_size, sum(t.clients for t in traffic), first),
            )
        self.reported = inbox.origins
        if lost:
            what = "re-attached to other edges" if self.reattached else "dropped out"
            log.info("round %d: edge(s) %s lost; their %d client(s) %s", r, ", ".join(sorted(lost)),
                     sum(len(by_edge[e]) for e in lost), what)  # fmt: skip
        if not self.reported:
            raise SecAggAborted(f"every edge of round {r} was lost or got no update")
        yield inbox.total().to_partial_sum()

    def _start(self, tasks: list[Assignment]) -> tuple[dict[str, list[Assignment]], set[str]]:
        """A round's tasks by edge, and the edges lost in it (seeded)."""
        self.links.reset()
        self.comm = None
        by_edge: dict[str, list[Assignment]] = {}
        for t in tasks:
            by_edge.setdefault(self.edge_of[t.client_id], []).append(t)
        lost = self._lost_edges(tasks[0].round, sorted(by_edge)) if tasks else set()
        self.lost = sorted(lost)
        self.lost_total += len(lost)
        self.reattached = 0
        return by_edge, lost

    def _through_edges(
        self, tasks: list[Assignment], global_params: torch.Tensor
    ) -> Iterator[tuple[Assignment, Update]]:
        """The round's one secure aggregation through the edges: what SecureAggregationRounds.updates
        yields (the unmasked result per included client). Raises SecAggAborted below the threshold,
        or below t survivors under distributed DP (counted over the whole cohort: the clients inside
        the edges' masked sums)."""
        by_edge, lost = self._start(tasks)
        if not tasks:
            return
        yield from self._secure_updates(by_edge, lost, global_params, tasks[0].round, tasks[0].version)

    def _secure_sums(
        self, by_edge: dict[str, list[Assignment]], lost: set[str], global_params: torch.Tensor, r: int, version: int
    ) -> Iterator[PartialSum]:
        """One secure aggregation over every selected client, through the edges (see the module doc):
        the root's unmasked sum as one PartialSum. Raises SecAggAborted below the threshold."""
        acc = Accumulator(r, version, self.sim.spec.numel, self.sim.cfg.strategy.weighting)
        for _task, update in self._secure_updates(by_edge, lost, global_params, r, version):
            acc.add_update(update)
        if acc.count == 0:
            raise SecAggAborted(f"no masked input of round {r} reached the root")
        yield acc.partial().to_partial_sum()

    def _secure_updates(
        self, by_edge: dict[str, list[Assignment]], lost: set[str], global_params: torch.Tensor, r: int, version: int
    ) -> Iterator[tuple[Assignment, Update]]:
        assert self.secure is not None
        model_size = self._model_size(global_params, version)
        tasks = [t for _, ts in sorted(by_edge.items()) for t in ts]
        self.links.add("edge_root_down", model_size * len(by_edge))
        self.links.add("client_edge_down", model_size * len(tasks))
        draws = rng(self.sim.cfg.simulation.seed, r, _FAILURE_STREAM + 1).random(len(self.edges))
        self.lost_stage = {e: STAGES[int(draws[self.edges.index(e)] * len(STAGES))] for e in sorted(lost)}
        reported: set[str] = set()

        def through_edges(params, encoded, drop_at, seed):
            result, cost = run_through_edges(params, encoded, self.edge_of, drop_at, self.lost_stage, seed=seed)
            for key, n in cost.links.items():
                self.links.add(key, n)
            reported.update(self.edge_of[c] for c in result.included)
            return result, cost

        self.secure.transport = through_edges
        if lost:
            log.info("round %d: edge(s) %s lost mid-round (%s); their %d client(s) are the protocol's drop-outs", r,
                     ", ".join(sorted(lost)), ", ".join(f"{e} at {s}" for e, s in self.lost_stage.items()),
                     sum(len(by_edge[e]) for e in lost))  # fmt: skip
        try:
            yield from self.secure.updates(tasks, global_params)
        finally:
            self.reported = sorted(reported)

    def _edge_rounds(
        self,
        alive: dict[str, list[Assignment]],
        global_params: torch.Tensor,
        r: int,
        version: int,
        model_size: int,
        uploads: dict[str, list[int]],
    ) -> dict[str, Any]:
        """kappa_2 edge rounds of every live edge; each edge's partial (``W_e (x_e - x)`` as a sum).
        ``uploads`` gets each edge's client upload bytes of every edge round it ran."""
        sim = self.sim
        numel = sim.spec.numel
        weighting = sim.cfg.strategy.weighting
        models = {e: global_params for e in alive}
        kappa = self.cfg.edge_rounds
        out: dict[str, Any] = {}
        for k in range(kappa):
            # every edge's clients start at once (Ray: in parallel), then each edge sums what came back
            pending = {}
            for e, ts in alive.items():
                if e in out or (k > 0 and e not in models):
                    continue
                run = ts if k == 0 else [replace(t, seed=derive_seed(t.seed, 0xE06E, k)) for t in ts]
                self.links.add("client_edge_down", model_size * len(run))
                pending[e] = sim.submit_clients(run, models[e])
            for e, results in pending.items():
                acc = Accumulator(r, version, numel, weighting)
                before = sim.wire.bytes_up
                for task, update in results():
                    sent = sim.apply_client_steps(task, update)
                    if sent is None:
                        continue
                    acc.add_update(sent)
                    if k < kappa - 1:
                        sim.wire.accepted(task.client_id)  # the edge applied it (top-k error feedback)
                self.links.add("client_edge_up", sim.wire.bytes_up - before)
                uploads.setdefault(e, []).append(sim.wire.bytes_up - before)
                if acc.count == 0:
                    models.pop(e)  # nothing this edge round: the edge reports nothing this root round
                    continue
                part = acc.partial()
                if k == kappa - 1:
                    if k > 0:  # sum_i w_i (x_i - x) = sum_i w_i delta_i + W_e (x_e - x)
                        offset = models[e].to(torch.float64) - global_params.to(torch.float64)
                        part = replace(part, weighted_sum=part.weighted_sum + part.total_weight * offset.cpu())
                    out[e] = part
                else:
                    models[e] = (models[e] + part.mean().to(models[e].device)).detach()
        return out

    def round_fields(self) -> dict[str, Any]:
        """This round's per-tier figures for its metrics.jsonl record."""
        return {
            **{f"hier_bytes_{k}": v for k, v in self.links.round.items()},
            "hier_edges_reporting": len(self.reported),
            "hier_edges_lost": len(self.lost),
            "hier_clients_reattached": self.reattached,
            **({"hier_comm_s": self.comm[0], "hier_comm_flat_s": self.comm[1]} if self.comm is not None else {}),
        }

    def figures(self) -> dict[str, Any]:
        """Totals for summary.json."""
        return {
            "hierarchy_edges": len(self.edges),
            "hierarchy_edge_rounds": self.cfg.edge_rounds,
            "hierarchy_edges_lost_total": self.lost_total,
            "hierarchy_clients_reattached_total": self.reattached_total,
            **{f"hier_bytes_{k}_total": v for k, v in self.links.total.items()},
        }
