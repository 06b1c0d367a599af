"""Hundreds of gossip peers in one process on a virtual network (``simulation.mode = "gossip"``).

network.py is the shared virtual network and peer population; push_pull.py, dpsgd.py,
group_average.py and secure_groups.py are the algorithms ``gossip.algorithm`` chooses
(run.py's ALGORITHMS); run.py composes them into GossipSimulation and runs it.
"""

from .network import GossipNetwork, LocalPeers, PeerPool, peer_id
from .run import ALGORITHMS, GossipAlgorithm, GossipSimulation, run_gossip_simulation

__all__ = [
    "ALGORITHMS",
    "GossipAlgorithm",
    "GossipNetwork",
    "GossipSimulation",
    "LocalPeers",
    "PeerPool",
    "peer_id",
    "run_gossip_simulation",
]
