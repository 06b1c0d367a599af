"""An edge aggregator process: `shoal server --parent URL` (docs/hierarchy.md).

To its nodes an edge is a server: they poll it for tasks (``GET /v1/task``), download the model
from it (``GET /v1/model``, the root's bytes cached once per version and served locally) and
upload their updates to it (``POST /v1/update``), with the node protocol of docs/protocol.md.
To the root it is one caller: it names its connected nodes in ``POST /v1/edge/poll`` (the root
counts them as connected, selects among them and answers with the tasks of the nodes this edge
holds in the open round), and sends one partial per round (``POST /v1/partial``,
server/edge_uplink.py), retransmitted until the root answers.

:class:`EdgeNodes` is the edge's state without I/O: the nodes it serves, the open root round's
:class:`~shoal.server.edge.EdgeRound` (its nodes' updates summed as they come; closed when every
node reported, at ``hierarchy.edge_quorum`` of the expected weight, or
``hierarchy.edge_margin_s`` before the root's deadline), the cached model. :func:`serve_edge`
is the aiohttp side around it: the node routes, the poll of the root, the model fetch and the
uplink. An edge takes sync FedAvg rounds, plain or with secure aggregation (relayed, its nodes'
masked inputs added: server/edge_secure.py), or with ``hierarchy.edge_rounds = k > 1`` HierFAVG's
k edge rounds inside each root round (server/edge.py's :class:`~shoal.server.edge.EdgeRounds`: its
nodes train from the edge's own model, served by the edge, between the root's); or it serves an
async FedBuff root (its nodes' tasks from the root's version of the moment, their updates buffered
by version: server/edge.py's :class:`~shoal.server.edge.EdgeBuffer`); without DP (config rules
refuse the rest, with the reason).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from shoal.aggregation.partial import Partial, encode_partial, update_weight
from shoal.assembly import initial_model, task_from_config
from shoal.config import Config
from shoal.errors import ConfigError, Malformed, ShoalError, SpecMismatch, UpdateRejected
from shoal.metrics import json_safe
from shoal.params import ParamSpec
from shoal.pki import read_secret
from shoal.signals import on_stop_signals
from shoal.task import Task
from shoal.update import Update
from shoal.wire import MAX_HEADER_BYTES, decode_model, decode_update, model_parts, read_header

from .app_base import base_app
from .bodies import read_body
from .connections import listen
from .edge import MAX_ROSTER, EdgeBuffer, EdgeRound, EdgeRounds, edge_terms
from .edge_secure import RELAY, EdgeRelay, RelayLink, edge_get_secagg, edge_post_secagg
from .edge_uplink import PartialRefused, UplinkGaveUp, send_partial
from .http_common import (
    CHANGED,
    NODE,
    SHUTDOWN_S,
    SPEC_HASH_HEADER,
    Refusal,
    answer_and_hang_up,
    error,
    notify,
    seconds_param,
    send_model,
    status_of,
    wait_event,
)
from .service import MAX_FAILURE_BODY, ModelDownload, parse_failure_report, spec_mismatch_detail

log = logging.getLogger(__name__)

POLL_WAIT_S = 1.0  # the edge's poll of the root is held this long at most while the root has no work for it
CLOSE_EVERY_S = 0.05  # how often the edge looks whether its part of the round is due to close
ASYNC_SEND_S = 60.0  # under an async root, a partial is sent again for this long at most
ATTACH_S = 30.0  # an edge whose root never answered stops (one line, why) after trying this long
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
        # secure rounds: the edge relays the protocol and adds masked inputs (server/edge_secure.py)
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


class RoundJournal:
    """The updates an edge took in the open root round, on disk (``server.out_dir``/edge-journal):
    one file per update, the node's body as it came, written (and fsynced) before the node hears
    ``accepted``. An edge restarted within the round (a crash, SIGKILL, a redeploy) takes them back
    into its sum (:meth:`entries`), so what its nodes sent is not lost. The files are the nodes'
    updates in the clear: the folder is 0700 and each file 0600 (the edge's user only), and none
    outlives its use: a round's files go once the root answered its partial (:meth:`drop_round`),
    those of any other round as soon as the root's answer shows it is not the round served here
    (:meth:`keep_round`, at start-up too), and the folder at the end of the run (:meth:`remove`).
    Sync rounds only (``hierarchy.edge_journal``)."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)  # an older folder (or one made under another umask) is closed too
        self.names = {p.name for p in folder.iterdir()}  # what is on disk: pruning an empty journal reads nothing
        self.lock = threading.Lock()  # keep() runs in a worker thread

    @staticmethod
    def _name(round: int, version: int, node: str) -> str:
        return f"r{round}-v{version}-{node.encode().hex()}.update"

    def keep(self, round: int, version: int, node: str, body: bytes | bytearray | memoryview) -> None:
        path = self.folder / self._name(round, version, node)
        tmp = path.with_suffix(".tmp")
        with self.lock:
            self.names.add(tmp.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)  # a .tmp left by a crash was made before: its mode is not ours
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        with self.lock:
            self.names.discard(tmp.name)
            self.names.add(path.name)

    def nodes(self) -> list[str]:
        """Every node with an update kept (whatever its round): connected at an edge's start."""
        return sorted({bytes.fromhex(p.stem.split("-", 2)[2]).decode() for p in self._files()})

    def entries(self, round: int, version: int) -> list[tuple[str, bytes]]:
        """The (node, body) pairs kept for ``round`` / ``version``."""
        prefix = f"r{round}-v{version}-"
        return [
            (bytes.fromhex(p.stem[len(prefix) :]).decode(), p.read_bytes())
            for p in self._files()
            if p.name.startswith(prefix)
        ]

    def keep_round(self, round: int | None) -> None:
        """Remove every file but those of root round ``round`` (None: every file)."""
        self._remove(lambda n: round is None or not n.startswith(f"r{round}-v"))

    def drop_round(self, round: int) -> None:
        """The root answered round ``round``'s partial: its updates are no longer needed."""
        self._remove(lambda n: n.startswith(f"r{round}-v"))

    def remove(self) -> None:
        """The run is over: every file and the folder."""
        with self.lock:
            self.names |= {p.name for p in self.folder.iterdir()}
        self.keep_round(None)
        try:
            self.folder.rmdir()
        except OSError as e:
            log.warning("the edge journal %s is not removed: %s", self.folder, e)

    def _remove(self, which: Callable[[str], bool]) -> None:
        with self.lock:
            names = [n for n in self.names if which(n)]
            for n in names:
                (self.folder / n).unlink(missing_ok=True)
                self.names.discard(n)

    def _files(self) -> list[Path]:
        out = []
        for p in sorted(self.folder.glob("r*-v*-*.update")):
            try:
                bytes.fromhex(p.stem.split("-", 2)[2]).decode()
            except (IndexError, ValueError):
                continue  # not one of this journal's names
            out.append(p)
        return out


# --- the aiohttp side --------------------------------------------------------------------

EDGE = web.AppKey("edge", EdgeNodes)
JOURNAL = web.AppKey("journal", RoundJournal)
INGEST = web.AppKey("ingest", asyncio.Semaphore)  # bodies read at once: at most server.ingest_slots


REFUSAL_LOG_S = 10.0  # an edge logs a revoked node's refused requests at most this often per node


@web.middleware
async def revoked_nodes(request: web.Request, handler):
    """A node the root revoked gets 403 at this edge on every route, whatever the edge's copy of the
    registry says (its body, if any, is not read); each refusal is logged with its reason (at most
    one line per node per REFUSAL_LOG_S, with the count since)."""

    edge, node = request.app[EDGE], request.get(NODE)
    if node is None or node not in edge.revoked:
        return await handler(request)
    edge.refused["revoked"] = edge.refused.get("revoked", 0) + 1
    now = time.monotonic()
    last, count = edge.refusal_log.get(node, (-math.inf, 0))
    if now - last >= REFUSAL_LOG_S:
        log.warning(
            "refused %s %s of node %s: revoked at the root (%d more since)", request.method, request.path, node, count
        )
        edge.refusal_log[node] = (now, 0)
    else:
        edge.refusal_log[node] = (last, count + 1)
    resp = error(403, "revoked", f"node {node!r} is revoked at the root; this edge serves it nothing")
    if request.body_exists and not request.content.at_eof():
        await answer_and_hang_up(request, resp)
    return resp


def _edge_app(edge: EdgeNodes, registry) -> web.Application:

    app = base_app(edge.cfg, registry, edge.max_body_bytes)
    app.middlewares.append(revoked_nodes)  # after auth: it knows the node
    app[EDGE] = edge
    app[INGEST] = asyncio.Semaphore(edge.cfg.server.ingest_slots)
    app.router.add_get("/v1/task", get_task)
    app.router.add_get("/v1/model", get_model)
    app.router.add_post("/v1/update", post_update)
    app.router.add_post("/v1/failed", post_failed)
    app[RELAY] = RelayLink(edge.relay, edge.seen)  # secure rounds (server/edge_secure.py)
    app.router.add_post("/v1/secagg/{stage}", edge_post_secagg)
    app.router.add_get("/v1/secagg/{stage}", edge_get_secagg)
    return app


async def get_task(request: web.Request) -> web.Response:

    edge, node = request.app[EDGE], request[NODE]
    end = time.monotonic() + seconds_param(request, "wait", edge.cfg.server.poll_s)
    try:
        edge.check_spec(request.headers.get(SPEC_HASH_HEADER))
    except ShoalError as e:
        return error(status_of(e), e.code, str(e))
    while True:
        event = request.app[CHANGED]["event"]
        try:
            work = edge.poll(node, time.monotonic())
        except ShoalError as e:  # revoked at the root while it waited
            return error(403, e.code, str(e))
        if work is not None:
            return web.json_response(work)
        left = end - time.monotonic()
        if left <= 0:
            return web.json_response({"status": "wait", "version": edge.version})
        await wait_event(event, min(left, 1.0))


async def get_model(request: web.Request) -> web.StreamResponse:

    edge = request.app[EDGE]
    edge.seen(request[NODE], time.monotonic())
    if edge.model is None:
        raise Refusal(503, "no_model", "this edge has not fetched the model from its root yet; try again shortly")
    return await send_model(request, edge.model)


async def _body(request: web.Request, limit: int) -> bytes:
    return await read_body(
        request, limit, request.app[EDGE].cfg.server.upload_timeout_s, timeout_key="upload_timeout_s"
    )


async def post_update(request: web.Request) -> web.Response:

    edge, node = request.app[EDGE], request[NODE]
    try:
        async with request.app[INGEST]:  # memory: at most server.ingest_slots bodies of max_body_bytes
            body = await _body(request, edge.max_body_bytes)
            result = edge.submit(node, memoryview(bytearray(body)), time.monotonic())
            journal = request.app.get(JOURNAL)
            if journal is not None and edge.round is not None:  # kept before the node hears "accepted"
                try:
                    await asyncio.to_thread(journal.keep, edge.round.round, edge.round.version, node, body)
                except OSError as e:
                    log.error("round %d: the update of %s is summed but not kept on disk: %s", result["round"], node, e)
    except ShoalError as e:
        log.info("update from %s refused: %s: %s", node, getattr(e, "code", "error"), e)
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    notify(request.app)  # the closer looks at once whether the round is complete
    return web.json_response(result)


async def post_failed(request: web.Request) -> web.Response:

    edge = request.app[EDGE]
    body = await _body(request, MAX_FAILURE_BODY)
    try:
        return web.json_response(edge.failed(request[NODE], body, time.monotonic()))
    except ShoalError as e:
        return error(status_of(e), getattr(e, "code", "error"), str(e))


class Uplink:
    """The edge's side towards its root: the poll, the model fetch, the partials; per-round
    figures into ``server.out_dir``/edge_metrics.jsonl."""

    def __init__(self, edge: EdgeNodes, app: web.Application, http: aiohttp.ClientSession, parent: str, ssl_ctx):
        self.edge, self.app, self.http = edge, app, http
        self.parent = parent.rstrip("/")
        self.ssl = ssl_ctx if ssl_ctx is not None else True
        self.sending: set[asyncio.Task] = set()
        self.wanted = asyncio.Event()  # a node of this edge started waiting for a task (async roots)
        edge.on_want = self.wanted.set
        self.rand = random.Random()
        out = Path(edge.cfg.server.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.metrics = out / "edge_metrics.jsonl"

    def _changed(self) -> None:
        notify(self.app)

    async def poll_root(self, stop: asyncio.Event) -> None:
        """Name the connected nodes to the root, take its answer; fetch the round's model."""
        from shoal.client.http import Backoff, connection_problem, unreachable

        backoff = Backoff()
        done_at: float | None = None
        attached = False  # the root answered once: from then on it may restart, and the edge waits for it
        failing_since: float | None = None
        while not stop.is_set():
            now = time.monotonic()
            if self.edge.done:  # the root is done (and may be gone): tell the nodes, then stop
                done_at = done_at if done_at is not None else now
                if self.edge.finished(now, done_at) and not self.sending:
                    stop.set()
                    return
                await asyncio.sleep(0.2)
                continue
            try:
                nodes = self.edge.connected(now)[:MAX_ROSTER]  # the root takes no more
                body: dict[str, Any] = {"nodes": nodes, "config": edge_terms(self.edge.cfg)}
                buf = self.edge.buffer
                if buf is not None:  # an async root hands out a task to each node that waits for one
                    self.wanted.clear()
                    buf.forget(nodes)
                    body["want"] = sorted(buf.want)
                answer = await self._poll_once(body, buf is not None and not body["want"])
                if answer is None:
                    continue  # a node started waiting for a task: ask again at once, naming it
                if self.edge.from_root(answer, time.monotonic()):
                    self.take_back()
                    self._changed()
                self.prune_journal()
                served = self.edge.root_round
                if served is not None and self.edge.round is not None and not self.edge.round.closed:
                    await self.fetch_model(served[1])
                if buf is not None and buf.tasks:
                    await self.fetch_model(max(v for v, _ in buf.tasks.values()))
                backoff.reset()
                attached, failing_since = True, None
            except ConfigError:
                raise
            except (aiohttp.ClientError, TimeoutError, ValueError, ShoalError) as e:
                if isinstance(e, aiohttp.ClientError | TimeoutError):  # a node's hints, with the edge's keys
                    problem = await connection_problem(
                        self.parent, e, "edge", "hierarchy.parent (--parent)", "hierarchy.parent_ca_cert"
                    )
                    if problem is not None:
                        raise ConfigError(f"the root {self.parent}: {problem}") from None
                now = time.monotonic()
                failing_since = failing_since if failing_since is not None else now
                if not attached and now - failing_since >= ATTACH_S:
                    raise ConfigError(
                        f"the root did not answer this edge for {ATTACH_S:.0f} s: "
                        + unreachable(self.parent, e, "hierarchy.parent (--parent)")
                    ) from None
                delay = backoff.next(self.rand)
                log.warning(
                    "poll of the root %s failed (%s: %s); again in %.2f s", self.parent, type(e).__name__, e, delay
                )
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
                continue

    def prune_journal(self) -> None:
        """After each answer of the root: kept updates of a round this edge does not serve are removed
        (the root moved on, or the run is done: then the journal's folder too)."""
        journal = self.app.get(JOURNAL)
        if journal is None:
            return
        if self.edge.done:
            if journal.folder.exists():
                journal.remove()
            return
        served = self.edge.root_round
        journal.keep_round(None if served is None else served[0])

    def take_back(self) -> None:
        """A new round here: the updates this edge kept of it before a restart go back into its sum."""
        journal, er = self.app.get(JOURNAL), self.edge.round
        if journal is None or er is None or er.closed or self.edge.done:
            return
        taken = 0
        for node, body in journal.entries(er.round, er.version):
            try:
                self.edge.submit(node, memoryview(bytearray(body)), time.monotonic())
                taken += 1
            except ShoalError as e:
                log.warning("round %d: the kept update of %s is not taken back: %s", er.round, node, e)
        journal.keep_round(er.round)
        if taken:
            log.info("round %d: took back %d updates kept before this edge restarted", er.round, taken)

    async def _poll_once(self, body: dict[str, Any], interruptible: bool) -> dict[str, Any] | None:
        """One poll of the root; its answer. ``interruptible``: None as soon as a node of this edge
        starts waiting for a task (the poll in flight does not name it; it is dropped)."""
        request = asyncio.ensure_future(self._post_poll(body))
        if not interruptible:
            return await request
        waiting = asyncio.ensure_future(self.wanted.wait())
        try:
            await asyncio.wait({request, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if request.done():
            return request.result()
        request.cancel()
        return None

    async def _post_poll(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(
            self.parent + "/v1/edge/poll", params={"wait": str(POLL_WAIT_S)}, json=body, ssl=self.ssl
        ) as r:
            text = await r.text()
            if r.status in (401, 403, 409):
                try:
                    info = json.loads(text)
                except ValueError:
                    info = {}
                info = info if isinstance(info, dict) else {}
                code, detail = str(info.get("error", ""))[:40], str(info.get("detail", text))[:400]
                if r.status != 409 or code in ("not_supported", "config_mismatch"):
                    raise ConfigError(f"the root {self.parent} refuses this edge ({r.status} {code}): {detail}")
            if r.status != 200:
                raise Malformed(f"{r.status}: {text[:300]}")
            answer = json.loads(text)
        if not isinstance(answer, dict):
            raise Malformed(f"the root's poll answer is not one: {text[:200]}")
        return answer

    async def fetch_model(self, version: int) -> None:
        """The root's model of ``version``, cached and served to this edge's nodes as the root's bytes."""
        from shoal.client.transfer import download

        cached = self.edge.root_model
        if cached is not None and cached.version == version:
            return
        headers = {"If-None-Match": cached.etag} if cached is not None else {}
        got = await download(
            self.http, self.parent + "/v1/model", self.ssl, headers, 2 * self.edge.update_limit, None, self.rand
        )
        if got is None:
            return  # 304: the root is still at the version cached here
        body, etag = got
        assert isinstance(body, bytearray)  # downloaded whole, in memory (not to_disk)
        header = read_header(body, len(body))[0]
        if header.get("spec_hash") != self.edge.spec.hash:
            raise ConfigError(spec_mismatch_detail(str(header.get("spec_hash"))[:64], self.edge.spec.hash))
        got_version = header.get("version")
        if not isinstance(got_version, int) or isinstance(got_version, bool):
            raise Malformed("the root's model names no version")
        self.edge.took_model(ModelDownload(got_version, etag, b"", memoryview(body)))
        log.info("model of version %d cached (%d bytes)", got_version, len(body))
        self._changed()

    async def close_rounds(self, stop: asyncio.Event) -> None:
        """Close the edge's part of a round when it is due, and send its partial up (under an async
        root: send the buffer up when it is full or its oldest update waited long enough)."""
        while not stop.is_set():
            er = self.edge.round
            now = time.monotonic()
            buf = self.edge.buffer
            if buf is not None and buf.should_flush(now):
                why = "size" if buf.count >= buf.size else "time"
                parts = buf.flush()
                task = asyncio.ensure_future(self.send_buffer(parts, why, now))
                self.sending.add(task)
                task.add_done_callback(self.sending.discard)
            if er is not None and er.should_close(now):
                why = (
                    "complete" if er.complete else "quorum" if er.close_at is None or now < er.close_at else "deadline"
                )
                part, opened = self.edge.close_round(now)
                self._changed()  # nodes still training hear the round is over for them (or of the next edge round)
                if part is not None and not opened:
                    task = asyncio.ensure_future(self.send(er, part, why, now))
                    self.sending.add(task)
                    task.add_done_callback(self.sending.discard)
                elif not opened and not self.edge.relay.secure:  # a secure round's inputs leave in the masked sum
                    log.info("round %d: no update arrived before the close (%s)", er.round, why)
            await asyncio.sleep(CLOSE_EVERY_S)

    async def send_buffer(self, parts: list, why: str, flushed_at: float) -> None:
        """An async edge's buffer, one partial per base version, each sent until the root answers
        (no root deadline: given up after ASYNC_SEND_S)."""
        for part in parts:
            body = encode_partial(part, self.edge.spec.hash, self.edge.cfg.hierarchy.partial_dtype)
            record: dict[str, Any] = {
                "edge": self.edge.name,
                "version": part.version,
                "nodes_in": part.count,
                "nodes": sorted(part.senders),
                "weight": part.total_weight,
                "closed": why,
                "partial_bytes": len(body),
            }
            loop = asyncio.get_running_loop()
            try:
                answer = await send_partial(self.http, self.parent, body, give_up_at=loop.time() + ASYNC_SEND_S)
                record["answer"] = answer.get("status")
                record["root_version"] = answer.get("version")
            except (PartialRefused, UplinkGaveUp) as e:
                record["answer"] = "refused" if isinstance(e, PartialRefused) else "gave_up"
                if isinstance(e, PartialRefused):
                    record["refusal"] = e.answer.get("error")
                log.warning("partial of %d nodes (version %d) not taken: %s", part.count, part.version, e)
            record["sent_after_s"] = round(time.monotonic() - flushed_at, 4)
            assert self.edge.buffer is not None
            if self.edge.buffer.answered(part):
                self.wanted.set()  # its nodes that asked meanwhile get their next task
            with self.metrics.open("a") as f:
                f.write(json.dumps(json_safe(record)) + "\n")

    async def send(self, er: EdgeRound, part, why: str, closed_at: float) -> None:
        body = encode_partial(part, self.edge.spec.hash, self.edge.cfg.hierarchy.partial_dtype)
        loop = asyncio.get_running_loop()
        root_deadline = None if er.close_at is None else er.close_at + self.edge.cfg.hierarchy.edge_margin_s
        give_up = None if root_deadline is None else loop.time() + (root_deadline - time.monotonic())
        started = self.edge.started_at if self.edge.started_at is not None else closed_at
        record: dict[str, Any] = {
            "edge": self.edge.name,
            "round": er.round,
            "version": part.version,
            "nodes_given": len(er.nodes),
            "nodes_in": part.count,
            "nodes": sorted(part.senders),
            "weight": part.total_weight,
            "closed": why,
            "closed_after_s": round(closed_at - started, 4),
            "partial_bytes": len(body),
            "edge_rounds": self.edge.cfg.hierarchy.edge_rounds,
        }
        try:
            answer = await send_partial(self.http, self.parent, body, give_up_at=give_up)
            record["answer"] = answer.get("status")
            log.info(
                "round %d: partial of %d nodes %s by the root (%s)", er.round, part.count, answer.get("status"), why
            )
        except (PartialRefused, UplinkGaveUp) as e:
            record["answer"] = "refused" if isinstance(e, PartialRefused) else "gave_up"
            log.warning("round %d: partial of %d nodes not taken: %s", er.round, part.count, e)
        journal = self.app.get(JOURNAL)
        if journal is not None:  # counted (or never will be): its updates are of no more use on disk
            journal.drop_round(er.round)
        record["sent_after_s"] = round(time.monotonic() - started, 4)
        with self.metrics.open("a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")


async def serve_edge(
    cfg: Config,
    registry,
    ssl_context: ssl.SSLContext | None,
    stop: asyncio.Event | None = None,
    task: Task | None = None,
) -> None:
    """Serve this edge's nodes until the root says done (and the nodes were told), or SIGINT/SIGTERM."""
    from shoal.tls import client_context

    h, s = cfg.hierarchy, cfg.server
    if not h.parent_token_file:
        raise ConfigError(
            "hierarchy.parent_token_file is not set: an edge authenticates to its root with the token of "
            "`shoal server nodes add EDGE_NAME` there (and EDGE_NAME in the root's hierarchy.edge_names)"
        )
    token = read_secret(h.parent_token_file, "hierarchy.parent_token_file")
    to_root = client_context(h.parent_ca_cert or None) if h.parent.startswith("https://") else None
    edge = EdgeNodes(cfg, edge_spec(cfg, task))
    stop = stop or asyncio.Event()
    on_stop_signals(stop.set)
    app = _edge_app(edge, registry)
    if h.edge_journal and edge.buffer is None:
        journal = app[JOURNAL] = RoundJournal(Path(s.out_dir) / "edge-journal")
        for node in journal.nodes():  # named in the first poll: the root hands back their round's tasks
            edge.seen(node, time.monotonic())
    runner = web.AppRunner(
        app, access_log=None, handle_signals=False, keepalive_timeout=s.idle_timeout_s, shutdown_timeout=SHUTDOWN_S
    )
    await runner.setup()
    assert runner.server is not None
    guard = await listen(runner.server, s, ssl_context)
    log.info(
        "edge listening on %s://%s:%d, under the root %s", "https" if ssl_context else "http", s.host, s.port, h.parent
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=POLL_WAIT_S + 30)
    try:
        async with aiohttp.ClientSession(
            timeout=timeout,
            headers={"Authorization": f"Bearer {token}"},
            connector=aiohttp.TCPConnector(ssl=to_root if to_root is not None else True),
        ) as http:
            up = Uplink(edge, app, http, h.parent, to_root)
            app[RELAY].attach(http, h.parent, lambda: edge.name, up.metrics)
            loops = [asyncio.ensure_future(up.poll_root(stop)), asyncio.ensure_future(up.close_rounds(stop))]
            loops.append(asyncio.ensure_future(app[RELAY].send_sums(stop, up._changed)))
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait([*loops, stopper], return_when=asyncio.FIRST_COMPLETED)
            for t in (*loops, stopper):
                t.cancel()
            for t in done:
                if t is not stopper and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            if up.sending:  # a partial on its way finishes (bounded by the root's deadline)
                await asyncio.wait(up.sending, timeout=SHUTDOWN_S)
    finally:
        notify(app)
        guard.close()
        await runner.cleanup()
    log.info("edge stopped: %d updates taken, refused %s", edge.accepted, edge.refused)
