"""Secure aggregation across tiers: edges that relay and add, and learn nothing.

The mask graph spans the whole round's cohort, as in the flat protocol (every node under every
edge advertises keys to the root, which builds one graph and one threshold over all of them).
An edge aggregator between nodes and the root only

* relays the protocol's messages: public keys, share ciphertexts (AES-GCM under keys that only
  the two nodes of a pair agree), survivor lists, and the unmasking answers, which each node
  seals to the root's key of the round (:func:`seal_for_root`), so the edge holds no share in
  the clear;
* adds its nodes' masked inputs modulo 2^32 (:class:`EdgeMaskedSum`) and sends the root one
  :class:`~.protocol.MaskedSum` naming the nodes inside. The root's
  :meth:`~.server.SecAggServer.receive_masked_sum` takes it as if each of those nodes had sent
  its own masked input, each node counted at most once.

A masked input is uniform modulo 2^32 whatever the input (its self mask alone is a fresh PRG
stream), and so is the edge's sum of them; a lost edge (or one that withholds its sum) leaves
its nodes in U2 \\ U3, and the root recovers them as drop-outs: their pairwise masks come off
through the other nodes' shares, within the protocol's threshold.

:func:`run_through_edges` is one such round in memory (the simulator's virtual edges, tests,
bench/hierarchy.py): the same state machines as :func:`~.memory.run_in_memory`, each message
routed over its node's edge, per-link bytes counted, and optionally everything each edge
received recorded (``views``) for the tests that show it reveals nothing.
"""

from __future__ import annotations

import base64
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.errors import Malformed
from shoal.wire import encode, read_header

from . import crypto as C
from .memory import STAGES, SecAggCost, client_randomness
from .protocol import (
    MaskedInput,
    MaskedSum,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    UnmaskShares,
)
from .server import SecAggResult, SecAggServer
from .wire import decode_message, encode_message

INFO_SEAL = b"shoal secagg v1 unmasking sealed to the root"
SEALED_OVERHEAD = 32 + 12 + 16  # ephemeral key, nonce, tag


class EdgeMaskedSum:
    """An edge's sum of its nodes' masked inputs for one secure round, without I/O.

    Takes a :class:`MaskedInput` only from a node it was given for the round (``nodes``), once,
    of the round's shape; anything else is refused (SecAggProtocolError) with nothing changed.
    :meth:`sealed` is the :class:`MaskedSum` to send up (None when nothing came)."""

    def __init__(self, edge: str, vector_size: int, nodes: Iterable[str]):
        self.edge = edge
        self.vector_size = vector_size
        self.nodes = set(nodes)
        self.senders: list[str] = []
        self._seen: set[str] = set()
        self._sum = np.zeros(vector_size, dtype=np.uint32)

    def add(self, msg: MaskedInput) -> None:
        if msg.sender not in self.nodes:
            raise SecAggProtocolError(f"edge {self.edge!r}: {msg.sender!r} has no part in this round here")
        if msg.sender in self._seen:
            raise SecAggProtocolError(f"edge {self.edge!r}: {msg.sender!r} already sent its masked input")
        y = np.asarray(msg.vector)
        if y.dtype != np.uint32 or y.shape != (self.vector_size,):
            raise SecAggProtocolError(f"{msg.sender!r}: masked input must be uint32 of shape ({self.vector_size},)")
        self._sum += y  # wraps mod 2^32: the sum of masked vectors is itself masked
        self._seen.add(msg.sender)
        self.senders.append(msg.sender)

    @property
    def complete(self) -> bool:
        return self._seen >= self.nodes

    def sealed(self) -> MaskedSum | None:
        if not self.senders:
            return None
        return MaskedSum(self.edge, tuple(sorted(self.senders)), self._sum.copy())


# --- the unmasking answers, sealed to the root ---------------------------------------------


@dataclass(frozen=True)
class RootKey:
    """The root's key of one round: its public half goes to every node with the round's task."""

    private: bytes
    public: bytes

    @classmethod
    def new(cls, rand: C.Randomness) -> RootKey:
        sk = C.generate_private(rand)
        return cls(sk, C.public_key(sk))


def _seal_info(session: bytes, sender: str) -> bytes:
    return b"|".join([INFO_SEAL, session, sender.encode()])


def seal_for_root(plain: bytes, root_public: bytes, session: bytes, sender: str, rand: C.Randomness) -> bytes:
    """``plain`` (a node's encoded unmasking answer) encrypted to the root: an ephemeral X25519
    key, HKDF bound to the session and the sender, AES-GCM. Only the root's private key opens it."""
    C.check_public_key(root_public)
    eph = C.generate_private(rand)
    key = C.agree(C.private_key(eph), root_public, _seal_info(session, sender), session)
    return C.public_key(eph) + C.encrypt(key, plain, _seal_info(session, sender), rand)


def open_at_root(blob: bytes, root: RootKey, session: bytes, sender: str) -> bytes | None:
    """The plaintext of :func:`seal_for_root`, or None when it does not open (wrong key, sender or
    session, or tampered)."""
    if len(blob) < SEALED_OVERHEAD:
        return None
    try:
        C.check_public_key(blob[:32])
        key = C.agree(C.private_key(root.private), blob[:32], _seal_info(session, sender), session)
    except ValueError:
        return None
    return C.decrypt(key, blob[32:], _seal_info(session, sender))


SEALED_KIND = "sealed_unmask"


def seal_message(body: bytes, root_public: bytes, session: bytes, sender: str, meta: dict[str, Any]) -> bytes:
    """A node's encoded unmasking answer as it travels through an edge: sealed to the root's key of
    the round (:func:`seal_for_root`, OS randomness), with ``meta`` (the round) beside it in the clear."""
    blob = seal_for_root(body, root_public, session, sender, C.Randomness())
    return encode({}, {"kind": SEALED_KIND, "sender": sender, "sealed": base64.b64encode(blob).decode(), "meta": meta})


def open_message(body: bytes, root: RootKey, session: bytes, sender: str, max_bytes: int) -> bytes:
    """The answer inside :func:`seal_message`'s body; Malformed unless it is sealed by ``sender`` to
    this round's root key (a plain answer is refused too: through an edge it would be in the clear)."""
    header, _ = read_header(body, max_bytes)
    if header.get("kind") != SEALED_KIND:
        raise Malformed("the unmasking answer must be sealed to the root's key of the round (root_key in the task)")
    if header.get("sender") != sender:
        raise Malformed(f"a sealed answer of {str(header.get('sender'))[:60]!r}, not of {sender!r}")
    sealed = header.get("sealed")
    try:
        blob = base64.b64decode(sealed, validate=True) if isinstance(sealed, str) else b""
    except ValueError:  # not base64, or a str with non-ASCII characters (b64decode raises ValueError)
        blob = b""
    plain = open_at_root(blob, root, session, sender)
    if plain is None:
        raise Malformed("the sealed unmasking answer does not open under the root's key of this round")
    return plain


# --- one round in memory, through edges ----------------------------------------------------


@dataclass
class EdgeView:
    """Everything one edge received in a round, in both directions (what a curious edge holds)."""

    up: list[tuple[str, object]] = field(default_factory=list)  # (stage, message from a node)
    down: list[tuple[str, object]] = field(default_factory=list)  # (stage, message from the root)
    masked_sum: MaskedSum | None = None  # what it added and sent up


@dataclass
class TierCost(SecAggCost):
    """SecAggCost plus the bytes on each link of the tree (the keys of simulations.hierarchy.LinkBytes)."""

    links: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def run_through_edges(
    params: SecAggParams,
    inputs: dict[str, np.ndarray],
    edge_of: dict[str, str],
    drop_at: dict[str, str] | None = None,
    lost_at: dict[str, str] | None = None,
    seed: int | None = None,
    views: dict[str, EdgeView] | None = None,
) -> tuple[SecAggResult, TierCost]:
    """One secure aggregation over ``inputs`` (node -> encoded uint32 vector) whose nodes reach the
    root through edges (``edge_of``: node -> edge). ``drop_at``: a node's own drop-out stage (as in
    run_in_memory); ``lost_at``: an edge lost at a stage (one of STAGES): from then on nothing of
    its nodes reaches the root, so lost at "masked" means its nodes' masked inputs reached the edge
    but its sum never reached the root. ``views``: filled with each edge's :class:`EdgeView`.
    Only the honest-but-curious (non-malicious) variant. Raises SecAggAborted like the server."""
    if params.malicious:
        raise ValueError("run_through_edges runs the honest-but-curious variant")
    drop_at, lost_at = dict(drop_at or {}), dict(lost_at or {})
    for who, stage in [*drop_at.items(), *lost_at.items()]:
        if stage not in STAGES:
            raise ValueError(f"drop stage {stage!r} of {who!r} is not one of {STAGES}")
    missing = sorted(set(inputs) - set(edge_of))
    if missing:
        raise ValueError(f"nodes without an edge: {missing[:5]}")
    cost = TierCost()
    ids = sorted(inputs)
    server = SecAggServer(params, ids)
    edges = sorted({edge_of[c] for c in ids})
    seen = {e: EdgeView() for e in edges}
    root = RootKey.new(client_randomness(seed, "root-key"))

    def reaches_edge(cid: str, stage: str) -> bool:  # the node itself is still there
        return cid not in drop_at or STAGES.index(drop_at[cid]) > STAGES.index(stage)

    def edge_up(cid: str, stage: str) -> bool:  # its edge still forwards this stage to the root
        e = edge_of[cid]
        return e not in lost_at or STAGES.index(lost_at[e]) > STAGES.index(stage)

    def on_client(cid, fn, *args):
        t = time.process_time()
        out = fn(*args)
        cost.client_s[cid] += time.process_time() - t
        return out

    def on_server(fn, *args):
        t = time.process_time()
        out = fn(*args)
        cost.server_s += time.process_time() - t
        return out

    def up(cid: str, stage: str, msg, nbytes: int) -> bool:
        """A node's message to its edge; True if the edge forwards it to the root."""
        cost.sent[cid] += nbytes
        cost.links["client_edge_up"] += nbytes
        seen[edge_of[cid]].up.append((stage, msg))
        if not edge_up(cid, stage):
            return False
        if stage != "masked":  # masked inputs leave the edge only in its sum
            cost.links["edge_root_up"] += nbytes
        return True

    def down(stage: str, messages: dict) -> dict:
        """The root's answers of a stage, over each node's edge; those whose edge is lost never arrive."""
        out = {}
        for cid, m in messages.items():
            if not edge_up(cid, stage):
                continue
            cost.links["edge_root_down"] += m.nbytes
            cost.links["client_edge_down"] += m.nbytes
            cost.received[cid] += m.nbytes
            seen[edge_of[cid]].down.append((stage, m))
            out[cid] = m
        return out

    t = time.process_time()
    clients = {cid: SecAggClient(cid, params, client_randomness(seed, cid)) for cid in ids}
    keygen_s = (time.process_time() - t) / max(len(ids), 1)
    for cid in ids:
        cost.client_s[cid] += keygen_s
        if reaches_edge(cid, "advertise"):
            msg = on_client(cid, clients[cid].advertise_keys)
            if up(cid, "advertise", msg, msg.nbytes):
                on_server(server.receive_keys, msg)
    for cid, d in down("advertise", on_server(server.close_advertise)).items():
        if reaches_edge(cid, "share"):
            msg = on_client(cid, clients[cid].share_keys, d)
            if up(cid, "share", msg, msg.nbytes):
                on_server(server.receive_shares, msg)
    sums = {e: EdgeMaskedSum(e, params.vector_size, [c for c in ids if edge_of[c] == e]) for e in edges}
    for cid, d in down("share", on_server(server.close_share)).items():
        if reaches_edge(cid, "masked"):
            msg = on_client(cid, clients[cid].masked_input, d, inputs[cid])
            up(cid, "masked", msg, msg.nbytes)
            sums[edge_of[cid]].add(msg)
    for e in edges:
        part = sums[e].sealed()
        seen[e].masked_sum = part
        if part is not None and (e not in lost_at or STAGES.index(lost_at[e]) > STAGES.index("masked")):
            cost.links["edge_root_up"] += part.nbytes
            on_server(server.receive_masked_sum, part)
    requests = down("masked", on_server(server.close_masked))
    answers: list[tuple[str, bytes]] = []
    for cid, r in requests.items():
        if reaches_edge(cid, "unmask"):
            plain = on_client(cid, lambda c=cid, q=r: encode_unmask(clients[c].unmask(q)))
            rand = client_randomness(seed, f"{cid}/seal")
            blob = on_client(cid, seal_for_root, plain, root.public, params.session, cid, rand)
            if up(cid, "unmask", blob, len(blob)):
                answers.append((cid, blob))
    for cid, blob in answers:
        plain = on_server(open_at_root, blob, root, params.session, cid)
        if plain is None:
            raise SecAggProtocolError(f"{cid!r}: its sealed unmasking answer does not open")
        msg = decode_unmask(plain, params.vector_size)  # as run_in_memory: no message decoding is timed
        if msg.sender != cid:
            raise SecAggProtocolError(f"{cid!r}: a sealed unmasking answer of {msg.sender!r}")
        on_server(server.receive_unmask, msg)
    result = on_server(server.finish)
    if views is not None:
        views.update(seen)
    return result, cost


def encode_unmask(msg: UnmaskShares) -> bytes:
    return encode_message(msg)


def decode_unmask(plain: bytes, vector_size: int) -> UnmaskShares:
    """A sealed answer's plaintext as an UnmaskShares (Malformed if it is anything else)."""
    msg = decode_message(plain, vector_size)
    if not isinstance(msg, UnmaskShares):
        raise Malformed(f"a sealed unmasking answer holds a {type(msg).__name__}")
    return msg
