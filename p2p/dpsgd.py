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

import numpy as np
import torch

TOPOLOGIES = ("ring", "torus", "regular", "small-world", "complete")


def _ring_edges(n: int, k: int = 1) -> set[tuple[int, int]]:
    return {tuple(sorted((i, (i + d) % n))) for i in range(n) for d in range(1, k + 1) if n > 1 and i != (i + d) % n}


def _torus_edges(n: int) -> set[tuple[int, int]]:
    """A rows x cols wrap-around grid with rows the largest divisor of n up to sqrt(n)."""
    rows = max(d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0)
    cols = n // rows
    edges = set()
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for j in (r * cols + (c + 1) % cols, ((r + 1) % rows) * cols + c):
                if i != j:
                    edges.add(tuple(sorted((i, j))))
    return edges


def _regular_edges(n: int, k: int, rng: np.random.Generator) -> set[tuple[int, int]]:
    """A random k-regular graph by the pairing model, retried until simple and connected."""
    if k >= n or (n * k) % 2:
        raise ValueError(f"no {k}-regular graph on {n} nodes (need k < n and n*k even)")
    for _ in range(1000):
        stubs = rng.permutation(np.repeat(np.arange(n), k))
        pairs = stubs.reshape(-1, 2)
        edges = {tuple(sorted((int(a), int(b)))) for a, b in pairs}
        if len(edges) == len(pairs) and all(a != b for a, b in edges) and _connected(n, edges):
            return edges
    # The pairing model's acceptance falls like exp(-(k^2 - 1) / 4) (~2e-4 at k = 6); past
    # that, pair the stubs one edge at a time among the pairs that keep the graph simple
    # (Steger & Wormald 1999), restarting on a dead end.
    for _ in range(1000):
        edges, stubs = set(), [int(v) for v in rng.permutation(np.repeat(np.arange(n), k))]
        while stubs:
            for _ in range(100):
                i, j = (int(x) for x in rng.choice(len(stubs), 2, replace=False))
                a, b = stubs[i], stubs[j]
                if a != b and (min(a, b), max(a, b)) not in edges:
                    break
            else:
                break  # no simple pair found: start over
            edges.add((min(a, b), max(a, b)))
            for idx in sorted((i, j), reverse=True):
                stubs.pop(idx)
        if not stubs and _connected(n, edges):
            return edges
    raise ValueError(f"could not draw a simple connected {k}-regular graph on {n} nodes")


def _small_world_edges(n: int, k: int, p: float, rng: np.random.Generator) -> set[tuple[int, int]]:
    """Watts-Strogatz: a ring lattice with k neighbours a side, each edge rewired with prob. p."""
    edges = set()
    for i, j in sorted(_ring_edges(n, k)):
        if rng.random() < p:
            choices = [m for m in range(n) if m != i and tuple(sorted((i, m))) not in edges]
            if choices:
                j = int(rng.choice(choices))
        edges.add(tuple(sorted((i, j))))
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
