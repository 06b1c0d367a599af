"""Decentralized parallel SGD (D-PSGD, Lian et al. 2017) and its mixing matrices.

Every iteration each node takes a local gradient step and then replaces its model by a
weighted average of its neighbours' models: ``X <- W X`` with a symmetric doubly
stochastic mixing matrix ``W`` supported on the topology's edges (Lian et al., eq. (3)
and Assumption 1). The spectral gap ``1 - |lambda_2(W)|`` sets how fast the models reach
consensus; it must be positive (a connected graph) for D-PSGD to converge.

Weights are Metropolis-Hastings: ``W_ij = 1 / (1 + max(d_i, d_j))`` on an edge and the
rest of the row on the diagonal (Xiao and Boyd 2004), which is symmetric and doubly
stochastic for any undirected graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from shoal.config import GossipConfig, choices

from .group_average import Refusal
from .merge import MergeBound

TOPOLOGIES = choices(GossipConfig, "topology")  # declared once, on the config field


def _edge(a: int, b: int) -> tuple[int, int]:
    """An undirected edge, smaller end first."""
    return (a, b) if a <= b else (b, a)


def _ring_edges(n: int, k: int = 1) -> set[tuple[int, int]]:
    return {_edge(i, (i + d) % n) for i in range(n) for d in range(1, k + 1) if n > 1 and i != (i + d) % n}


def _torus_edges(n: int) -> set[tuple[int, int]]:
    """A rows x cols wrap-around grid with rows the largest divisor of n up to sqrt(n)."""
    rows = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
    cols = n // rows
    edges: set[tuple[int, int]] = set()
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for j in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                if i != j:
                    edges.add(_edge(i, j))
    return edges


def _regular_edges(n: int, k: int, rng: np.random.Generator) -> set[tuple[int, int]]:
    """A random k-regular graph by the pairing model, retried until simple and connected."""
    if k >= n or (n * k) % 2:
        raise ValueError(f"no {k}-regular graph on {n} nodes (need k < n and n*k even)")
    for _ in range(1000):
        stubs = rng.permutation(np.repeat(np.arange(n), k))
        pairs = stubs.reshape(-1, 2)
        edges = {_edge(int(a), int(b)) for a, b in pairs}
        if len(edges) == len(pairs) and all(a != b for a, b in edges) and _connected(n, edges):
            return edges
    # The pairing model's acceptance falls like exp(-(k^2 - 1) / 4) (~2e-4 at k = 6); past
    # that, pair the stubs one edge at a time among the pairs that keep the graph simple
    # (Steger & Wormald 1999), restarting on a dead end.
    for _ in range(1000):
        edges, free = set(), [int(v) for v in rng.permutation(np.repeat(np.arange(n), k))]
        while free:
            for _ in range(100):
                i, j = (int(x) for x in rng.choice(len(free), 2, replace=False))
                a, b = free[i], free[j]
                if a != b and (min(a, b), max(a, b)) not in edges:
                    break
            else:
                break  # no simple pair found: start over
            edges.add((min(a, b), max(a, b)))
            for idx in sorted((i, j), reverse=True):
                free.pop(idx)
        if not free and _connected(n, edges):
            return edges
    raise ValueError(f"could not draw a simple connected {k}-regular graph on {n} nodes")


def _small_world_edges(n: int, k: int, p: float, rng: np.random.Generator) -> set[tuple[int, int]]:
    """Watts-Strogatz: a ring lattice with k neighbours a side, each edge rewired with prob. p."""
    edges: set[tuple[int, int]] = set()
    for i, j in sorted(_ring_edges(n, k)):
        if rng.random() < p:
            choices = [m for m in range(n) if m != i and _edge(i, m) not in edges]
            if choices:
                j = int(rng.choice(choices))
        edges.add(_edge(i, j))
    for a, b in _ring_edges(n, 1):  # keep the ring so the graph stays connected
        edges.add((a, b))
    return edges


def _connected(n: int, edges: set[tuple[int, int]]) -> bool:
    adj: dict[int, list[int]] = {i: [] for i in range(n)}
    for a, b in edges:
        adj[a].append(b)
        adj[b].append(a)
    seen, stack = {0}, [0]
    while stack:
        for j in adj[stack.pop()]:
            if j not in seen:
                seen.add(j)
                stack.append(j)
    return len(seen) == n


def topology_edges(name: str, n: int, degree: int = 4, rewire: float = 0.1, seed: int = 0) -> set[tuple[int, int]]:
    """Undirected edges (i < j) of a named topology on ``n`` nodes."""
    rng = np.random.default_rng(seed)
    if name == "ring":
        return _ring_edges(n)
    if name == "torus":
        return _torus_edges(n)
    if name == "regular":
        return _regular_edges(n, degree, rng)
    if name == "small-world":
        return _small_world_edges(n, max(1, degree // 2), rewire, rng)
    if name == "complete":
        return {(i, j) for i in range(n) for j in range(i + 1, n)}
    raise ValueError(f"topology {name!r} is not one of {TOPOLOGIES}")


def metropolis_hastings(n: int, edges: set[tuple[int, int]]) -> torch.Tensor:
    """Symmetric doubly stochastic W (float64) with Metropolis-Hastings weights."""
    deg = np.zeros(n, dtype=np.int64)
    for a, b in edges:
        deg[a] += 1
        deg[b] += 1
    w = np.zeros((n, n))
    for a, b in edges:
        w[a, b] = w[b, a] = 1.0 / (1 + max(deg[a], deg[b]))
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return torch.from_numpy(w)


def mixing_matrix(name: str, n: int, degree: int = 4, rewire: float = 0.1, seed: int = 0) -> torch.Tensor:
    return metropolis_hastings(n, topology_edges(name, n, degree, rewire, seed))


def spectral_gap(w: torch.Tensor) -> float:
    """1 - the second largest eigenvalue modulus of a symmetric W."""
    eig = torch.linalg.eigvalsh(w.double()).abs().sort(descending=True).values
    return float(1.0 - eig[1]) if len(eig) > 1 else 1.0


def gossip_average(w: torch.Tensor, models: torch.Tensor, alive: torch.Tensor | None = None) -> torch.Tensor:
    """One D-PSGD averaging step ``X <- W X`` over the rows of ``models`` (one per node).

    With ``alive`` (bool per node), weights towards absent nodes fall back on the
    node's own model (their mass moves to the diagonal), so W restricted to the live
    nodes stays symmetric and doubly stochastic and absent nodes keep their models.
    """
    w = w.to(models.device, models.dtype)
    if alive is not None:
        a = alive.to(models.device, models.dtype)
        w = w * a[:, None] * a[None, :]
        w = w + torch.diag(1.0 - w.sum(dim=1))
    return w @ models


# --- D-PSGD between peers that only know a partial view (sans-I/O) -------------------------------


@dataclass(frozen=True)
class MixMessage:
    """A node's model of step ``step`` (after its local work) for a neighbour; ``reply`` marks
    the answer to a request."""

    sender: str
    target: str
    step: int
    params: torch.Tensor
    reply: bool = False
    seq: int = 0  # the sender's message counter (p2p/freshness.py)


class DpsgdStep:
    """One node's mixing step of D-PSGD on a time-varying graph drawn from the peers' views.

    Real peers have no global topology: each step, a node asks ``degree // 2`` peers drawn
    from its Cyclon view for their models (sending its own), and answers the requests of
    others while it has fewer than ``degree`` neighbours (a request beyond that is refused:
    ``busy``). Every edge then has weight ``1 / (1 + degree)`` on both sides, so each step's
    mixing matrix is symmetric and doubly stochastic (rows sum to at most
    ``degree / (1 + degree)``, the rest on the diagonal) whatever the graph drawn: D-PSGD
    over random time-varying graphs (Lian et al. 2017; Koloskova et al. 2020). A neighbour
    that does not answer by the step's end (``close_at``) is left out: its weight stays on
    the diagonal. ``now`` is passed in; no sockets, no clock.
    """

    def __init__(self, me: str, step: int, params: torch.Tensor, partners: list[str], degree: int, close_at: float):
        if degree < 1:
            raise ValueError("degree must be >= 1")
        self.me, self.step, self.degree, self.close_at = me, int(step), int(degree), float(close_at)
        self.own = params.detach().float().clone()
        self.partners = [p for p in dict.fromkeys(partners) if p != me][: max(1, degree // 2)]
        self.pending: set[str] = set()
        self.neighbours: dict[str, torch.Tensor] = {}
        self.refused = 0
        self.closed = False

    @property
    def weight(self) -> float:
        return 1.0 / (1 + self.degree)

    def start(self) -> list[MixMessage]:
        self.pending = set(self.partners)
        return [MixMessage(self.me, p, self.step, self.own.clone()) for p in self.partners]

    def on_request(self, msg: MixMessage, now: float) -> MixMessage:
        """Answer with our model and keep theirs for the mix (raises Refusal: busy, closed, stale)."""
        if msg.step != self.step:
            raise Refusal("stale_round", f"{self.me} mixes step {self.step}, not {msg.step}")
        if msg.sender == self.me or msg.reply or tuple(msg.params.shape) != tuple(self.own.shape):
            raise Refusal("malformed", "a request from another node, of our model's size")
        if self.closed or now >= self.close_at:
            raise Refusal("closed", f"{self.me} has mixed step {self.step} already")
        if msg.sender not in self.neighbours and len(self.neighbours) + len(self.pending) >= self.degree:
            self.refused += 1
            raise Refusal("busy", f"{self.me} has {self.degree} neighbours this step")
        self.neighbours[msg.sender] = msg.params.detach().float()
        return MixMessage(self.me, msg.sender, self.step, self.own.clone(), reply=True)

    def on_reply(self, msg: MixMessage, now: float) -> None:
        if msg.sender in self.pending and msg.step == self.step and not self.closed:
            self.pending.discard(msg.sender)
            self.neighbours[msg.sender] = msg.params.detach().float()

    def on_unreachable(self, peer: str, now: float) -> None:
        self.pending.discard(peer)

    def tick(self, now: float) -> None:
        if now >= self.close_at:
            self.closed = True

    @property
    def done(self) -> bool:
        return self.closed

    def result(self, bound: MergeBound | None = None) -> torch.Tensor:
        """``x + w sum_j (x_j - x)`` over the neighbours that exchanged with us this step.

        With ``bound`` (the peer's merge bound), each neighbour's model passes it first:
        ``x_j - x`` clipped to the bound (self-centered clipping, He, Karimireddy and Jaggi
        2022), or left out with its weight on the diagonal when the bound refuses it. One
        neighbour then moves us by at most ``w x bound`` a step while the others pull back;
        clipping only the mixed result instead would let one far-off model set its
        direction every step and double our norm."""
        self.closed = True
        out = self.own.double()
        acc = torch.zeros_like(out)
        for sender, x in self.neighbours.items():
            if bound is not None:
                kept = bound.apply(self.own, x, sender)
                if kept is None:
                    continue
                x = kept
            acc += x.double() - out
        return (out + self.weight * acc).float()
