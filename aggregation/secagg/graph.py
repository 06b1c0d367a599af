"""Who masks with whom: the complete graph of Bonawitz et al. 2017, or the sparse
random graph of SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with
(Poly)Logarithmic Overhead", CCS'20).

SecAgg+ replaces the complete graph by a k-regular graph with k = O(log n): each client
agrees pairwise masks with, and secret-shares its keys among, only its k neighbours,
so client cost falls from O(n) to O(log n) and the server's dropout recovery from
O(n^2) to O(n log n) mask expansions. Following Bell et al. (Sec. 3.2) the graph is a
Harary graph H(k, n) (node i joined to i +- 1..k/2 mod n) under a uniformly random
relabelling of the nodes, drawn from a public seed. The secret-sharing threshold is
then counted per neighbourhood (a client plus its k neighbours).
"""

from __future__ import annotations

import math

import numpy as np

GRAPHS = ("full", "secagg+")


def auto_degree(n: int, dropout: float = 0.1, fraction: float = 0.5, failure: float = 1e-3) -> int:
    """The SecAgg+ degree for n clients: about 3 log2(n), raised until a round with
    independent dropout rate ``dropout`` fails with probability at most ``failure``.

    Bell et al. (Thm. 3.6) need k = O(log n), with a constant that grows with the
    dropout rate: every neighbourhood of k + 1 clients must keep t survivors. With
    survivors ~ Binomial(k + 1, 1 - dropout) the union bound over n neighbourhoods
    gives n * P(survivors < t) <= failure. At most n - 1 (the complete graph).
    """
    if n <= 1:
        return 0
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout = {dropout} must be in [0, 1)")
    k = min(max(2 * round(1.5 * math.log2(n)), 2), n - 1)
    while k < n - 1 and n * _below(k + 1, 1 - dropout, threshold(k + 1, fraction)) > failure:
        k = min(k + 2, n - 1)
    return k


def _below(m: int, p: float, t: int) -> float:
    """P(Binomial(m, p) < t)."""
    return sum(math.comb(m, i) * p**i * (1 - p) ** (m - i) for i in range(t))


def neighbours(ids: list[str], graph: str, degree: int, seed: int) -> dict[str, list[str]]:
    """Each id's neighbours (itself excluded) in the chosen graph over ``ids``.

    Symmetric (v is u's neighbour iff u is v's), as pairwise masks need.
    """
    if graph not in GRAPHS:
        raise ValueError(f"graph = {graph!r} is not one of {GRAPHS}")
    ids = sorted(ids)
    n = len(ids)
    if graph == "full" or degree >= n - 1:
        return {u: [v for v in ids if v != u] for u in ids}
    if degree < 1:
        raise ValueError(f"degree = {degree} must be >= 1 for the secagg+ graph")
    order = np.random.default_rng(seed).permutation(n)  # random relabelling
    position = {int(node): p for p, node in enumerate(order)}
    half, odd = degree // 2, degree % 2
    if odd and n % 2:  # no odd-degree regular graph on an odd number of nodes: round up
        half, odd = half + 1, 0
    out: dict[str, list[str]] = {}
    for i, u in enumerate(ids):
        p = position[i]
        near = {(p + d) % n for d in range(1, half + 1)} | {(p - d) % n for d in range(1, half + 1)}
        if odd:  # odd degree: also the opposite node (n even keeps the graph regular)
            near.add((p + n // 2) % n)
        near.discard(p)
        out[u] = sorted(ids[int(order[q])] for q in near)
    return out


def threshold(neighbourhood: int, fraction: float) -> int:
    """Shares needed to rebuild a secret held by ``neighbourhood`` clients: the
    smallest integer above ``fraction`` of them (0.5: a strict majority)."""
    if not 0 <= fraction < 1:
        raise ValueError(f"threshold fraction = {fraction} must be in [0, 1)")
    return min(neighbourhood, math.floor(fraction * neighbourhood) + 1)
