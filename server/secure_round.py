"""Secure aggregation in `shoal server` sync rounds: the protocol's stages as HTTP exchanges.

One :class:`SecureRound` wraps the :class:`SecAggServer` state machine
(aggregation/secagg/protocol.py, Bonawitz et al. 2017 with the SecAgg+ graph) for one open
SyncRounds round. Like the service it has no sockets and no clocks (``now`` is passed
in): server/app.py turns ``POST /v1/secagg/{stage}`` into :meth:`receive` and
``GET /v1/secagg/{stage}`` into :meth:`reply`, and the service's clock calls
:meth:`tick`, which closes a stage once every expected node answered or its deadline
passed. Whoever has not answered by then has dropped out, and the state machine
handles it as the paper says.

Stages (route name -> protocol stage): ``keys`` -> advertise (deadline: the round's
``server.deadline_s``, which covers training), ``shares`` -> share, ``masked`` ->
masked input, ``unmask`` -> unmasking (each ``secure_aggregation.stage_s``). When the
unmasking closes, :meth:`close` hands the unmasked weighted mean to SyncRounds once per
included node, exactly as the simulator does (simulations/secure_rounds.py), so the
strategy's own weighting reproduces the same mean (what SCAFFOLD and FedNova mask besides, and
how their server steps get it back: aggregation/secagg/payload.py); an aborted round is closed with
``SyncRounds.abort_round()`` (model and version unchanged).

Distributed DP (server/privacy.py): every node weighs the same (the DP mean divides the
plain sum by K), and when the masked stage closes with fewer masked inputs than the t
noise shares each node sized its noise for, the round aborts there, before any node is
asked for an unmasking share, so no sum with less noise than accounted is ever formed.
With local DP a node's privacy report travels in the ``privacy`` meta of its keys.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from shoal.aggregation.discrete_gaussian import DdgCodec, rotation_seed
from shoal.aggregation.secagg import (
    ConsistencySignature,
    EncryptedShares,
    MaskedInput,
    MaskedSum,
    PublicKeys,
    SecAggAborted,
    SecAggParams,
    SecAggProtocolError,
    SecAggServer,
    UnmaskShares,
)
from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg import identity as ID
from shoal.aggregation.secagg.encoding import FixedPoint, decode_weighted
from shoal.aggregation.secagg.payload import FEDNOVA_A, SecurePayload, SecureSums, step_weight
from shoal.aggregation.secagg.tiers import RootKey, open_message
from shoal.aggregation.secagg.wire import decode_message, encode_message, message_meta, params_to_json
from shoal.config import Config
from shoal.errors import Malformed, OutOfRange, UpdateRejected, short_repr
from shoal.noise import NoiseSource
from shoal.rounds import RoundSummary, SyncRounds
from shoal.seeding import derive_seed
from shoal.update import Update
from shoal.wire import MAX_HEADER_BYTES

from .privacy import EXPECTED_DROPOUT, ServerPrivacy, secret_session

log = logging.getLogger(__name__)

ROUTES = {"keys": "advertise", "shares": "share", "masked": "masked", "consistency": "consistency", "unmask": "unmask"}
MESSAGES = {
    "advertise": PublicKeys,
    "share": EncryptedShares,
    "masked": MaskedInput,
    "consistency": ConsistencySignature,
    "unmask": UnmaskShares,
}
STAGES = tuple(ROUTES.values())


class SecureRound:
    """The secure aggregation of one open sync round (see the module doc)."""

    def __init__(self, cfg: Config, rounds: SyncRounds, numel: int, now: float, privacy: ServerPrivacy | None = None):
        sa = cfg.secure_aggregation
        self.payload = SecurePayload(cfg.algorithm.name, numel)  # what each node masks (payload.py)
        self.privacy = privacy
        self.cfg = sa
        self.round = rounds.round
        self.selected = sorted(rounds.selected)
        k = len(self.selected)
        self.values = FixedPoint(sa.clip, sa.bits, k)  # raises (ConfigError) if k x 2^bits > 2^32
        self.weights = FixedPoint(1.0, sa.bits, k)
        # distributed DP's server divides the plain sum by K: every node weighs the same (as in the simulator)
        self.weighting = "uniform" if privacy is not None and privacy.plan.client_shares else cfg.strategy.weighting
        self.max_examples = cfg.server.max_examples
        self.params = SecAggParams(
            session=secret_session(self.round),  # fresh per aggregation
            vector_size=self.payload.vector_size,
            graph=sa.graph,
            degree=sa.degree,
            threshold_fraction=sa.threshold,
            expected_dropout=EXPECTED_DROPOUT,
            graph_seed=derive_seed(sa.seed, cfg.simulation.seed, self.round),
            malicious=sa.malicious_server,
            min_inputs=sa.min_inputs,
        )
        # malicious_server: the server checks signatures too, so one node's bad signature is its own 400
        # and does not make every honest node abort (the nodes check them again: they trust no server)
        self.roster = ID.read_roster(sa.keys_file) if sa.malicious_server else {}
        self.server = SecAggServer(self.params, self.selected)
        # with edge aggregators (hierarchy.edge_names): the unmasking answers come sealed to this key
        self.root_key = RootKey.new(C.Randomness()) if cfg.hierarchy.edge_names else None
        self.sums_taken: dict[str, tuple[tuple[str, ...], str]] = {}  # edge -> (nodes, digest) of its masked sum
        self.stage = "advertise"
        self.deadline_at = rounds.deadline_at if rounds.deadline_at is not None else now + sa.stage_s
        self.sent: dict[str, set[str]] = {s: set() for s in STAGES}
        self.replies: dict[str, dict[str, bytes]] = {}  # route -> node -> body
        self.meta: dict[str, tuple[int, float]] = {}  # node -> (num_examples, train_loss) sent in the clear
        self.clear_metrics: dict[str, dict[str, float]] = {}  # node -> what its algorithm sends in the clear
        self.sums: SecureSums | None = None  # without distributed DP: the unmasked sums
        self.max_weight = 0.0
        self.aborted: str | None = None
        self.mean: np.ndarray | None = None
        self.examples: int | None = None  # distributed DP: the securely summed example count
        self.included: list[str] = []
        self.dropped: list[str] = []
        self.failed: set[str] = set()  # selected nodes whose training failed (POST /v1/failed): not waited for

    @property
    def over(self) -> bool:
        return self.stage in ("done", "aborted")

    def task_info(self) -> dict[str, Any]:
        """What a selected node needs, sent with its task."""
        return {
            **params_to_json(self.params),
            "clip": self.values.clip,
            "bits": self.values.bits,
            "summands": self.values.max_summands,
            "weighting": self.weighting,
            **(
                {"root_key": base64.b64encode(self.root_key.public).decode(), "stage_s": self.cfg.stage_s}
                if self.root_key is not None
                else {}
            ),
        }

    def wants_task(self, node: str) -> bool:
        """Hand the round's task out only until the node has joined the protocol."""
        return self.stage == "advertise" and node not in self.sent["advertise"]

    def failed_node(self, node: str) -> None:
        """``node`` reported that its training failed before it advertised keys: the first stage
        closes without waiting for it (it is a dropout, as the protocol handles any)."""
        if self.stage == "advertise" and node not in self.sent["advertise"]:
            self.failed.add(node)

    def drop_node(self, node: str) -> None:
        """``node`` was revoked: no stage waits for it any more (it is a dropout, as the protocol
        handles any; the registry refuses its requests)."""
        self.failed.add(node)

    def _expected(self, stage: str) -> set[str]:
        s = self.server
        return {
            "advertise": set(self.selected),
            "share": set(s.u1),
            "masked": set(s.u2),
            "consistency": set(s.u3) if s.stage == "consistency" else set(),
            "unmask": set(s.u4) if s.stage == "unmask" else set(),
        }[stage] - self.failed

    def _check(self, node: str, route: str, round_: Any) -> str:
        if route not in ROUTES:
            raise UpdateRejected("unknown_stage", f"{route!r} is not a secure aggregation stage: one of {list(ROUTES)}")
        if not isinstance(round_, int) or isinstance(round_, bool) or round_ != self.round:
            raise UpdateRejected(
                "wrong_round", f"message is for round {short_repr(round_)}, the open round is {self.round}"
            )
        if node not in self.selected:
            raise UpdateRejected("not_selected", f"node {node!r} was not selected for round {self.round}")
        if self.aborted:
            raise UpdateRejected("aborted", f"round {self.round}'s secure aggregation aborted: {self.aborted}")
        return ROUTES[route]

    # --- requests -----------------------------------------------------------------

    def receive(self, node: str, route: str, body: bytes) -> dict[str, Any]:
        """One node's message for ``route``; raises a ShoalError (Malformed: 400,
        UpdateRejected: 409) with nothing changed if it is refused."""
        if route == "unmask" and self.root_key is not None:  # sealed to the root: edges relay it unread
            limit = 4 * self.params.vector_size + 4 * MAX_HEADER_BYTES
            body = open_message(body, self.root_key, self.params.session, node, limit)
        meta = message_meta(body, self.params.vector_size)
        stage = self._check(node, route, meta.get("round"))
        if stage != self.stage:
            raise UpdateRejected("wrong_stage", f"a {route!r} message while the round is at stage {self.stage!r}")
        if node in self.sent[stage]:
            raise UpdateRejected(
                "duplicate", f"node {node!r} already sent its {route!r} message for round {self.round}"
            )
        if node not in self._expected(stage):
            raise UpdateRejected("excluded", f"node {node!r} dropped out of round {self.round} at an earlier stage")
        msg = decode_message(body, self.params.vector_size)
        if not isinstance(msg, MESSAGES[stage]):
            raise Malformed(f"POST /v1/secagg/{route} takes a {MESSAGES[stage].__name__} message")
        sender = getattr(msg, "sender", None)  # every message a node posts names its sender
        if sender != node:
            raise Malformed(f"message sender {sender!r} is not the authenticated node {node!r}")
        if self.params.malicious:
            self._check_signature(node, stage, msg)
        if stage == "advertise":
            n, loss = self._clear_meta(meta)
            extra = self._algorithm_meta(meta)
            report = self.privacy.upload_report(meta.get("privacy")) if self.privacy is not None else None
        handlers: dict[str, Callable[[Any], object]] = {
            "advertise": self.server.receive_keys,
            "share": self.server.receive_shares,
            "masked": self.server.receive_masked,
            "consistency": self.server.receive_consistency,
            "unmask": self.server.receive_unmask,
        }
        try:
            handlers[stage](msg)
        except (SecAggProtocolError, ValueError) as e:  # the state machine changed nothing
            raise Malformed(str(e)) from None
        if stage == "advertise":
            self.meta[node] = (int(n), float(loss))  # checked by _clear_meta
            self.clear_metrics[node] = extra
            if report is not None and self.privacy is not None:
                self.privacy.take_report(node, report)
        self.sent[stage].add(node)
        return {"status": "accepted", "round": self.round, "stage": route}

    def receive_masked_sum(self, edge: str, body: bytes, held: dict[str, str]) -> dict[str, Any]:
        """An edge's sum of its nodes' masked inputs (aggregation/secagg/tiers.py), taken as each of
        them sending its own. ``held``: node -> the edge that speaks for it in this round; every node
        in the sum must be ``edge``'s. A retransmit of the sum already taken is a ``duplicate``;
        anything else wrong is refused (Malformed / UpdateRejected) with nothing changed."""
        meta = message_meta(body, self.params.vector_size)
        if not isinstance(meta.get("round"), int) or meta.get("round") != self.round:
            raise UpdateRejected(
                "wrong_round", f"a masked sum for round {short_repr(meta.get('round'))}, not {self.round}"
            )
        if self.aborted:
            raise UpdateRejected("aborted", f"round {self.round}'s secure aggregation aborted: {self.aborted}")
        msg = decode_message(body, self.params.vector_size)
        if not isinstance(msg, MaskedSum):
            raise Malformed("POST /v1/edge/secagg/masked_sum takes a MaskedSum message")
        digest = hashlib.blake2b(msg.vector.tobytes(), digest_size=16).hexdigest()
        if self.sums_taken.get(edge) == (msg.senders, digest):
            return {"status": "duplicate", "round": self.round, "nodes": len(msg.senders)}
        if edge in self.sums_taken:
            raise UpdateRejected("conflict", f"edge {edge!r} already sent another masked sum in round {self.round}")
        foreign = sorted(n for n in msg.senders if held.get(n) != edge)
        if foreign:
            raise UpdateRejected(
                "not_your_node", f"edge {edge!r} does not speak for {short_repr(foreign[:5])} in round {self.round}"
            )
        if self.stage != "masked":
            raise UpdateRejected("wrong_stage", f"a masked sum while the round is at stage {self.stage!r}")
        try:
            self.server.receive_masked_sum(MaskedSum(edge, msg.senders, msg.vector))
        except SecAggProtocolError as e:  # the state machine changed nothing
            raise UpdateRejected("conflict", str(e)) from None
        self.sums_taken[edge] = (msg.senders, digest)
        self.sent["masked"].update(msg.senders)
        return {"status": "accepted", "round": self.round, "nodes": len(msg.senders)}

    def _clear_meta(self, meta: dict[str, Any]) -> tuple[int, float]:
        """(num_examples, train_loss) of a keys message's meta, checked (Malformed / OutOfRange).
        Distributed DP: the meta must carry neither (the count is inside the masked vector, the
        loss is not sent); local DP: one example and no loss (NodePrivacy.protect)."""
        has = sorted(k for k in ("num_examples", "train_loss") if k in meta)
        if self.privacy is not None and self.privacy.plan.client_shares:
            if has:
                raise Malformed(
                    f"keys: under distributed DP the meta carries no {' or '.join(has)} in the clear (the example "
                    "count travels inside the masked vector): update the node"
                )
            return 0, float("nan")
        n, loss = meta.get("num_examples"), meta.get("train_loss", float("nan"))
        if (
            not isinstance(n, int)
            or isinstance(n, bool)
            or n < 1
            or not isinstance(loss, (int, float))
            or isinstance(loss, bool)
        ):
            raise Malformed("keys: meta needs num_examples (an integer >= 1) and train_loss, if any, a number")
        if self.privacy is not None and self.privacy.plan.dp_sgd and (n != 1 or "train_loss" in meta):
            raise Malformed(
                "keys: a local-DP node sends num_examples = 1 and no train_loss (nothing data-dependent beside "
                "its noisy update): update the node"
            )
        if n > self.max_examples:  # max_weight is the largest count: one huge claim would zero the others
            raise OutOfRange(
                f"keys: num_examples = {n} is above the limit of {self.max_examples} (server.max_examples)"
            )
        return n, float(loss)

    def _algorithm_meta(self, meta: dict[str, Any]) -> dict[str, float]:
        """What the algorithm sends in the clear beside the keys (FedNova's step weight), checked
        (Malformed); another algorithm's field is refused, as on the plain upload path."""
        if not self.payload.normalised:
            if FEDNOVA_A in meta:
                raise Malformed(f"keys: algorithm.name = {self.payload.algorithm!r} takes no {FEDNOVA_A}")
            return {}
        try:
            return {FEDNOVA_A: step_weight(meta.get(FEDNOVA_A))}
        except ValueError as e:
            raise Malformed(f"keys: {e}") from None

    def _check_signature(self, node: str, stage: str, msg) -> None:
        session = self.params.session
        if stage == "advertise":
            message = ID.keys_message(session, node, msg.enc_key, msg.mask_key)
        elif stage == "consistency":
            message = ID.consistency_message(session, self.server.u3)
        else:
            return
        if not ID.verify(self.roster.get(node, b""), msg.signature, message):
            raise Malformed(
                f"the {stage} message of {node!r} is not signed by its identity key in secure_aggregation.keys_file"
            )

    def reply(self, node: str, route: str, round_: Any) -> bytes | None:
        """The server's answer to ``route`` for ``node`` (None: the stage is still open)."""
        stage = self._check(node, route, round_)
        if route == "unmask":
            raise UpdateRejected("unknown_stage", "the unmasking stage has no reply to fetch")
        if route not in self.replies:
            return None
        body = self.replies[route].get(node)
        if body is None:
            raise UpdateRejected(
                "excluded",
                f"node {node!r} is not in round {self.round} after stage {stage!r} "
                "(it missed a stage or too few of its neighbours remain)",
            )
        return body

    # --- the clock ----------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """Close the current stage if every expected node answered or its deadline
        passed; True when a stage closed (or the round aborted)."""
        if self.over:
            return False
        if len(self.sent[self.stage]) < len(self._expected(self.stage)) and now < self.deadline_at:
            return False
        missing = sorted(self._expected(self.stage) - self.sent[self.stage])
        if missing:
            log.info(
                "round %d: stage %r closed without %d nodes (dropouts: %s)",
                self.round,
                self.stage,
                len(missing),
                ", ".join(missing),
            )
        try:
            self._close()
        except SecAggAborted as e:
            log.warning("round %d: secure aggregation aborted at stage %r: %s", self.round, self.stage, e)
            self.aborted, self.stage = str(e), "aborted"
            return True
        except Exception as e:  # e.g. a ValueError from the crypto: the round aborts, the server goes on
            log.exception("round %d: secure aggregation failed at stage %r; aborting the round", self.round, self.stage)
            self.aborted, self.stage = f"{type(e).__name__} at stage {self.stage!r}: {e}", "aborted"
            return True
        self.deadline_at = now + self.cfg.stage_s
        return True

    def _close(self) -> None:
        s, r = self.server, self.round
        if self.stage == "advertise":
            directories = s.close_advertise()
            if self.privacy is not None and self.privacy.plan.client_shares:  # the counts' fixed scale
                self.max_weight = self.cfg.max_weight or float(self.max_examples)
            else:
                self.max_weight = self.cfg.max_weight or float(max(self.meta[u][0] for u in s.u1))
            self.replies["keys"] = {
                u: encode_message(d, {"round": r, "max_weight": self.max_weight}) for u, d in directories.items()
            }
            self.stage = "share"
        elif self.stage == "share":
            self.replies["shares"] = {u: encode_message(d, {"round": r}) for u, d in s.close_share().items()}
            self.stage = "masked"
        elif self.stage == "masked":
            if self.privacy is not None:  # before any unmasking share is asked for (SecAggAborted)
                self.privacy.check_survivors(len(s.u3), r)
            self.replies["masked"] = {u: encode_message(q, {"round": r}) for u, q in s.close_masked().items()}
            self.stage = s.stage  # "consistency" with malicious_server, else "unmask"
        elif self.stage == "consistency":
            self.replies["consistency"] = {u: encode_message(q, {"round": r}) for u, q in s.close_consistency().items()}
            self.stage = "unmask"
        else:
            result = s.finish()
            if self.privacy is not None and self.privacy.plan.client_shares:  # [clip(delta_k), n_k / max_weight]
                total, counts = decode_weighted(result.total, len(result.included), self.values, self.weights)
                if self.privacy.ddg is not None:  # the model entries are the discrete Gaussian's integers
                    codec = DdgCodec(self.privacy.ddg, rotation_seed(self.params.session))
                    missing = self.privacy.cohort - len(result.included)  # topped up to K_max shares, in the integers
                    total = codec.decode(codec.top_up(result.total[:-1], missing, NoiseSource()))
                self.mean, self.examples = total / len(result.included), max(0, round(counts * self.max_weight))
            else:
                self.sums = self.payload.decode(result.total, len(result.included), self.values, self.weights)
            self.included, self.dropped = result.included, result.dropped
            self.stage = "done"
            log.info(
                "round %d: secure sum of %d nodes unmasked (%d dropped before their masked input)",
                r,
                len(self.included),
                len(self.dropped),
            )

    def close(self, rounds: SyncRounds) -> RoundSummary | None:
        """Hand the unmasked mean to ``rounds`` and finish it, or abort it; None if aborted. Under
        distributed DP an aborted round is finished as one that selected nobody: it releases the
        noise alone, at a new version, like an empty round (shoal.accounting_aborts: whether it
        aborts depends on who was sampled, and it must not show)."""
        if self.aborted is not None:
            if self.privacy is not None and self.privacy.plan.client_shares:
                log.warning(
                    "round %d aborted by secure aggregation; released as an empty round: %s", self.round, self.aborted
                )
                return rounds.finish_empty()
            log.warning(
                "round %d aborted by secure aggregation, model and version unchanged: %s", self.round, self.aborted
            )
            rounds.abort_round()
            return None
        if self.sums is not None:  # the algorithm's layout: one update per included node carrying the sums
            members = {}
            for u in self.included:
                n, loss = self.meta[u]
                members[u] = (n, {**({"train_loss": loss} if math.isfinite(loss) else {}), **self.clear_metrics[u]})
            for update in self.payload.updates(self.sums, members, rounds.version):
                rounds.submit(update.sender, update)
            return rounds.finish_round()
        assert self.mean is not None and self.examples is not None  # distributed DP: only the counts' sum is known
        mean = torch.from_numpy(self.mean).to(torch.float32)
        base, extra = divmod(self.examples, len(self.included))
        for i, u in enumerate(self.included):
            rounds.submit(u, Update(mean, base + (i < extra), rounds.version, u, {}))
        return rounds.finish_round()

    def status(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "stage": self.stage,
            "aborted": self.aborted,
            "sent": {route: sorted(self.sent[stage]) for route, stage in ROUTES.items()},
            "included": len(self.included),
            "dropped": len(self.dropped),
        }
