"""An edge aggregator process: `shoal server --parent URL` (docs/hierarchy.md).

To its nodes an edge is a server: they poll it for tasks (``GET /v1/task``), download the model
from it (``GET /v1/model``, the root's bytes cached once per version and served locally) and
upload their updates to it (``POST /v1/update``), with the node protocol of docs/protocol.md.
To the root it is one caller: it names its connected nodes in ``POST /v1/edge/poll`` (the root
counts them as connected, selects among them and answers with the tasks of the nodes this edge
holds in the open round), and sends one partial per round (``POST /v1/partial``,
server/edge/partial_sender.py), retransmitted until the root answers.

:class:`EdgeNodes` is the edge's state without I/O: the nodes it serves, the open root round's
:class:`~shoal.server.edge.rounds.EdgeRound` (its nodes' updates summed as they come; closed when every
node reported, at ``hierarchy.edge_quorum`` of the expected weight, or
``hierarchy.edge_margin_s`` before the root's deadline), the cached model. :func:`serve_edge`
is the aiohttp side around it: the node routes, the poll of the root, the model fetch and the
uplink. An edge takes sync FedAvg rounds, plain or with secure aggregation (relayed, its nodes'
masked inputs added: server/edge/secure.py), or with ``hierarchy.edge_rounds = k > 1`` HierFAVG's
k edge rounds inside each root round (server/edge/rounds.py's :class:`~shoal.server.edge.rounds.EdgeRounds`: its
nodes train from the edge's own model, served by the edge, between the root's); or it serves an
async FedBuff root (its nodes' tasks from the root's version of the moment, their updates buffered
by version: server/edge/rounds.py's :class:`~shoal.server.edge.rounds.EdgeBuffer`); without DP (config rules
refuse the rest, with the reason).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any

from shoal.aggregation.partial import Partial, update_weight
from shoal.assembly import initial_model, task_from_config
from shoal.config import Config
from shoal.errors import ConfigError, Malformed, ShoalError, SpecMismatch, UpdateRejected
from shoal.params import ParamSpec
from shoal.task import Task
from shoal.update import Update
from shoal.wire import MAX_HEADER_BYTES, decode_model, decode_update, model_parts

from ..service import ModelDownload, parse_failure_report, spec_mismatch_detail
from .intake import MAX_ROSTER
from .rounds import EdgeBuffer, EdgeRound, EdgeRounds
from .secure import EdgeRelay

log = logging.getLogger(__name__)

MAX_PRIVACY_INFO = 4096  # bytes of the root's privacy task fields an edge passes on to its nodes


def _names(value: object) -> bool:
    """``value`` is a list of at most MAX_ROSTER node names (1 to 256 characters)."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_ROSTER
        and all(isinstance(n, str) and 1 <= len(n) <= 256 for n in value)
    )


def _int(obj: dict, key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 2**53:
        raise Malformed(f"the root's answer field {key!r} = {str(v)[:40]} is not an integer >= 0")
    return v


class EdgeNodes:
    """An edge aggregator's state, without I/O: its nodes, the open root round, the cached model.
    Time is passed in as ``now`` (monotonic seconds)."""

    def __init__(self, cfg: Config, spec: ParamSpec):
        self.cfg, self.spec = cfg, spec
        s = cfg.server
        self.update_limit = spec.nbytes + MAX_HEADER_BYTES
        if s.max_body_bytes and self.update_limit > s.max_body_bytes:
            raise ConfigError(
                f"an edge takes whole-body uploads (no chunks yet): server.max_body_bytes = {s.max_body_bytes} is "
                f"below a dense update of this model ({self.update_limit} bytes); raise it, or set it to 0"
            )
        self.max_body_bytes = s.max_body_bytes or self.update_limit
        self.name = ""  # the root names this edge in its answers (the identity of its token)
        self.last_seen: dict[str, float] = {}
        self.round: EdgeRound | None = None
        self.seeds: dict[str, int] = {}
        self.started_at: float | None = None  # when this edge heard of the open round
        self.weights: dict[str, float] = {}  # each node's weight in the last update it sent (the quorum's expectation)
        self.model: ModelDownload | None = None  # what this edge's nodes download (the root's, or its own)
        self.root_model: ModelDownload | None = None  # the root's model, cached
        self.cycle: EdgeRounds | None = None  # hierarchy.edge_rounds > 1: the open root round's edge rounds
        self.done = False
        self.done_answer: dict[str, Any] = {}
        self.told_done: set[str] = set()
        self.accepted = 0
        self.refused: dict[str, int] = {}
        # under an async (FedBuff) root: the nodes' tasks and their updates summed by base version
        h = cfg.hierarchy
        self.buffer: EdgeBuffer | None = None
        self.on_want: Callable[[], None] = lambda: None  # a node started waiting for a task (the uplink asks)
        if cfg.server.mode == "async":
            size = h.edge_buffer or cfg.asynchronous.buffer_size
            self.buffer = EdgeBuffer("", spec.numel, weighting=cfg.strategy.weighting, size=size, wait_s=h.edge_flush_s)
        # secure rounds: the edge relays the protocol and adds masked inputs (server/edge/secure.py)
        self.relay = EdgeRelay(cfg.secure_aggregation.stage_s, cfg.hierarchy.edge_margin_s)
        self.privacy: dict[str, Any] | None = None  # the root round's privacy task fields (distributed DP)
        # nodes the root's registry does not enable (revoked there): refused here from the root's answer on,
        # whatever this edge's copy of the registry says; and the root's other refusals of this edge's claims
        self.revoked: set[str] = set()
        self.refusal_log: dict[str, tuple[float, int]] = {}  # revoked node -> (last logged, refusals since)
        self.claims_refused: dict[str, str] = {}

    # --- towards the nodes -------------------------------------------------------------

    def connected(self, now: float) -> list[str]:
        """Nodes heard from within one long-poll period (plus 5 s of slack), as a root counts them."""
        horizon = self.cfg.server.poll_s + 5.0
        return sorted(n for n, t in self.last_seen.items() if now - t <= horizon)

    def seen(self, node: str, now: float) -> None:
        self.last_seen[node] = now

    def check_spec(self, node_hash: str | None) -> None:
        if node_hash is not None and node_hash != self.spec.hash:
            raise SpecMismatch(spec_mismatch_detail(node_hash[:64], self.spec.hash))

    def check_node(self, node: str) -> None:
        """UpdateRejected (``revoked``; answered 403) for a node the root revoked."""
        if node in self.revoked:
            raise UpdateRejected("revoked", f"node {node!r} is revoked at the root; this edge serves it nothing")

    def poll(self, node: str, now: float) -> dict[str, Any] | None:
        """The node's task if it has one now (its root round, served from this edge), ``done`` at
        the end, else None."""
        self.check_node(node)
        self.seen(node, now)
        if self.done:
            self.told_done.add(node)
            return {"status": "done", **self.done_answer}
        if self.buffer is not None:
            return self._poll_async(node, self.buffer)
        er = self.round
        if er is None or er.closed or node not in er.nodes or node in er.acc.senders:
            return None
        if self.model is None or self.model.version != er.version:
            return None  # the model of the round is on its way from the root
        if not self.relay.wants_task(node):
            return None  # it joined the round's secure aggregation: its work is the protocol now
        seed = self.cycle.seed(node) if self.cycle is not None else self.seeds[node]
        work: dict[str, Any] = {"status": "work", "round": er.round, "version": er.version, "seed": seed}
        if self.relay.secure:
            work["secure_aggregation"] = self.relay.info
        if self.privacy is not None:  # the root's distributed-DP task fields, checked by the node
            work["privacy"] = self.privacy
        if er.close_at is not None:
            work["deadline_s"] = round(max(er.close_at - now, 0.0), 3)
        return work

    def _poll_async(self, node: str, buf: EdgeBuffer) -> dict[str, Any] | None:
        """Under an async root: the node's open task if this edge serves its model; else None (the
        root hands it a task at this edge's next poll: the node waits in ``want``)."""
        waited = node in buf.want
        task = buf.asks(node)
        if task is None or self.model is None:
            if task is None and not waited:
                self.on_want()
            return None
        version, seed = task
        if self.model.version > version:  # the root moved on before the node fetched its model
            buf.stale(node)
            self.on_want()
            return None
        if self.model.version < version:
            return None  # that version's model is on its way from the root
        buf.deliver(node)
        return {"status": "work", "round": version, "version": version, "seed": seed}

    def submit(self, node: str, body: bytes | bytearray | memoryview, now: float) -> dict[str, Any]:
        """One node's update into the open round's sum (under an async root: into the edge's buffer);
        a ShoalError with nothing changed if refused (counted in ``refused`` by its code)."""
        try:
            self.check_node(node)
            self.seen(node, now)
            update, answer = self._take_async(body, node, now) if self.buffer is not None else self._take(body, node)
        except ShoalError as e:
            code = getattr(e, "code", "error")
            self.refused[code] = self.refused.get(code, 0) + 1
            raise
        self.weights[node] = update_weight(update, self.cfg.strategy.weighting)
        self.accepted += 1
        return answer

    def _take(self, body: bytes | bytearray | memoryview, node: str) -> tuple[Update, dict[str, Any]]:
        """A sync root: the update into the open edge round's sum."""
        er = self.round
        if er is None or er.closed:
            raise UpdateRejected("round_closed", f"this edge has no open round (root version {self.version})")
        update = self._decode(body, "FedAvg", er.round)
        er.submit(node, update)
        return update, {"status": "accepted", "round": er.round, "version": er.version}

    def _take_async(self, body: bytes | bytearray | memoryview, node: str, now: float) -> tuple[Update, dict[str, Any]]:
        """An async root: the update into the edge's FedBuff buffer."""
        assert self.buffer is not None
        update = self._decode(body, "FedBuff")
        self.buffer.submit(node, update, now)
        return update, {"status": "accepted", "round": update.base_version, "version": self.version}

    def _decode(self, body: bytes | bytearray | memoryview, algorithm: str, round_: int | None = None) -> Update:
        """The update in ``body``, checked as the root checks one, and (``round_``) that it is for that
        round if it names one; a ShoalError if not."""
        s = self.cfg.server
        update, header = decode_update(
            body, self.spec, self.update_limit, copy=False, max_examples=s.max_examples, max_abs=s.max_delta_abs
        )
        if round_ is not None and header.get("round") is not None and header.get("round") != round_:
            raise UpdateRejected(
                "round_closed", f"the update is for round {str(header.get('round'))[:20]}, the open one is {round_}"
            )
        if update.to_server:
            raise Malformed(f"the update carries {sorted(update.to_server)} beside its delta; {algorithm} takes none")
        return update

    def failed(self, node: str, body: bytes, now: float) -> dict[str, Any]:
        """A node's report that its task failed: the edge stops waiting for it this round."""
        self.seen(node, now)
        round_, version, reason = parse_failure_report(body)
        if self.buffer is not None:
            if not self.buffer.drop(node, version):
                raise UpdateRejected("not_assigned", f"node {node!r} holds no task of version {version} here")
            self.refused[reason] = self.refused.get(reason, 0) + 1
            return {"status": "noted", "round": round_}
        er = self.round
        if er is None or (er.round, er.version) != (round_, version) or node not in er.nodes:
            raise UpdateRejected("not_selected", f"node {node!r} holds no task of round {round_} here")
        er.drop(node)
        self.refused[reason] = self.refused.get(reason, 0) + 1
        log.warning("round %d: node %s reports its task %s", round_, node, reason)
        return {"status": "noted", "round": round_}

    @property
    def version(self) -> int:
        """The root's version cached here."""
        return self.root_model.version if self.root_model is not None else 0

    def took_model(self, download: ModelDownload) -> None:
        """The root's model arrived: cached, and served to the nodes unless they train from the edge's own."""
        self.root_model = download
        if self.cycle is None or self.cycle.k == 0:
            self.model = download

    @property
    def root_round(self) -> tuple[int, int] | None:
        """The root's (round, version) this edge serves (with edge rounds: whichever is open)."""
        if self.cycle is not None:
            return self.cycle.round, self.cycle.root_version
        return None if self.round is None else (self.round.round, self.round.version)

    def close_round(self, now: float) -> tuple[Partial | None, bool]:
        """Close the open (edge) round: ``(partial for the root or None, whether another edge round opened)``."""
        er, cycle = self.round, self.cycle
        assert er is not None
        part = er.close()
        if cycle is None or part is None:
            return part, False  # an edge round with no update: the edge reports nothing this root round
        if cycle.last:
            return cycle.final(part), False
        assert self.root_model is not None and self.root_model.version == cycle.root_version
        root = decode_model(bytes(self.root_model.head) + bytes(self.root_model.data), self.spec)[0]
        cycle.advance(part, root)
        assert cycle.params is not None
        version = cycle.version
        head, data = model_parts(cycle.params, self.spec, version)
        self.model = ModelDownload(version, f'"{self.spec.hash}-e{version}-{self.name.encode().hex()}"', head, data)
        self.round = EdgeRound(
            self.name,
            cycle.round,
            version,
            self.spec.numel,
            list(cycle.seeds),
            weighting=self.cfg.strategy.weighting,
            deadline_at=cycle.close_at(now),
            quorum=self.cfg.hierarchy.edge_quorum,
            expected=self.weights,
        )
        log.info(
            "round %d: edge round %d of %d (%d nodes, the mean of %d) from this edge's model",
            cycle.round, cycle.k + 1, cycle.kappa, len(cycle.seeds), part.count,
        )  # fmt: skip
        return None, True

    # --- towards the root --------------------------------------------------------------

    def from_root(self, answer: object, now: float) -> bool:
        """Take the root's answer to a poll; True when something changed for the nodes (a new round,
        the end). Malformed (nothing changed) if it is not an answer."""
        if not isinstance(answer, dict) or answer.get("status") not in ("work", "wait", "done"):
            raise Malformed(f"the root's poll answer is not one: {str(answer)[:200]}")
        name = answer.get("edge")
        if not isinstance(name, str) or not 1 <= len(name) <= 256:
            raise Malformed("the root's answer names no edge")
        revoked, refused = answer.get("revoked", []), answer.get("refused", {})
        if not _names(revoked) or not isinstance(refused, dict) or not _names(list(refused)):
            raise Malformed("the root's revoked / refused fields are not lists of node names")
        self.name = name
        revoked_now = self.revoke(revoked, now)
        self._claims(refused)
        if answer["status"] == "done":
            if not self.done:
                log.info("the root reports done at version %s", answer.get("version"))
            self.done = True
            self.done_answer = {k: answer[k] for k in ("version", "reason") if k in answer}
            return True
        if answer["status"] == "wait":
            return revoked_now
        round_, version = _int(answer, "round"), _int(answer, "version")
        tasks = answer.get("tasks")
        if (
            not isinstance(tasks, dict)
            or not tasks
            or not all(isinstance(n, str) and isinstance(s, int) and not isinstance(s, bool) for n, s in tasks.items())
        ):
            raise Malformed("the root's tasks are not {node: seed}")
        if self.buffer is not None:  # an async root: tasks from its current version
            self.buffer.edge = name
            self.buffer.given(tasks, version)
            return True
        left = answer.get("deadline_s")
        if left is not None and (isinstance(left, bool) or not isinstance(left, (int, float)) or not left >= 0):
            raise Malformed(f"the root's deadline_s = {str(left)[:40]} is not a number of seconds >= 0")
        er = self.round
        if self.root_round == (round_, version):  # the round this edge serves: a node may have re-attached here
            return self._joined(tasks) or revoked_now
        if er is not None and not er.closed and er.acc.count:
            log.warning("round %d: the root moved on to round %d before this edge's partial", er.round, round_)
        secure = answer.get("secure_aggregation")
        self.relay.check_info(secure)
        privacy = answer.get("privacy")
        if privacy is not None and (not isinstance(privacy, dict) or len(json.dumps(privacy)) > MAX_PRIVACY_INFO):
            raise Malformed(f"the root's privacy task fields are not an object of at most {MAX_PRIVACY_INFO} bytes")
        # a round this edge cannot run as the root does: it stops (one line), it does not retry
        if (privacy is not None) != (self.cfg.privacy.mode != "none"):
            raise ConfigError(
                f"privacy.mode: this edge runs {self.cfg.privacy.mode!r} and the root's round "
                f"{'has' if privacy is not None else 'has no'} privacy task fields: run the edge with the root's "
                "[privacy] table"
            )
        if (secure is not None) != bool(self.cfg.secure_aggregation.enabled):
            raise ConfigError(
                f"secure_aggregation.enabled: this edge runs {bool(self.cfg.secure_aggregation.enabled)}, the "
                f"root's round is {'secure' if secure is not None else 'in the clear'}: run the edge with the root's "
                "[secure_aggregation] table"
            )
        self.privacy = privacy
        h = self.cfg.hierarchy
        deadline_at = None if left is None or not math.isfinite(left) else now + float(left)
        self.cycle = None
        if h.edge_rounds > 1:  # the edge rounds share the time to the root's deadline less the margin
            close = None if deadline_at is None else deadline_at - h.edge_margin_s
            self.cycle = EdgeRounds(h.edge_rounds, round_, version, dict(tasks), close)
            deadline_at, margin = self.cycle.close_at(now), 0.0
        else:
            margin = h.edge_margin_s
        if self.root_model is not None:
            self.model = self.root_model  # not an edge model of the round before
        self.round = EdgeRound(
            self.name,
            round_,
            version,
            self.spec.numel,
            list(tasks),
            weighting=self.cfg.strategy.weighting,
            deadline_at=deadline_at,
            margin_s=margin,
            quorum=h.edge_quorum,
            expected=self.weights,
        )
        self.seeds = dict(tasks)
        self.relay.start(round_, version, list(tasks), secure, now)
        self.started_at = now
        log.info("round %d (version %d): %d of this edge's nodes have a task", round_, version, len(tasks))
        return True

    def _joined(self, tasks: dict[str, int]) -> bool:
        """The root handed this edge the task of a node that re-attached here in the open round (a plain
        round with one edge round: secure rounds fixed their cohort; edge rounds their nodes)."""
        er = self.round
        if er is None or self.cycle is not None or self.relay.secure:
            return False
        new = [n for n in tasks if n not in self.seeds and er.add(n)]
        for n in new:
            self.seeds[n] = tasks[n]
            log.info("round %d: node %s re-attached here and gets its task", er.round, n)
        return bool(new)

    def revoke(self, nodes: list[str], now: float) -> bool:
        """The root revoked ``nodes`` (its answer's ``revoked``): from now on each is refused here (403),
        served no model or task, dropped from the open round and not named to the root again. True
        when a node was new to the list (its requests waiting here are answered at once)."""
        new = [n for n in nodes if n not in self.revoked]
        for n in new:
            self.revoked.add(n)
            self.last_seen.pop(n, None)
            if self.round is not None:
                self.round.drop(n)
            log.warning("node %s is revoked at the root: refused here from now on", n)
        return bool(new)

    def _claims(self, refused: dict[str, Any]) -> None:
        """Log each of this edge's claims the root refused, with its reason, once per change."""
        for n, why in refused.items():
            if (
                n not in self.revoked
                and self.claims_refused.get(n) != why
                and len(self.claims_refused) < 2 * MAX_ROSTER
            ):
                self.claims_refused[n] = str(why)[:40]
                log.warning("the root refuses this edge's claim on node %s: %s", n, str(why)[:40])
        for n in [n for n in self.claims_refused if n not in refused]:
            del self.claims_refused[n]

    def finished(self, now: float, done_at: float) -> bool:
        """Done, and every connected node was told so (or one poll period passed)."""
        waiting = set(self.connected(now)) - self.told_done
        return self.done and (not waiting or now - done_at > self.cfg.server.poll_s + 5)


def edge_spec(cfg: Config, task: Task | None = None) -> ParamSpec:
    """The model's spec, built as the root builds it (the same task, model and seed)."""
    task = task if task is not None else task_from_config(cfg)
    model = initial_model(cfg, task)
    return ParamSpec.of(model, exchange_buffers=task.exchange_buffers).with_base(model)
