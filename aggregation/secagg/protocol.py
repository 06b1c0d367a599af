"""Secure aggregation as sans-I/O state machines: the messages, the parameters and the client
here (:class:`SecAggClient`), the server in :mod:`.server`.

The protocol of Bonawitz et al. 2017 ("Practical Secure Aggregation for
Privacy-Preserving Machine Learning", CCS'17, Fig. 4, honest-but-curious variant
without signatures), over either the complete graph or the SecAgg+ graph of Bell et
al. 2020 (:mod:`.graph`). The server learns the sum of the surviving clients'
vectors mod 2^32 and nothing else about any one of them.

Stages (the server closes each when its transport decides nobody else will answer;
whoever has not answered by then has dropped out):

0. advertise keys   client -> server :class:`PublicKeys` (X25519 keys c_pk, s_pk)
                    server -> client :class:`KeyDirectory` (its neighbours' keys, U1)
1. share keys       client -> server :class:`EncryptedShares` (t-of-m Shamir shares of
                    its self-mask seed b_u and mask key s_sk_u, AES-GCM to each holder)
                    server -> client :class:`ShareDelivery` (the ciphertexts for it, U2)
2. masked input     client -> server :class:`MaskedInput`
                    y_u = x_u + PRG(b_u) + sum_{v in U2} +-PRG(KA(s_sk_u, s_pk_v))  mod 2^32
                    server -> client :class:`UnmaskRequest` (survivors U3, dropped U2\\U3)
3. unmasking        client -> server :class:`UnmaskShares`: b-shares of survivors,
                    s_sk-shares of the dropped; never both for one peer
                    server: sum y_u - PRG(b_u) for u in U3, minus the dropped clients'
                    pairwise masks rebuilt from their s_sk_u.

Who counts where: a client lost before sharing its keys (not in U2) is excluded and
nobody masks with it; one lost before sending its masked input (U2 \\ U3) is excluded
and its pairwise masks are removed from its neighbours' vectors; one lost after
sending its masked input (in U3) is included, its self mask rebuilt from shares.
Fewer than t at any stage, or a secret with fewer than t shares, aborts the round
with :class:`SecAggAborted`: no partial sum is ever returned.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from dataclasses import dataclass, field

import numpy as np

from shoal.errors import ShoalError

from . import crypto as C
from . import identity as ID
from .graph import GRAPHS, threshold

log = logging.getLogger(__name__)

INFO_MASK = b"shoal secagg v1 pairwise mask"
INFO_SHARE = b"shoal secagg v1 share encryption"


class SecAggAborted(ShoalError):
    """The round cannot finish securely (too few clients or shares); nothing is applied."""

    code = "secagg_aborted"


class SecAggRefused(ShoalError):
    """A client refused a request that would reveal a peer's input (or was malformed)."""

    code = "secagg_refused"


class SecAggProtocolError(ShoalError):
    """A message arrived at the wrong stage, from a stranger, twice, or malformed.
    The receiver's state is unchanged."""

    code = "secagg_protocol"


@dataclass(frozen=True)
class SecAggParams:
    """What every party of one aggregation agrees on (sent with the round's task).

    ``session`` must be unique per aggregation: it salts every derived key, so keys
    and masks never repeat across rounds.
    """

    session: bytes
    vector_size: int
    graph: str = "full"
    degree: int = 0  # secagg+ only; 0 = auto_degree(n, expected_dropout, ...)
    threshold_fraction: float = 0.5  # t = floor(fraction * neighbourhood) + 1
    expected_dropout: float = 0.1  # what an automatic secagg+ degree is sized to survive
    graph_seed: int = 0  # public: the server and anyone can check the graph
    malicious: bool = False  # the active-adversary variant: signed keys, consistency round
    # the fewest masked inputs a sum may hold to be unmasked: a sum of one input is that input,
    # of two it is the other's to either of them (secure_aggregation.min_inputs; 1 = the threshold only)
    min_inputs: int = 1

    def __post_init__(self) -> None:
        if self.graph not in GRAPHS:
            raise ValueError(f"graph = {self.graph!r} is not one of {GRAPHS}")
        if self.malicious and self.graph != "full":
            raise ValueError("the malicious-server variant runs over the full graph only")
        if self.malicious and self.threshold_fraction < 2 / 3:
            raise ValueError(
                f"threshold fraction {self.threshold_fraction} with a malicious server: at least 2/3 "
                "(Bonawitz et al. 2017: t > 2n/3 against an active adversary)"
            )
        if self.vector_size < 1:
            raise ValueError(f"vector_size = {self.vector_size} must be >= 1")
        if self.degree < 0:
            raise ValueError(f"degree = {self.degree} must be >= 0 (0 = automatic)")
        if self.min_inputs < 1:
            raise ValueError(f"min_inputs = {self.min_inputs} must be >= 1")
        threshold(1, self.threshold_fraction)  # validates the fraction


# --- messages ------------------------------------------------------------------------


@dataclass(frozen=True)
class PublicKeys:
    sender: str
    enc_key: bytes  # c_pk: agrees the keys that encrypt shares
    mask_key: bytes  # s_pk: agrees the pairwise masks
    signature: bytes = b""  # malicious mode: the sender's Ed25519 signature over both keys

    @property
    def nbytes(self) -> int:
        return len(self.enc_key) + len(self.mask_key)


@dataclass(frozen=True)
class PeerKeys:
    index: int  # the Shamir evaluation point of this peer, >= 1
    enc_key: bytes
    mask_key: bytes
    signature: bytes = b""  # malicious mode: as advertised, for the recipient to check


@dataclass(frozen=True)
class KeyDirectory:
    recipient: str
    threshold: int
    peers: dict[str, PeerKeys]  # the recipient's neighbourhood in U1, itself included

    @property
    def nbytes(self) -> int:
        return sum(4 + len(p.enc_key) + len(p.mask_key) for p in self.peers.values())


@dataclass(frozen=True)
class EncryptedShares:
    sender: str
    ciphertexts: dict[str, bytes]  # by recipient

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.ciphertexts.values()))


@dataclass(frozen=True)
class ShareDelivery:
    recipient: str
    ciphertexts: dict[str, bytes]  # by sender: the senders are the recipient's U2 peers

    @property
    def nbytes(self) -> int:
        return sum(map(len, self.ciphertexts.values()))


@dataclass(frozen=True)
class MaskedInput:
    sender: str
    vector: np.ndarray  # uint32, mod 2^32

    @property
    def nbytes(self) -> int:
        return int(self.vector.nbytes)


@dataclass(frozen=True)
class MaskedSum:
    """A relay (edge aggregator) -> server: the sum mod 2^32 of the masked inputs of ``senders``,
    which the relay received and added without unmasking anything (aggregation/secagg/tiers.py)."""

    origin: str
    senders: tuple[str, ...]
    vector: np.ndarray  # uint32, mod 2^32

    @property
    def nbytes(self) -> int:
        return int(self.vector.nbytes) + sum(len(s) + 1 for s in self.senders)


@dataclass(frozen=True)
class ConsistencyRequest:
    """Malicious mode, server -> each client of U3: the survivors it claims (U3), to be signed."""

    recipient: str
    survivors: list[str]

    @property
    def nbytes(self) -> int:
        return 4 * len(self.survivors)


@dataclass(frozen=True)
class ConsistencySignature:
    """Malicious mode, client -> server: its signature over the U3 it was shown."""

    sender: str
    signature: bytes

    @property
    def nbytes(self) -> int:
        return len(self.signature)


@dataclass(frozen=True)
class UnmaskRequest:
    recipient: str
    survivors: list[str]  # neighbours whose self-mask shares are asked (U3)
    dropped: list[str]  # neighbours whose mask-key shares are asked (U2 \ U3)
    signatures: dict[str, bytes] = field(default_factory=dict)  # malicious mode: U4's signatures over U3

    @property
    def nbytes(self) -> int:
        return 4 * (len(self.survivors) + len(self.dropped)) + sum(map(len, self.signatures.values()))


@dataclass(frozen=True)
class UnmaskShares:
    sender: str
    self_mask: dict[str, np.ndarray] = field(default_factory=dict)  # peer -> share of b_peer
    mask_key: dict[str, np.ndarray] = field(default_factory=dict)  # peer -> share of s_sk_peer

    @property
    def nbytes(self) -> int:
        return 4 * C.CHUNKS * (len(self.self_mask) + len(self.mask_key))


def _associated(session: bytes, sender: str, recipient: str) -> bytes:
    """AES-GCM associated data: a ciphertext only opens in its session, between its pair."""
    return b"|".join([session, sender.encode(), recipient.encode()])


def key_problem(keys: PublicKeys | PeerKeys, taken: set[bytes]) -> str | None:
    """Why a party's two keys cannot be used (small order, its two keys equal, or a key
    another party already advertised: canonical forms compared), or None."""
    try:
        for k in (keys.enc_key, keys.mask_key):
            C.check_public_key(k)
    except ValueError as e:
        return str(e)
    enc, mask = C.canonical_public(keys.enc_key), C.canonical_public(keys.mask_key)
    if enc == mask:
        return "its two public keys are the same"
    if enc in taken or mask in taken:
        return "a public key another client already advertised"
    return None


def _check_directory(client_id: str, directory: KeyDirectory) -> None:
    """SecAggAborted unless every peer's keys are usable and distinct and every share
    point is distinct and in [1, p): a server could otherwise make pairwise masks that
    everyone knows, or shares that do not rebuild."""
    taken: set[bytes] = set()
    for v, p in sorted(directory.peers.items()):
        problem = key_problem(p, taken)
        if problem:
            raise SecAggAborted(f"client {client_id}: peer {v!r} in the key directory: {problem}")
        taken |= {C.canonical_public(p.enc_key), C.canonical_public(p.mask_key)}
    points = [p.index for p in directory.peers.values()]
    if len(set(points)) != len(points) or not all(1 <= x < C.PRIME for x in points):
        raise SecAggAborted(f"client {client_id}: the key directory's share points are not distinct in [1, p)")


def keyed_graph_seed(params: SecAggParams, keys: dict[str, PublicKeys]) -> int:
    """The SecAgg+ graph's seed, drawn only once the participants are fixed (Bell et al.
    2020 assume the graph is chosen after them): a hash of the session, the public seed
    and every advertised key, so no one knew it before the keys were in."""
    h = hashlib.sha256(b"shoal secagg+ graph|" + params.session + b"|" + str(params.graph_seed).encode())
    for u in sorted(keys):
        h.update(b"|" + u.encode() + b"|" + keys[u].enc_key + keys[u].mask_key)
    return int.from_bytes(h.digest()[:8], "little")


# --- client ----------------------------------------------------------------------------


class SecAggClient:
    """One client's side: call the four stage methods in order with the server's messages.

    ``rand`` supplies keys, seeds and share polynomials (the OS CSPRNG by default).
    """

    def __init__(
        self,
        client_id: str,
        params: SecAggParams,
        rand: C.Randomness | None = None,
        identity: bytes | None = None,
        roster: dict[str, bytes] | None = None,
    ):
        self.id = client_id
        self.params = params
        self.rand = rand or C.Randomness()
        # malicious mode: this client's Ed25519 key, and every node's public key (not from the server)
        self.identity, self.roster = identity, dict(roster or {})
        if params.malicious and (identity is None or self.roster.get(client_id) != ID.identity_public(identity)):
            raise ValueError(
                f"client {client_id}: the malicious-server variant needs this client's identity key "
                "and a roster (keys file) that holds its public key"
            )
        self._u3: list[str] | None = None  # malicious mode: the survivors this client signed
        self.stage = "advertise"
        self._enc_sk = C.generate_private(self.rand)
        self._mask_sk = C.generate_private(self.rand)
        self._enc_key, self._mask_key = C.private_key(self._enc_sk), C.private_key(self._mask_sk)
        self._seed = self.rand.bytes(C.KEY_BYTES)  # b_u, the self-mask seed
        self._peers: dict[str, PeerKeys] = {}
        self._threshold = 0
        self._received: dict[str, bytes] = {}
        self._revealed: dict[str, str] = {}  # peer -> "self_mask" | "mask_key"
        self._share_keys: dict[str, bytes] = {}

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggProtocolError(f"client {self.id}: a {stage!r} message at stage {self.stage!r}")

    def _sign(self, message: bytes) -> bytes:
        """Sign with this client's identity key (malicious mode, where __init__ requires one)."""
        if self.identity is None:
            raise SecAggProtocolError(f"client {self.id}: signing needs an identity key (malicious mode only)")
        return ID.sign(self.identity, message)

    def _share_key(self, v: str) -> bytes:
        """The AES-GCM key of the pair (self, v), agreed once and kept for the unmasking."""
        if v not in self._share_keys:
            self._share_keys[v] = C.agree(self._enc_key, self._peers[v].enc_key, INFO_SHARE, self.params.session)
        return self._share_keys[v]

    def advertise_keys(self) -> PublicKeys:
        self._expect("advertise")
        self.stage = "share"
        enc, mask = C.public_key(self._enc_sk), C.public_key(self._mask_sk)
        signature = (
            self._sign(ID.keys_message(self.params.session, self.id, enc, mask)) if self.params.malicious else b""
        )
        return PublicKeys(self.id, enc, mask, signature)

    def share_keys(self, directory: KeyDirectory) -> EncryptedShares:
        """Secret-share b_u and s_sk_u among the neighbourhood; encrypt each share to its holder."""
        self._expect("share")
        if directory.recipient != self.id:
            raise SecAggRefused(f"client {self.id}: a key directory addressed to {directory.recipient!r}")
        me = directory.peers.get(self.id)
        if me is None or me.enc_key != C.public_key(self._enc_sk) or me.mask_key != C.public_key(self._mask_sk):
            raise SecAggRefused(f"client {self.id}: the key directory does not hold this client's own keys")
        floor = threshold(len(directory.peers), self.params.threshold_fraction)
        if len(directory.peers) < directory.threshold or directory.threshold < max(floor, 1):
            raise SecAggAborted(
                f"client {self.id}: {len(directory.peers)} peers in its neighbourhood, threshold {directory.threshold} "
                f"(at least {floor} for threshold fraction {self.params.threshold_fraction})"
            )
        _check_directory(self.id, directory)
        if self.params.malicious:
            self._check_signed_directory(directory)
        self._peers = dict(directory.peers)
        self._threshold = directory.threshold
        holders = sorted(self._peers)
        xs = np.array([self._peers[v].index for v in holders], dtype=np.int64)
        try:
            shares = C.shamir_share(C.secret_to_field([self._seed, self._mask_sk]), xs, self._threshold, self.rand)
            out = {}
            for row, v in zip(shares, holders):
                key = self._share_key(v)
                plain = C.pack_shares(me.index, self._peers[v].index, row)
                out[v] = C.encrypt(key, plain, _associated(self.params.session, self.id, v), self.rand)
        except ValueError as e:  # share points or keys the checks above should have caught
            raise SecAggAborted(f"client {self.id}: the key directory cannot be used: {e}") from None
        self.stage = "masked"
        return EncryptedShares(self.id, out)

    def _abort(self, why: str) -> SecAggAborted:
        """Malicious mode: a server caught cheating gets nothing more from this client."""
        self.stage = "aborted"
        return SecAggAborted(f"client {self.id}: {why}; aborting")

    def _check_signed_directory(self, directory: KeyDirectory) -> None:
        """Malicious mode: every key in the directory is signed by its owner's identity key
        (from the roster, not from the server), and t > 2/3 of the peers shown."""
        floor = 2 * len(directory.peers) // 3 + 1
        if directory.threshold < floor:
            raise self._abort(
                f"threshold {directory.threshold} with {len(directory.peers)} peers; against a "
                f"malicious server t > 2n/3 = at least {floor}"
            )
        for v, p in directory.peers.items():
            public = self.roster.get(v)
            if public is None:
                raise self._abort(f"peer {v!r} is not in the keys file")
            if not ID.verify(public, p.signature, ID.keys_message(self.params.session, v, p.enc_key, p.mask_key)):
                raise self._abort(
                    f"the keys of {v!r} are not signed by {v!r}'s identity key (the server changed them?)"
                )

    def consistency_check(self, request: ConsistencyRequest) -> ConsistencySignature:
        """Malicious mode: sign the survivors the server claims, after checking them against
        what this client saw; the unmasking will want every signature to be over this list."""
        self._expect("consistency")
        if request.recipient != self.id:
            raise SecAggRefused(f"client {self.id}: a consistency check addressed to {request.recipient!r}")
        survivors = set(request.survivors)
        if len(survivors) != len(request.survivors) or self.id not in survivors or not survivors <= set(self._received):
            raise self._abort(
                "the survivors shown are not a subset of the clients that shared keys with it (or omit it)"
            )
        if len(survivors) < self._threshold:
            raise self._abort(f"{len(survivors)} survivors, fewer than the threshold {self._threshold}")
        self._u3 = sorted(survivors)
        self.stage = "unmask"
        return ConsistencySignature(self.id, self._sign(ID.consistency_message(self.params.session, self._u3)))

    def _check_consistency(self, request: UnmaskRequest) -> None:
        """Malicious mode: the unmasking is for the survivors this client signed, and at
        least t clients signed that very list (an equivocating server cannot show it)."""
        if sorted(request.survivors) != self._u3:
            raise self._abort(
                f"the unmasking asks about survivors {sorted(request.survivors)}, but this client "
                f"signed {self._u3}: the server equivocates"
            )
        message = ID.consistency_message(self.params.session, self._u3)
        signers = set(request.signatures)
        if self.id not in signers or not signers <= set(self._u3) or len(signers) < self._threshold:
            raise self._abort(f"{len(signers)} consistency signatures from the survivors, threshold {self._threshold}")
        bad = sorted(v for v in signers if not ID.verify(self.roster.get(v, b""), request.signatures[v], message))
        if bad:
            raise self._abort(
                f"{bad} did not sign the survivor list this client signed: the server showed "
                "different lists to different clients"
            )

    def masked_input(self, delivery: ShareDelivery, encoded: np.ndarray) -> MaskedInput:
        """y_u = x_u + PRG(b_u) + sum over U2 neighbours v of +-PRG(s_uv), mod 2^32."""
        self._expect("masked")
        x = np.asarray(encoded)
        if x.dtype != np.uint32 or x.shape != (self.params.vector_size,):
            raise ValueError(
                f"encoded input must be uint32 of shape ({self.params.vector_size},), got {x.dtype} {x.shape}"
            )
        if delivery.recipient != self.id:  # in a SecAgg+ graph a misrouted delivery would mask with strangers
            raise SecAggRefused(f"client {self.id}: a share delivery addressed to {delivery.recipient!r}")
        senders = set(delivery.ciphertexts)
        if not senders <= set(self._peers) or self.id not in senders:
            raise SecAggRefused(f"client {self.id}: shares delivered from outside its neighbourhood")
        if len(senders) < self._threshold:
            raise SecAggAborted(
                f"client {self.id}: {len(senders)} neighbours shared keys, fewer than the threshold {self._threshold}"
            )
        self._received = dict(delivery.ciphertexts)
        expander = C.MaskExpander(self.params.vector_size)
        y = x.copy()
        y += expander.expand(self._seed)
        mine = self._peers[self.id].index
        for v in sorted(senders - {self.id}):
            try:
                s_uv = C.agree(self._mask_key, self._peers[v].mask_key, INFO_MASK, self.params.session)
            except ValueError as e:
                raise SecAggAborted(f"client {self.id}: no pairwise mask with {v}: {e}") from None
            if mine < self._peers[v].index:
                y += expander.expand(s_uv)
            else:
                y -= expander.expand(s_uv)
        self.stage = "consistency" if self.params.malicious else "unmask"
        return MaskedInput(self.id, y)

    def unmask(self, request: UnmaskRequest) -> UnmaskShares:
        """Reveal b-shares of survivors and s_sk-shares of the dropped, after checking
        that no peer is (now or before) asked for both: that would hand the server
        the peer's unmasked input (Bonawitz Sec. 4, Round 4)."""
        self._expect("unmask")
        if request.recipient != self.id:
            raise SecAggRefused(f"client {self.id}: an unmasking request addressed to {request.recipient!r}")
        if self.params.malicious:
            self._check_consistency(request)
        survivors, dropped = set(request.survivors), set(request.dropped)
        both = survivors & dropped
        both |= {v for v in survivors if self._revealed.get(v) == "mask_key"}
        both |= {v for v in dropped if self._revealed.get(v) == "self_mask"}
        if both:
            raise SecAggRefused(
                f"client {self.id}: asked for both the self-mask and the mask-key share of {sorted(both)}; refusing"
            )
        if self.id not in survivors:
            raise SecAggRefused(f"client {self.id}: asked to unmask but not listed among the survivors")
        unknown = (survivors | dropped) - set(self._received)
        if unknown:
            raise SecAggRefused(f"client {self.id}: asked for shares it never received: {sorted(unknown)}")
        if len(survivors) < self._threshold:
            raise SecAggAborted(
                f"client {self.id}: {len(survivors)} survivors in its neighbourhood, "
                f"fewer than the threshold {self._threshold}"
            )
        # the full graph shows every survivor; over SecAgg+ a client sees its neighbourhood only
        least = self.params.min_inputs if self.params.graph == "full" else min(self.params.min_inputs, len(self._peers))
        if len(survivors) < least:
            raise SecAggRefused(
                f"client {self.id}: asked to unmask a sum of {len(survivors)} masked inputs, fewer than "
                f"secure_aggregation.min_inputs = {self.params.min_inputs}: refusing"
            )
        out = UnmaskShares(self.id)
        mine = self._peers[self.id].index
        for v in sorted(survivors | dropped):
            plain = C.decrypt(self._share_key(v), self._received[v], _associated(self.params.session, v, self.id))
            if plain is None:
                raise SecAggRefused(f"client {self.id}: the share from {v} does not decrypt")
            try:
                sender, receiver, row = C.unpack_shares(plain)
            except (ValueError, struct.error):
                raise SecAggRefused(f"client {self.id}: the share from {v} is not a share message") from None
            if (sender, receiver) != (self._peers[v].index, mine) or len(row) != 2 * C.CHUNKS:
                raise SecAggRefused(f"client {self.id}: the share from {v} names the wrong parties")
            if v in survivors:
                out.self_mask[v] = row[: C.CHUNKS]
            else:
                out.mask_key[v] = row[C.CHUNKS :]
        for v in survivors:
            self._revealed[v] = "self_mask"
        for v in dropped:
            self._revealed[v] = "mask_key"
        return out
