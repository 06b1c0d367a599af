"""How long a round's transfers take on a tree of links: the simulator's modelled communication time.

The virtual edges of simulations/hierarchy.py measure the bytes on every link; this module turns
them into seconds with a small fluid model (``[hierarchy]`` ``link_latency_s``, ``root_mbps``,
``edge_mbps``, ``client_mbps``; docs/hierarchy.md):

- every hop costs ``link_latency_s`` one way;
- a hop from a hub (the root, or an edge) to its children moves as fast as the slower of two
  links allows: the hub's, shared by every transfer it makes in that hop (the total bytes at the
  hub's rate), and one child's, which carries only its own transfer (0 Mbit/s: not a limit);
- a round is the root's model down to the edges, each edge's ``edge_rounds`` cycles with its
  clients (model down, updates up), all edges at once (the round waits for the slowest), and
  the partials up to the root.

Local training is not in it (it is the same with and without edges: the virtual clock of
``[heterogeneity]`` models it for flat runs); neither are queues, TCP's slow start nor the
per-stage round trips of secure aggregation. The flat figure prices the same round's client
transfers with every client talking to the root: the side-by-side is about where the bytes go.
Pure arithmetic, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    latency_s: float = 0.0  # one way, every hop
    root_mbps: float = 0.0  # the root's link, shared by its transfers (0: not a limit)
    edge_mbps: float = 0.0  # each edge's link
    client_mbps: float = 0.0  # each client's link

    @property
    def enabled(self) -> bool:
        return self.latency_s > 0 or self.root_mbps > 0 or self.edge_mbps > 0 or self.client_mbps > 0

    @staticmethod
    def transfer_s(nbytes: float, mbps: float) -> float:
        return nbytes * 8 / (mbps * 1e6) if mbps > 0 else 0.0

    def hop_s(self, total_bytes: float, each_bytes: float, hub_mbps: float, leaf_mbps: float) -> float:
        """One hop between a hub and its children: ``total_bytes`` through the hub's link, at most
        ``each_bytes`` through any child's."""
        return self.latency_s + max(self.transfer_s(total_bytes, hub_mbps), self.transfer_s(each_bytes, leaf_mbps))


@dataclass(frozen=True)
class EdgeTraffic:
    """One edge's part of a round: its clients, its clients' uploads summed in each edge round it
    ran, and the bytes of the partial it sent up."""

    clients: int
    up_bytes: tuple[int, ...]
    partial_bytes: int


def tree_round_s(m: LinkModel, model_bytes: int, edges: list[EdgeTraffic]) -> float:
    """The modelled communication time of a round through edges (0 with no edge)."""
    if not edges:
        return 0.0
    down = m.hop_s(len(edges) * model_bytes, model_bytes, m.root_mbps, m.edge_mbps)
    cycles = max(
        sum(
            m.hop_s(e.clients * model_bytes, model_bytes, m.edge_mbps, m.client_mbps)
            + m.hop_s(up, up / e.clients, m.edge_mbps, m.client_mbps)
            for up in e.up_bytes
        )
        for e in edges
    )
    partials = [e.partial_bytes for e in edges]
    up = m.hop_s(sum(partials), max(partials), m.root_mbps, m.edge_mbps)
    return down + cycles + up


def flat_round_s(m: LinkModel, model_bytes: int, clients: int, up_bytes: int) -> float:
    """The same clients' transfers with every client talking to the root (one cycle)."""
    if clients == 0:
        return 0.0
    down = m.hop_s(clients * model_bytes, model_bytes, m.root_mbps, m.client_mbps)
    return down + m.hop_s(up_bytes, up_bytes / clients, m.root_mbps, m.client_mbps)
