"""Secure aggregation's server side as a sans-I/O state machine (:class:`SecAggServer`): it takes
the clients' messages of :mod:`.protocol`, closes each stage when its transport says so, and
returns the sum of the survivors' vectors (:class:`SecAggResult`); the stages and who counts where
are in :mod:`.protocol`'s docstring."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

from . import crypto as C
from . import identity as ID
from .graph import auto_degree, neighbours, threshold
from .protocol import (
    INFO_MASK,
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyDirectory,
    MaskedInput,
    MaskedSum,
    PeerKeys,
    PublicKeys,
    SecAggAborted,
    SecAggParams,
    SecAggProtocolError,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
    key_problem,
    keyed_graph_seed,
)

log = logging.getLogger(__name__)


@dataclass
class SecAggResult:
    total: np.ndarray  # sum of the included clients' encoded vectors, mod 2^32
    included: list[str]  # U3: whose inputs the sum holds
    dropped: list[str]  # U2 \ U3: whose pairwise masks were removed


class SecAggServer:
    """The server's side: feed it the clients' messages, close each stage, then finish.

    It only ever holds masked vectors and shares; :meth:`finish` returns the sum.
    Memory is O(vector) for the running sum plus O(n * m) small shares.
    """

    def __init__(self, params: SecAggParams, participants: list[str]):
        ids = sorted(set(participants))
        if len(ids) != len(participants):
            raise ValueError("participant ids must be distinct")
        if not ids:
            raise ValueError("no participants")
        self.params = params
        self.participants = ids
        n = len(ids)
        if params.graph == "full":
            self.degree = n - 1
        else:
            auto = params.degree or auto_degree(n, params.expected_dropout, params.threshold_fraction)
            self.degree = min(auto, n - 1)
        self.graph = neighbours(ids, params.graph, self.degree, params.graph_seed)
        self.threshold = threshold(max(len(v) for v in self.graph.values()) + 1, params.threshold_fraction)
        self.index = {u: i + 1 for i, u in enumerate(ids)}
        self.stage = "advertise"
        self._keys: dict[str, PublicKeys] = {}
        self._taken: set[bytes] = set()  # canonical forms of every advertised key
        self.graph_seed: int | None = None  # the SecAgg+ graph's, fixed at close_advertise
        self.u1: list[str] = []
        self._shares: dict[str, EncryptedShares] = {}
        self.u2: list[str] = []
        self._total = np.zeros(params.vector_size, dtype=np.uint32)
        self.u3: list[str] = []
        self._signatures: dict[str, bytes] = {}  # malicious mode: consistency signatures (U4)
        self._requests: dict[str, UnmaskRequest] = {}  # malicious mode: unmask requests, sent after them
        self.u4: list[str] = []  # who is asked to unmask (U3 in the honest mode)
        self._unmask: dict[str, UnmaskShares] = {}
        # kind -> holder -> (peer -> row, shares matrix): the revealed shares, by holder
        self._rows: dict[str, dict[str, tuple[dict[str, int], np.ndarray]]] = {"self_mask": {}, "mask_key": {}}

    def _at(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggProtocolError(f"the server is at stage {self.stage!r}, not {stage!r}")

    def _expect(self, stage: str, sender: str, allowed: list[str] | set[str], seen) -> None:
        self._at(stage)
        if sender not in allowed:
            raise SecAggProtocolError(f"{sender!r} may not send at stage {stage!r}")
        if sender in seen:
            raise SecAggProtocolError(f"{sender!r} already sent its {stage!r} message")

    def _abort(self, why: str) -> SecAggAborted:
        self.stage = "aborted"
        self._total[:] = 0
        log.warning("secure aggregation aborted: %s", why)
        return SecAggAborted(f"secure aggregation aborted: {why}; no partial result is applied")

    def _hood(self, u: str, alive) -> list[str]:
        return [v for v in [u, *self.graph[u]] if v in alive]

    def _prune(self, alive: set[str]) -> set[str]:
        """Drop clients whose neighbourhood among ``alive`` is below the threshold, until
        none is (only before anyone has masked, so dropping them is still safe)."""
        while True:
            weak = {u for u in alive if len(self._hood(u, alive)) < self.threshold}
            if not weak:
                return alive
            alive -= weak

    @staticmethod
    def _pruned(alive: set[str], sent: dict) -> str:
        """Why fewer than ``sent`` remain: those left without enough live neighbours."""
        return (
            f" ({len(sent) - len(alive)} of them left with fewer live neighbours than t)"
            if len(alive) < len(sent)
            else ""
        )

    # stage 0
    def receive_keys(self, msg: PublicKeys) -> None:
        self._expect("advertise", msg.sender, self.participants, self._keys)
        if len(msg.enc_key) != 32 or len(msg.mask_key) != 32 or msg.enc_key == msg.mask_key:
            raise SecAggProtocolError(f"{msg.sender!r}: public keys must be two distinct 32-byte X25519 keys")
        problem = key_problem(msg, self._taken)
        if problem:
            raise SecAggProtocolError(f"{msg.sender!r}: {problem}")
        if self.params.malicious and len(msg.signature) != ID.SIGNATURE_BYTES:
            raise SecAggProtocolError(f"{msg.sender!r}: keys must be signed ({ID.SIGNATURE_BYTES}-byte Ed25519)")
        self._taken |= {C.canonical_public(msg.enc_key), C.canonical_public(msg.mask_key)}
        self._keys[msg.sender] = msg

    def close_advertise(self) -> dict[str, KeyDirectory]:
        self._at("advertise")
        if self.params.graph != "full" and self.degree < len(self.participants) - 1:
            # the same Harary graph (so the same threshold), relabelled by a seed nobody knew before
            self.graph_seed = keyed_graph_seed(self.params, self._keys)
            self.graph = neighbours(self.participants, self.params.graph, self.degree, self.graph_seed)
        alive = self._prune(set(self._keys))
        if len(alive) < self.threshold:
            why = self._pruned(alive, self._keys)
            raise self._abort(f"{len(self._keys)} clients advertised keys{why}, the threshold is {self.threshold}")
        self.u1 = sorted(alive)
        self.stage = "share"
        return {
            u: KeyDirectory(
                u,
                self.threshold,
                {
                    v: PeerKeys(self.index[v], self._keys[v].enc_key, self._keys[v].mask_key, self._keys[v].signature)
                    for v in self._hood(u, alive)
                },
            )
            for u in self.u1
        }

    # stage 1
    def receive_shares(self, msg: EncryptedShares) -> None:
        self._expect("share", msg.sender, set(self.u1), self._shares)
        if set(msg.ciphertexts) != set(self._hood(msg.sender, set(self.u1))):
            raise SecAggProtocolError(f"{msg.sender!r}: shares must go to exactly its neighbourhood")
        self._shares[msg.sender] = msg

    def close_share(self) -> dict[str, ShareDelivery]:
        self._at("share")
        alive = self._prune(set(self._shares))
        if len(alive) < self.threshold:
            why = self._pruned(alive, self._shares)
            raise self._abort(f"{len(self._shares)} clients shared keys{why}, the threshold is {self.threshold}")
        self.u2 = sorted(alive)
        self.stage = "masked"
        return {v: ShareDelivery(v, {u: self._shares[u].ciphertexts[v] for u in self._hood(v, alive)}) for v in self.u2}

    # stage 2
    def receive_masked(self, msg: MaskedInput) -> None:
        self._expect("masked", msg.sender, set(self.u2), self.u3)
        y = np.asarray(msg.vector)
        if y.dtype != np.uint32 or y.shape != (self.params.vector_size,):
            raise SecAggProtocolError(
                f"{msg.sender!r}: masked input must be uint32 of shape ({self.params.vector_size},)"
            )
        self._total += y  # streaming: the masked vector is not kept
        self.u3.append(msg.sender)

    def receive_masked_sum(self, msg: MaskedSum) -> None:
        """A relay's sum of several clients' masked inputs (an edge aggregator: aggregation/secagg/tiers.py),
        taken as if each of ``msg.senders`` had sent its own :class:`MaskedInput`.

        Invariant: every client is counted at most once, and the running sum holds exactly the
        masked inputs of U3. So the whole sum is refused, with nothing changed, when it names no
        client, a client twice, one outside U2 (it never advertised keys or shared them), or one
        whose masked input is already in (on its own or in another relay's sum); a client whose
        relay's sum never arrives stays in U2 \\ U3 and is recovered as any drop-out."""
        self._at("masked")
        names = list(msg.senders)
        if not names or len(set(names)) != len(names):
            raise SecAggProtocolError(f"relay {msg.origin!r}: a masked sum names distinct clients, at least one")
        outside = sorted(set(names) - set(self.u2))
        if outside:
            raise SecAggProtocolError(
                f"relay {msg.origin!r}: {outside[:5]} are not in the round after the key sharing (U2)"
            )
        again = sorted(set(names) & set(self.u3))
        if again:
            raise SecAggProtocolError(f"relay {msg.origin!r}: the masked inputs of {again[:5]} are already in the sum")
        y = np.asarray(msg.vector)
        if y.dtype != np.uint32 or y.shape != (self.params.vector_size,):
            raise SecAggProtocolError(
                f"relay {msg.origin!r}: a masked sum must be uint32 of shape ({self.params.vector_size},)"
            )
        self._total += y
        self.u3.extend(names)

    def close_masked(self) -> dict[str, UnmaskRequest] | dict[str, ConsistencyRequest]:
        """The unmask requests; in malicious mode first the consistency requests (then
        :meth:`close_consistency` gives the unmask requests)."""
        self._at("masked")
        survivors, _u2 = set(self.u3), set(self.u2)
        if len(survivors) < self.threshold:
            raise self._abort(f"{len(survivors)} clients sent masked input, the threshold is {self.threshold}")
        if len(survivors) < self.params.min_inputs:
            raise self._abort(
                f"a sum of {len(survivors)} masked inputs is not unmasked: fewer than "
                f"secure_aggregation.min_inputs = {self.params.min_inputs}"
            )
        # a dropped client none of whose neighbours survived left no mask to remove
        needed = [u for u in self.u2 if u in survivors or set(self.graph[u]) & survivors]
        short = [u for u in needed if len(self._hood(u, survivors)) < self.threshold]
        if short:
            raise self._abort(
                f"{len(short)} clients (e.g. {short[0]!r}) have fewer than {self.threshold} surviving share holders"
            )
        self.u3 = sorted(survivors)
        dropped = {u for u in needed if u not in survivors}
        requests = {v: UnmaskRequest(v, self._hood(v, survivors), self._hood(v, dropped)) for v in self.u3}
        if self.params.malicious:  # the consistency round first (Bonawitz et al. 2017, round 3)
            self._requests = requests
            self.stage = "consistency"
            return {v: ConsistencyRequest(v, list(self.u3)) for v in self.u3}
        self.u4 = list(self.u3)
        self.stage = "unmask"
        return requests

    # stage 2b, malicious mode
    def receive_consistency(self, msg: ConsistencySignature) -> None:
        self._expect("consistency", msg.sender, set(self.u3), self._signatures)
        if len(msg.signature) != ID.SIGNATURE_BYTES:
            raise SecAggProtocolError(f"{msg.sender!r}: a consistency signature has {ID.SIGNATURE_BYTES} bytes")
        self._signatures[msg.sender] = msg.signature

    def close_consistency(self) -> dict[str, UnmaskRequest]:
        """Malicious mode: the unmask requests, each with every consistency signature (U4)."""
        self._at("consistency")
        if len(self._signatures) < self.threshold:
            raise self._abort(
                f"{len(self._signatures)} clients signed the survivor list, the threshold is {self.threshold}"
            )
        self.u4 = sorted(self._signatures)
        self.stage = "unmask"
        return {
            v: UnmaskRequest(r.recipient, r.survivors, r.dropped, dict(self._signatures))
            for v, r in self._requests.items()
            if v in self._signatures
        }

    # stage 3
    def receive_unmask(self, msg: UnmaskShares) -> None:
        self._expect("unmask", msg.sender, set(self.u4), self._unmask)
        hood = set(self._hood(msg.sender, set(self.u2)))
        if not set(msg.self_mask) | set(msg.mask_key) <= hood or set(msg.self_mask) & set(msg.mask_key):
            raise SecAggProtocolError(f"{msg.sender!r}: unmask shares for clients it does not hold")
        for row in [*msg.self_mask.values(), *msg.mask_key.values()]:
            if np.shape(row) != (C.CHUNKS,):
                raise SecAggProtocolError(f"{msg.sender!r}: a share must have {C.CHUNKS} field elements")
        self._unmask[msg.sender] = msg
        for kind, shares in (("self_mask", msg.self_mask), ("mask_key", msg.mask_key)):
            peers = list(shares)
            matrix = np.array([shares[u] for u in peers], dtype=np.int64).reshape(len(peers), C.CHUNKS)
            self._rows[kind][msg.sender] = ({u: i for i, u in enumerate(peers)}, matrix)

    def _reconstruct_all(self, targets: list[str], kind: str) -> dict[str, bytes]:
        """Rebuild each target's secret from the first t shares among its neighbourhood.

        Targets with the same t holders (all of them, in the complete graph) are
        rebuilt by one vectorised Lagrange interpolation.
        """
        rows = self._rows[kind]
        groups: dict[tuple[str, ...], list[str]] = defaultdict(list)
        for u in targets:
            holders = [v for v in self._hood(u, rows) if u in rows[v][0]]
            if len(holders) < self.threshold:
                raise self._abort(
                    f"{len(holders)} shares of {u!r}'s {kind.replace('_', ' ')}, the threshold is {self.threshold}"
                )
            groups[tuple(sorted(holders, key=self.index.__getitem__)[: self.threshold])].append(u)
        out: dict[str, bytes] = {}
        for chosen, group in groups.items():
            shares = np.stack([rows[v][1][[rows[v][0][u] for u in group]] for v in chosen])
            values = C.shamir_reconstruct([self.index[v] for v in chosen], shares.reshape(len(chosen), -1))
            try:
                out.update(zip(group, C.field_to_secrets(values)))
            except ValueError as e:
                raise self._abort(f"the shares of a {kind.replace('_', ' ')} are inconsistent ({e})") from None
        return out

    def finish(self) -> SecAggResult:
        """Remove every mask; the sum of U3's inputs mod 2^32. Aborts if a secret
        has fewer than t shares among the clients that answered."""
        self._at("unmask")
        if len(self._unmask) < self.threshold:
            raise self._abort(f"{len(self._unmask)} clients answered the unmasking, the threshold is {self.threshold}")
        survivors = set(self.u3)
        dropped = sorted(u for u in set(self.u2) - survivors if set(self.graph[u]) & survivors)
        seeds = self._reconstruct_all(self.u3, "self_mask")
        mask_keys = {u: C.private_key(k) for u, k in self._reconstruct_all(dropped, "mask_key").items()}
        expander = C.MaskExpander(self.params.vector_size)
        total = self._total
        for u in self.u3:
            total -= expander.expand(seeds[u])
        session = self.params.session
        publics = {v: X25519PublicKey.from_public_bytes(self._keys[v].mask_key) for v in self.u3}
        for u in dropped:
            # y_v holds +PRG(s_uv) if v < u else -PRG(s_uv): take it out again
            for v in self._hood(u, survivors):
                if v == u:
                    continue
                try:
                    s_uv = C.agree(mask_keys[u], publics[v], INFO_MASK, session)
                except ValueError as e:
                    raise self._abort(f"the pairwise mask of {u!r} and {v!r} cannot be rebuilt ({e})") from None
                if self.index[v] < self.index[u]:
                    total -= expander.expand(s_uv)
                else:
                    total += expander.expand(s_uv)
        self.stage = "done"
        return SecAggResult(total.copy(), list(self.u3), dropped)
