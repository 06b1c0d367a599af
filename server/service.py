"""The aggregator's state machine: round objects + validation + evaluation, without I/O.

No sockets, files or clocks here: time is passed in as ``now`` (monotonic seconds), and
what must outlive the process leaves as events (:class:`Record` for metrics.jsonl,
:class:`Checkpoint`, :class:`PrivacyLedger`) handed to ``emit`` in the order they must be
made durable; server/store.py writes them, server/app.py turns requests into calls of
:meth:`poll`, :meth:`submit` and :meth:`tick` and answers what they return. Round logic
lives in the objects the simulator drives, behind shoal.rounds.Rounds:
shoal.rounds.SyncRounds (``server.mode = "sync"``: selection, deadline, minimum fraction,
late results) and shoal.async_rounds.AsyncRounds (``"async"``: FedAsync / FedBuff as
``[asynchronous]`` says). Differential privacy (``[privacy]``) is one object,
server/privacy.py's ServerPrivacy: the DP strategy, Poisson selection over the registered
nodes, the accountant, the budget and the nodes' reports.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shoal import assembly
from shoal.assembly import ServerParts, make_evaluator
from shoal.async_rounds import AsyncRounds
from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.errors import ConfigError, ShoalError, SpecMismatch, UpdateRejected
from shoal.metrics import json_safe
from shoal.rounds import Rounds, RoundSummary, SyncRounds
from shoal.task import ClientData, Task
from shoal.update import Update
from shoal.wire import UpdateStream, update_fields

from .activity import Activity, console_line, process_usage
from .events import Checkpoint, Event, PrivacyLedger, Record, Restored, join_tensors, split_tensors
from .fed_eval import FederatedEvaluation
from .model_download import ModelDownload, ServedModel
from .node_reports import (
    FedVersion,
    not_held_report,
    parse_failure_report,
    spec_mismatch_detail,
)
from .privacy import ServerPrivacy
from .run_clock import RunClock
from .secure_round import SecureRound
from .staging import Staged
from .tier import Tier
from .upload_checks import StagedBlocks, UploadChecks

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Totals since the process started (Prometheus counters)."""

    accepted: int = 0
    bytes_received: int = 0
    rounds_completed: int = 0
    rounds_abandoned: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


class ServerService:
    """One aggregator: its model, rounds, nodes seen, checkpoints and metrics."""

    def __init__(
        self,
        cfg: Config,
        parts: ServerParts,
        registered: int | None = None,
        *,
        test: ClientData | None = None,
        restored: Restored | None = None,
        emit: Callable[[Event], None] | None = None,
        started_at: float | None = None,
        fed_eval: FederatedEvaluation | None = None,
        tier: Callable[[ServerService], Tier] | None = None,
        label: str = "",
        close_files: Callable[[], None] = lambda: None,
        max_body_bytes: int | None = None,
        process_usage: Callable[[], tuple[float, float]] = process_usage,
    ):
        """``parts``: the task, spec, rounds and DP state shoal.assembly built (:meth:`from_config`).
        ``registered``: the enabled nodes of the registry (N of central and distributed DP);
        when None, :func:`server.app.make_app` gives it with :meth:`bind_registry` before serving.
        ``test``: the central test set (server/store.py's ``open_service`` loads the task's).
        ``restored``: what an earlier run left. ``emit``: where events go (default: ``self.events``).
        ``started_at``: the ``now`` records' elapsed_s counts from (default: the first call's).
        ``fed_eval``: the federated evaluation (default: the config's, server/fed_eval.py).
        ``tier``: makes the tier below (server/tier.py; a root with edges: PartialIntake).
        ``label``: a federation's run id (the console's progress lines start with it).
        ``close_files``: closes what server/store.py opened for the events.
        ``max_body_bytes``: a lower cap on one request's body than the config's (a federation's).
        ``process_usage``: the process's (CPU seconds, resident MB) for each version's record."""
        if not isinstance(parts, ServerParts):
            raise TypeError(
                f"ServerService takes the parts shoal.assembly builds, not a {type(parts).__name__}: "
                "ServerService.from_config(cfg, task, ...) builds them"
            )
        self.cfg = cfg
        s = cfg.server
        self.task, self.spec, self.privacy = parts.task, parts.spec, parts.privacy
        self.rounds: Rounds = parts.rounds
        # ``sync``: the rounds the clock opens and closes (tick); None in async mode, where
        # versions advance with the updates themselves.
        self.sync: SyncRounds | None = parts.sync
        self._trainer: LocalTrainer | None = None
        self.test = test
        self.events: list[Event] = []
        self.emit: Callable[[Event], None] = emit if emit is not None else self.events.append
        restored = restored or Restored()
        self.clock = RunClock(started_at, restored.elapsed_s, process_usage)
        self.uploads = UploadChecks(cfg, self.spec)  # what an upload must be (server/upload_checks.py)
        self.update_limit = self.uploads.update_limit
        self.max_body_bytes = min(self.uploads.max_body_bytes, max_body_bytes or self.uploads.max_body_bytes)
        self.mode = s.mode
        # the nodes' evaluations of the global model (none asked where the privacy plan forbids
        # un-noised figures of their data)
        self.fed_eval = fed_eval or FederatedEvaluation(
            self.task,
            cfg.simulation.eval_every,
            s.rounds,
            self.privacy is None or self.privacy.plan.client_evaluations,
        )
        self.counters = Counters()
        self.activity = Activity()  # by node and over versions, for the dashboard (server/dashboard.py)
        self.label = label
        self.close_files = close_files
        self.last_seen: dict[str, float] = {}
        self.told_done: set[str] = set()
        self.done_at: float | None = None
        self.last_record: dict[str, Any] = {}
        self.resumed_from: Path | None = None
        self.served = ServedModel(self.spec)  # the model as nodes download it (server/model_download.py)
        self.secure_round: SecureRound | None = None  # [secure_aggregation]: the open round's protocol
        self.restored_tier: dict[str, Any] = {}  # what the tier kept in the checkpoint resumed from
        self.secure_last: dict[str, Any] = {}
        # guards of the run loop: rounds in a row without an accepted update (server.max_failed_rounds),
        # the sync task of each node whose upload was refused (not handed out again), and why the run
        # ended early (the failed rounds, or a `shoal run stop`)
        self.failed_streak = 0
        self.refused_task: dict[str, tuple[int, int]] = {}
        self.stopped: str | None = None
        if restored.checkpoint is not None:
            self._restore(*restored.checkpoint)
        if self.privacy is not None:
            if restored.ledger is not None:
                self.privacy.load_state_dict(restored.ledger)
                log.info("privacy ledger: %d rounds charged so far", self.privacy.rounds_charged)
        if registered is not None:
            self.bind_registry(registered)
        # the tier below (a root's edges): last, so that it sees the restored rounds and its saved state
        self.tier: Tier | None = tier(self) if tier is not None else None

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        task: Task | None = None,
        registered: int | None = None,
        **kwargs: Any,
    ) -> ServerService:
        """The aggregator of ``cfg`` (``task`` defaults to the config's), its parts built by
        shoal.assembly; ``kwargs`` as :meth:`__init__` takes them."""
        return cls(cfg, assembly.build(cfg, task, "server", registered=registered), registered, **kwargs)

    # --- state ---------------------------------------------------------------------

    @property
    def trainer(self) -> LocalTrainer:
        """The task's model bound for evaluation (made at the first central evaluation)."""
        if self._trainer is None:
            self._trainer = make_evaluator(self.cfg, self.task)
        return self._trainer

    @property
    def version(self) -> int:
        return self.rounds.version

    @property
    def done(self) -> bool:
        """Every round is run, or the privacy budget stopped the run."""
        return (
            self.rounds.version >= self.cfg.server.rounds
            or (self.privacy is not None and self.privacy.stopped is not None)
            or self.stopped is not None
        )

    @property
    def stop_reason(self) -> str | None:
        """Why the run ended before its last round (None if it did not)."""
        if self.stopped is not None:
            return self.stopped
        return self.privacy.stopped if self.privacy is not None else None

    def stop(self, reason: str) -> None:
        """End the run now (`shoal run stop`, the federation's SIGTERM is not this): the open
        round is dropped, the model stays at its last version, every node is told done."""
        if self.stopped is None and not self.done:
            self.stopped = reason
            if self.sync is not None and self.sync.open:
                self.sync.abort_round()
            self.secure_round = None
            log.info("run stopped at version %d: %s", self.version, reason)

    def holds_work(self, node: str) -> bool:
        """``node`` holds a task of this run whose result would still be taken: only such a node
        may open a chunked upload, and the upload ends with the task."""
        if self.done or self.stopped is not None:
            return False
        if self.sync is not None:
            return self.sync.assignment(node) is not None
        task = self.rounds.outstanding.get(node) if isinstance(self.rounds, AsyncRounds) else None
        return task is not None and self.rounds.holds_task(node, task.version)

    def upload_horizon(self, node: str, now: float) -> float | None:
        """Async rounds: the seconds left before ``node``'s open task is more than
        ``asynchronous.max_staleness`` versions old, at the recent pace of versions; an upload that
        cannot finish by then holds a body buffer for an update that will be refused. None where
        no bound is known (sync rounds, no task, no staleness bound, no version made yet)."""
        if not isinstance(self.rounds, AsyncRounds):
            return None
        task = self.rounds.outstanding.get(node)
        if task is None or self.rounds.max_staleness is None:
            return None
        return self.clock.seconds_for(self.rounds.max_staleness - (self.rounds.version - task.version) + 1, now)

    def forget(self, nodes: set[str]) -> None:
        """Revoked nodes: no longer counted as connected, so no round selects them again; the open
        round stops waiting for their results (it closes once the others reported)."""
        r = self.sync
        for n in nodes:
            self.last_seen.pop(n, None)
            if r is not None and r.open and n in r.selected and n not in r.received:
                self.refused_task[n] = (r.round, r.version)
                if self.secure_round is not None:  # its stages stop waiting for the node (a dropout)
                    self.secure_round.drop_node(n)
            if isinstance(self.rounds, AsyncRounds):  # its open task closes; a later update is not_assigned
                self.rounds.forget(n)

    @property
    def _prefix(self) -> str:
        return f"{self.label}: " if self.label else ""

    def _elapsed(self, now: float) -> float:
        """Seconds of the run's life (server/run_clock.py)."""
        return self.clock.elapsed(now)

    def finished(self, now: float) -> bool:
        """Done, and every connected node was told so (or one poll period passed)."""
        if not self.done:
            return False
        self.done_at = self.done_at if self.done_at is not None else now
        waiting = set(self.connected(now)) - self.told_done
        waiting |= self.fed_eval.waiting_on(self.version)  # told to evaluate the final model, not reported yet
        if waiting and now - self.done_at <= self.cfg.server.poll_s + 5:
            return False
        for record in self.fed_eval.finish(self._elapsed(now)):
            self.emit(Record(record))
        return True

    def connected(self, now: float) -> list[str]:
        """Nodes heard from within one long-poll period (plus 5 s of slack)."""
        horizon = self.cfg.server.poll_s + 5.0
        return sorted(n for n, t in self.last_seen.items() if now - t <= horizon)

    def seen(self, node: str, now: float) -> None:
        self._elapsed(now)  # the first call starts the clock records count from
        if node not in self.cfg.hierarchy.edge_names:  # an edge aggregator (its model download) is no node
            self.last_seen[node] = now

    def _broadcast(self) -> dict[str, torch.Tensor] | None:
        """What the algorithm sends beside the model (SCAFFOLD's server control variate), or None."""
        return (self.sync.strategy.broadcast() or None) if self.sync is not None else None

    def model_download(self) -> ModelDownload:
        """The current global model as a download (GET /v1/model, whole or by range)."""
        return self.served.download(self.version, self.rounds.global_params, self._broadcast())

    def model_body(self) -> bytes:
        """The current global model on the wire, encoded once per version."""
        return self.served.body(self.version, self.rounds.global_params, self._broadcast())

    @property
    def etag(self) -> str:
        return self.served.etag(self.version)

    # --- requests ------------------------------------------------------------------

    def check_spec(self, node_hash: str | None) -> None:
        """A node that says its model's spec hash (on every poll) must have the server's."""
        if node_hash is not None and node_hash != self.spec.hash:
            raise SpecMismatch(spec_mismatch_detail(node_hash[:64], self.spec.hash))

    def poll(self, node: str, now: float, evaluates: bool = False) -> dict[str, Any] | None:
        """The node's work if it has any now; ``{"status": "done"}`` at the end; else None.
        ``evaluates``: the node has test data; the answer then says ``"evaluate": true``
        when the server wants the federated evaluation of the version it hands out."""
        self.seen(node, now)
        if self.done:
            self.told_done.add(node)
            answer: dict[str, Any] = {"status": "done", "version": self.version}
            if self.stop_reason is not None:
                answer["reason"] = self.stop_reason
            return self.fed_eval.ask(answer, node, evaluates)
        r = self.rounds
        t = r.assignment(node, quorum=len(self.connected(now)) >= self.cfg.server.min_nodes)
        if t is None or self.refused_task.get(node) == (t.round, t.version):
            return None  # nothing to do, or this round's upload was refused: no second try
        if self.secure_round is not None and not self.secure_round.wants_task(node):
            return None
        work: dict[str, Any] = {"status": "work", "round": t.round, "version": t.version, "seed": t.seed}
        if self.update_limit > self.max_body_bytes:  # a dense update is over one request: chunks of this size
            work["upload_chunk_bytes"] = self.max_body_bytes
        left = r.time_left(now)
        if left is not None:
            work["deadline_s"] = round(left, 3)
        if self.secure_round is not None:
            work["secure_aggregation"] = self.secure_round.task_info()
        if self.privacy is not None:
            work["privacy"] = self.privacy.task_info()
        return self.fed_eval.ask(work, node, evaluates)

    # --- federated evaluation (server/fed_eval.py) -----------------------------------

    @property
    def fed(self) -> dict[int, FedVersion]:
        """The versions whose federated evaluation is open."""
        return self.fed_eval.open

    @property
    def last_fed(self) -> dict[str, Any]:
        """The last federated evaluation written."""
        return self.fed_eval.last

    def report_eval(self, node: str, body: bytes, now: float) -> dict[str, Any]:
        """Take one node's evaluation of a global version (POST /v1/eval); a ShoalError
        with nothing changed if it is refused."""
        self.seen(node, now)
        try:
            version = self.fed_eval.take(node, body, self.version)
        except ShoalError as e:
            self.refused(getattr(e, "code", "error"))
            raise
        if self.done:
            self.finished(now)  # the last report of the final version writes it at once
        else:
            self._settle_fed(now)
        return {"status": "accepted", "version": version}

    def _settle_fed(self, now: float) -> None:
        """Write the evaluations of older versions that no node can still report."""
        for record in self.fed_eval.settle(self.version, self.rounds.holds_task, self._elapsed(now)):
            self.emit(Record(record))

    def report_failure(self, node: str, body: bytes, now: float) -> dict[str, Any]:
        """A node's task failed on the node (its training diverged, so nothing was uploaded):
        counted as a refused update of that reason, and the task is not handed to the node
        again (``refused_task``, as for a refused upload). A ShoalError with nothing changed
        if the report is refused."""
        self.seen(node, now)
        try:
            round_, version, reason = parse_failure_report(body)
            held = self.rounds.round == round_ and self.rounds.holds_task(node, version)
            if not held or self.refused_task.get(node) == (round_, version):
                raise not_held_report(node, round_, version, self.rounds.round, self.rounds.version)
        except ShoalError as e:
            self.refused(getattr(e, "code", "error"))
            raise
        self.refused_task[node] = (round_, version)
        self.refused(reason)
        if self.secure_round is not None:  # its first stage stops waiting for this node's keys
            self.secure_round.failed_node(node)
        log.warning("round %d: node %s reports its task %s; it is not handed out again", round_, node, reason)
        return {"status": "noted", "round": round_, "reason": reason}

    def secure(self, node: str, now: float) -> SecureRound:
        """The open round's secure aggregation, for the /v1/secagg routes."""
        self.seen(node, now)
        if self.secure_round is None:
            what = "secure aggregation is off" if not self.cfg.secure_aggregation.enabled else "no round is open"
            raise UpdateRejected("round_closed", f"{what} (version {self.version})")
        return self.secure_round

    def submit(self, node: str, body: bytes | memoryview, now: float) -> dict[str, Any]:
        """Validate one upload and stream it into the open round; raises a ShoalError
        (WireError or UpdateRejected) with nothing changed if it is refused. A writable
        ``body`` is decoded in place (no copy); it may be reused once this returns."""

        def decoded() -> tuple[Update, dict[str, Any], None]:
            return (*self.uploads.decode(body), None)

        return self._take(node, now, decoded, len(body))

    def update_stream(self, size: int) -> UpdateStream:
        """The checker of one chunked upload of ``size`` bytes, fed as its chunks arrive."""
        return self.uploads.stream(size)

    def submit_staged(self, node: str, stream: UpdateStream, staged: Staged, now: float) -> dict[str, Any]:
        """A complete chunked upload (server/chunks.py): checked as it arrived by ``stream``, its
        bytes in ``staged``. Summed a block at a time where ``UploadChecks.streamable`` allows, else read whole
        and taken as :meth:`submit` takes a body. Refused as :meth:`submit` refuses, nothing changed."""
        if not self.uploads.streamable(stream, self.sync):
            return self.submit(node, memoryview(staged.read_all()), now)
        assert stream.header is not None and stream.dtype is not None  # streamable() checked both
        header, dtype = stream.header, stream.dtype

        def decoded() -> tuple[Update, dict[str, Any], Iterator[torch.Tensor]]:
            fields = update_fields(header, self.cfg.server.max_examples)
            return Update(torch.empty(0), **fields), header, staged.blocks(stream.data_start, dtype)

        return self._take(node, now, decoded, stream.size)

    def upload_refused(self, node: str, e: Exception, now: float) -> None:
        """Count a refused upload (here or as its chunks arrived) and, where its content was refused,
        keep the node's task from being handed out again."""
        self.refused(getattr(e, "code", "error"))
        self.activity.refused(node, getattr(e, "code", "error"), str(e), now)
        held = self.sync.assignment(node) if self.sync is not None else None
        # The update's content was refused (non-finite, out of range, too large...): retraining
        # the same task gives the same refusal, so it is not handed out again. A closed round or a
        # duplicate is no verdict on the training, and a malformed request may not be the node's
        # (bad input changes no state): those leave the task with the node.
        if held is not None and getattr(e, "code", "") not in ("round_closed", "duplicate", "malformed"):
            self.refused_task[node] = (held.round, held.version)

    def _take(
        self,
        node: str,
        now: float,
        decoded: Callable[[], tuple[Update, dict[str, Any], Iterator[torch.Tensor] | None]],
        nbytes: int,
    ) -> dict[str, Any]:
        self.seen(node, now)
        try:
            update, header, blocks = decoded()
            r = self.rounds
            if self.cfg.secure_aggregation.enabled:
                raise UpdateRejected(
                    "secure_round",
                    "rounds are securely aggregated: send masked input through "
                    "/v1/secagg (docs/protocol.md), not a plain update",
                )
            if self.done:
                raise UpdateRejected("done", f"training is complete at version {r.version}; no more updates")
            if update.base_version > r.version:
                raise UpdateRejected(
                    "unknown_version", f"base version {update.base_version} is newer than the server's {r.version}"
                )
            r.check_round(node, header.get("round"))
            update.sender = node  # the authenticated identity, not what the body claims
            self.uploads.check_algorithm_fields(update)
            report = None
            if self.privacy is not None and self.privacy.plan.dp_sgd:  # checked before anything changes
                self.privacy.check_local_upload(update.num_examples, update.metrics)
                report = self.privacy.upload_report(header.get("privacy"))
            if blocks is None:
                advanced = r.submit(node, update)
            else:
                assert self.sync is not None  # streamable() allows blocks in sync rounds only
                advanced = self._submit_blocks(self.sync, node, update, blocks, now)
        except Exception as e:
            self.upload_refused(node, e, now)
            raise
        if report is not None and self.privacy is not None:
            self.privacy.take_report(node, report)
        self.counters.accepted += 1
        self.counters.bytes_received += nbytes
        self.activity.accepted(node, nbytes, self.rounds.round, now)
        if advanced:  # async: the update completed a new version
            self.new_version(self.rounds.version_fields(), now)
        elif self.fed:
            self._settle_fed(now)  # this node's task from an older version is over
        return {"status": "accepted", "round": self.rounds.round, "version": self.version}

    def _submit_blocks(
        self, r: SyncRounds, node: str, update: Update, blocks: Iterator[torch.Tensor], now: float
    ) -> bool:
        """Sum a staged update into the open round; should reading it back fail midway (the disk),
        the round's sum is partial: the round is dropped (model and version unchanged) and the
        error raised, so nothing half-applied survives."""
        pieces = StagedBlocks(blocks)
        try:
            return r.submit(node, update, blocks=pieces)
        except Exception:
            if pieces.started and r.open:
                log.error("round %d: a staged update failed while it was being summed; the round is dropped", r.round)
                r.abort_round()
                self._round_failed(r.round, now)
            raise

    def refused(self, code: str) -> None:
        """Count an upload refused with error ``code`` (here or by the transport)."""
        self.counters.rejected[code] = self.counters.rejected.get(code, 0) + 1

    # --- the clock -----------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """Open or close a sync round if it is time; True when something changed."""
        r = self.sync
        if self.done or r is None:  # async: versions advance in submit, not on the clock
            return False
        if not r.open:
            return self._open_round(r, now)
        if self.secure_round is not None:  # the protocol's stages decide when the round closes
            changed = self.secure_round.tick(now)
            if not self.secure_round.over:
                return changed
            secure, self.secure_round = self.secure_round, None
            self.secure_last = secure.status()
            summary = secure.close(r)
            if summary is None:  # aborted: model and version unchanged, the next round runs (charged all the same)
                self._round_failed(r.round, now, {"round": r.round, "version": r.version, "aborted": secure.aborted})
                return True
        elif not r.should_close(now) and not self._all_answered(r):
            return False
        else:
            summary = r.finish_round()
        self.activity.round_closed(summary.num_selected, summary.num_results, summary.num_late)
        if summary.failed:
            log.warning(
                "round %d failed with %d of %d results (min_fraction %.2f); model unchanged",
                *(r.round, summary.num_results, summary.num_selected, self.cfg.server.min_fraction),
            )
            failed = {"round": r.round, "version": r.version, "failed": True, "num_results": summary.num_results}
            self._round_failed(r.round, now, failed)
            return True
        if summary.num_results < summary.num_selected:
            log.info(
                "round %d: deadline, closed with %d of %d results", r.round, summary.num_results, summary.num_selected
            )
        fields = ("round", "train_loss", "num_results", "num_examples", "num_late")
        self.new_version({k: getattr(summary, k) for k in fields}, now, summary)
        return True

    def _open_round(self, r: SyncRounds, now: float) -> bool:
        """Select the round's nodes once enough are connected (and the budget allows a round)."""
        if self.privacy is not None and not self.privacy.allows_next_round():
            stopped = {"stopped": self.privacy.stopped, "epsilon_next": self.privacy.next_epsilon}
            self._privacy_event(self.privacy, {"round": r.round, "version": r.version, **stopped}, now)
            return True  # done now: every waiting node is told so
        avail = self.connected(now)
        if self.tier is not None:
            avail = self.tier.available(avail, now)
        sa = self.cfg.secure_aggregation  # a secure round of fewer than min_inputs nodes would only abort
        if len(avail) < max(self.cfg.server.min_nodes, sa.min_inputs if sa.enabled else 1):
            return False
        if self.privacy is not None and not self.privacy.bound:
            raise ConfigError("privacy: the server does not know N, its registered nodes (bind_registry)")
        tasks = r.start_round(avail, now)
        log.info(
            "%sround %d (of %d versions): %d of %d nodes selected, at version %d",
            *(self._prefix, r.round, self.cfg.server.rounds, len(tasks), len(avail), r.version),
        )
        if self.privacy is not None:
            self.privacy.round_started(sorted(r.selected), r.round)
            self._save_privacy(self.privacy)  # charged before anything of the round is released
        if sa.enabled and tasks:  # nobody selected: the round closes at once
            self.secure_round = SecureRound(self.cfg, r, self.spec.numel, now, self.privacy)
        return True

    def _all_answered(self, r: SyncRounds) -> bool:
        """Every selected node sent its update or had it refused: waiting for the deadline gains nothing."""
        if not r.open or not r.selected:
            return False
        refused = {n for n, t in self.refused_task.items() if t == (r.round, r.version)}
        return bool(refused) and set(r.selected) <= r.received | refused

    def _round_failed(self, round_: int, now: float, privacy_fields: dict[str, Any] | None = None) -> None:
        """A round ended without a new version; under DP, a record of it (``privacy_fields``: the
        round was charged all the same). After server.max_failed_rounds in a row the run ends."""
        self.counters.rounds_abandoned += 1
        self.failed_streak += 1
        limit = self.cfg.server.max_failed_rounds
        if limit and self.failed_streak >= limit and self.stopped is None:
            self.stopped = (
                f"{self.failed_streak} rounds in a row without an accepted update (server.max_failed_rounds = "
                f"{limit}); updates refused so far: {dict(self.counters.rejected)}"
            )
            log.warning("round %d failed; the run ends: %s", round_, self.stopped)
            stop = {"round": round_, "version": self.version, "stopped": self.stopped, "elapsed_s": self._elapsed(now)}
            self.emit(Record(json_safe(self.privacy.released(stop) if self.privacy is not None else stop)))
        if self.privacy is not None and privacy_fields is not None:
            self._privacy_event(self.privacy, privacy_fields, now)

    def new_version(self, fields: dict[str, Any], now: float, summary: RoundSummary | None = None) -> None:
        """A new global version: evaluate, checkpoint, then log (the simulator's record shape;
        under DP what privacy.release lets out, with ``summary``'s noisy figures when noised). Also
        the way in for a round closed elsewhere (server/edge/intake.py: an async root's partials)."""
        self.counters.rounds_completed += 1
        self.failed_streak = 0
        record: dict[str, Any] = {"round": self.rounds.round, "version": self.version}
        if self.test is not None:
            ev = self.trainer.evaluate_data(self.rounds.global_params, self.test)
            record.update({f"test_{k}": v for k, v in ev.items() if k != "num_examples"})
        record.update(fields)
        if self.tier is not None:
            record.update(self.tier.figures(int(record["round"])))
        record.update(self.clock.version_figures(now))
        record["elapsed_s"] = elapsed = self._elapsed(now)
        if self.privacy is not None:  # under DP without the round's timing (the operator's log keeps it)
            record = self.privacy.released(record, summary)
        self.last_record = json_safe(record)
        c = self.counters
        self.activity.snapshot(int(record["round"]), self.version, c.accepted, sum(c.rejected.values()), elapsed)
        self.emit(self._checkpoint())  # first: a crash between the two loses a log line, never a version
        if self.privacy is not None:
            self._save_privacy(self.privacy)  # the adaptive clip norm and the nodes' reports of this version
        self._settle_fed(now)  # the nodes evaluated older versions before training on them
        self.emit(Record(self.last_record))
        log.info("%s%s", self._prefix, console_line({**self.last_record, "elapsed_s": elapsed}, self.cfg.server.rounds))
        log.debug("version %d: %s", self.version, json.dumps(self.last_record))

    # --- privacy ---------------------------------------------------------------------

    def bind_registry(self, registered: int) -> None:
        """N for central and distributed DP: the enabled nodes of the registry (server/privacy.py
        says why that is the population the accountant needs). ConfigError if it cannot be sound."""
        if self.privacy is not None and self.sync is not None:
            self.privacy.bind(registered, self.sync)
        if self.sync is not None and registered > 0:
            self.sync.strategy.bind_population(registered)  # FedDyn's and SCAFFOLD's N

    def _privacy_event(self, dp: ServerPrivacy, fields: dict[str, Any], now: float) -> None:
        """The record of a round without a new version that changed the privacy picture (charged)."""
        self.emit(Record(json_safe(dp.released({**fields, "elapsed_s": self._elapsed(now)}))))
        self._save_privacy(dp)

    def _save_privacy(self, dp: ServerPrivacy) -> None:
        self.emit(PrivacyLedger(dp.state_dict()))

    # --- checkpoints ---------------------------------------------------------------

    def _checkpoint(self) -> Checkpoint:
        tensors: dict[str, torch.Tensor] = {}
        state = {
            "mode": self.mode,
            "version": self.version,
            "round": self.rounds.round,
            "spec_hash": self.spec.hash,
            "last_record": self.last_record,
            "elapsed_s": self.clock.latest,  # a DP run's records do not carry it (server/store.py reads it)
            "last_fed": self.last_fed,
            "rounds": split_tensors(self.rounds.state_dict(), "rounds", tensors),
            "tier": self.tier.state() if self.tier is not None else {},
        }
        return Checkpoint(self.version, tensors, state)

    def _restore(self, path: Path, tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
        if state.get("spec_hash") != self.spec.hash or state.get("mode") != self.mode:
            raise ConfigError(
                f"checkpoint {path} is of a {state.get('mode')!r} server with model spec {state.get('spec_hash')!r}; "
                f"this config is {self.mode!r} with {self.spec.hash!r}: use the config it was made with, "
                "or another server.checkpoint_dir"
            )
        self.rounds.load_state_dict(join_tensors(state["rounds"], tensors))
        self.last_record = state.get("last_record", {})
        self.fed_eval.last = state.get("last_fed", {})
        tier = state.get("tier", {})
        self.restored_tier = dict(tier) if isinstance(tier, dict) else {}
        self.resumed_from = path
        log.info("resumed from %s: version %d, round %d", path, self.version, self.rounds.round)

    # --- observability -------------------------------------------------------------

    def status(self, now: float) -> dict[str, Any]:
        r = self.rounds
        return {
            "mode": self.mode,
            "round": r.round,
            "version": r.version,
            "rounds_target": self.cfg.server.rounds,
            "done": self.done,
            **({"stopped": self.stop_reason} if self.stop_reason is not None else {}),
            **r.status_fields(),
            "connected_nodes": self.connected(now),
            "last_metrics": self.last_record,
            "last_federated": self.last_fed,
            "federated_open": {
                str(v): {"asked": len(f.asked), "reported": len(f.reported)} for v, f in sorted(self.fed.items())
            },
            "spec_hash": self.spec.hash,
            "num_parameters": self.spec.numel,
            "updates_accepted": self.counters.accepted,
            "updates_rejected": dict(self.counters.rejected),
            **(
                {"secure_aggregation": self.secure_round.status() if self.secure_round else self.secure_last}
                if self.cfg.secure_aggregation.enabled
                else {}
            ),
            **({"privacy": self.privacy.status()} if self.privacy is not None else {}),
            **({"hierarchy": self.tier.status(now)} if self.tier is not None else {}),
        }
