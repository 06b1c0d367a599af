"""Secure aggregation (Bonawitz et al. 2017; the SecAgg+ graph of Bell et al. 2020).

``protocol``: the client and server state machines and their messages (sans-I/O);
``crypto``: X25519, HKDF, AES-GCM, the mask PRG, Shamir shares; ``graph``: who masks with whom
and the threshold; ``encoding``: fixed point with checked headroom; ``identity``: Ed25519
identities and signatures of the malicious-server variant; ``wire``: the messages on HTTP;
``memory``: a whole round in one process (simulator, tests); ``tiers``: edges that relay the
messages and add masked inputs without learning anything (hierarchies); ``group``: a group's secure
weighted mean (gossip groups, the simulator).
"""

from .protocol import (
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyDirectory,
    MaskedInput,
    MaskedSum,
    PeerKeys,
    PublicKeys,
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    SecAggRefused,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
    keyed_graph_seed,
)
from .server import SecAggResult, SecAggServer

__all__ = [
    "ConsistencyRequest",
    "ConsistencySignature",
    "EncryptedShares",
    "KeyDirectory",
    "MaskedInput",
    "MaskedSum",
    "PeerKeys",
    "PublicKeys",
    "SecAggAborted",
    "SecAggClient",
    "SecAggParams",
    "SecAggProtocolError",
    "SecAggRefused",
    "SecAggResult",
    "SecAggServer",
    "ShareDelivery",
    "UnmaskRequest",
    "UnmaskShares",
    "keyed_graph_seed",
]
