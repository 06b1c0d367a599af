"""A federation that stays up: one server hosting many runs, each its own ServerService.

A run is a task reference and the submitter's config (mode, rounds, training settings,
DP, secure aggregation, compression, robust rule). :class:`Federation` keeps the runs
table (server/federation/runs_db.py), starts queued runs while fewer than ``federation.max_runs``
train, drives each run's clock, ends a run when its service is finished (every round
run, its privacy budget spent, ``server.max_failed_rounds`` failed rounds in a row, or
``shoal run stop``) and, after a restart, reopens every run that was running from its
checkpoints. Each run's protocol state stays in its own ServerService (sans-I/O); its
events go to its own folder through server/store.py and its metrics lines also to the
database, so ``shoal run logs`` can follow them. server/app.py only moves messages.

No code travels: a run names a task its operator registered (server/task_registry.py: the
built-ins, ``federation.tasks``, `shoal server tasks add`), pinned by the SHA-256 of its source
file; the request's name is only looked up there. The task is loaded with the run's arguments in
a worker process before the run is queued (server/task_check.py), and the nodes run only tasks
their operator installed with the same hash (client/daemon.py). A run's config below the
federation's floors (shoal/floors.py) is refused at submission; each node holds its own.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.config import Config, ServerConfig, config_from_dict
from shoal.errors import ConfigError, ShoalError
from shoal.floors import below_floor
from shoal.tensor_file import save_file

from ..events import Event, Record
from ..service import ServerService
from ..store import open_service
from ..task_check import TaskChecker
from ..task_registry import BUILTIN, REGISTRY_FILE, RunError, TaskEntry, TaskRegistry, task_sha256
from .bundle_store import BundleStore, bundle_app, is_bundle
from .release import released_file, researcher_line, researcher_view, withholds
from .run_health import RunWatch, node_health
from .runs_db import ACTIVE, RunRow, RunsDB

__all__ = ["BUILTIN", "Federation", "RunError", "Submission", "task_sha256"]

log = logging.getLogger(__name__)

#: The [server] keys a run sets (its rounds); every other [server] key is the federation's
#: (listen, TLS, limits, and the operator's guards such as server.max_failed_rounds).
RUN_SERVER_KEYS = frozenset(
    {
        "mode",
        "rounds",
        "clients_per_round",
        "fraction",
        "min_nodes",
        "deadline_s",
        "min_fraction",
        "poll_s",
        "eval",
        "max_examples",
        "max_delta_abs",
    }
)
SERVER_KEYS = frozenset(f.name for f in dataclasses.fields(ServerConfig))
#: Tables a run may not set: they are the federation's or the simulator's.
NOT_A_RUNS = frozenset({"federation", "heterogeneity", "gossip", "attack"})
#: Keys of a run's tables that name files on the server: the federation's, never a request's.
NOT_A_RUNS_KEYS = {
    "data": ("dir",),
    "algorithm": ("state_dir",),
    "secure_aggregation": ("keys_file", "identity_key"),
    "hierarchy": ("parent", "parent_token_file", "parent_ca_cert"),
}
#: The [output] keys a run sets (TensorBoard files beside its metrics.jsonl; the default is the federation's).
RUN_OUTPUT_KEYS = frozenset({"tensorboard"})
MAX_RUN_CONFIG_BYTES = 64 * 1024
_RUN_ID = re.compile(r"run-[0-9]{1,9}")
#: A node's answer to a run: it takes part, it refuses (its operator's policy), or the task's own
#: code raised on it (its model, loss, data or metrics: client/node.py) and it left the run.
ANSWERS = ("joined", "refused", "failed")
ADMIN = "admin"  # the submitter name of the admin token; a researcher may not take it


def check_run_config(raw: Any) -> dict[str, Any]:
    """The submitter's config (a TOML document as JSON): only tables and [server] keys a run
    may set; RunError naming the key otherwise."""
    if not isinstance(raw, dict):
        raise RunError("bad_config", "the run's config must be a table of sections ([train], [server], ...)")
    for name, table in raw.items():
        if name in NOT_A_RUNS:
            raise RunError("bad_config", f"[{name}] is not a run's to set (it belongs to the federation or simulator)")
        if not isinstance(table, dict):
            raise RunError("bad_config", f"{str(name)[:40]} must be a table")
    output = sorted(set(raw.get("output", {})) - RUN_OUTPUT_KEYS)
    if output:
        raise RunError("bad_config", f"output.{output[0][:40]} is the federation's; a run sets output.tensorboard")
    server = raw.get("server", {})
    other = sorted(set(server) - RUN_SERVER_KEYS)
    if other and other[0] not in SERVER_KEYS:  # a typo, not a federation's key
        near = difflib.get_close_matches(other[0], sorted(RUN_SERVER_KEYS), n=1)
        raise RunError(
            "bad_config",
            f"unknown key 'server.{other[0][:40]}'"
            + (f" (did you mean server.{near[0]}?)" if near else "")
            + f"; a run sets server.{{{', '.join(sorted(RUN_SERVER_KEYS))}}}",
        )
    if other:
        raise RunError(
            "bad_config",
            f"server.{other[0][:40]} is the federation's, not a run's; "
            f"a run sets server.{{{', '.join(sorted(RUN_SERVER_KEYS))}}}",
        )
    if "app" in raw.get("task", {}):
        raise RunError("bad_config", "task.app: name the task with --task, not in the run's config")
    for table, keys in NOT_A_RUNS_KEYS.items():
        for key in keys:
            if key in raw.get(table, {}):
                raise RunError("bad_config", f"{table}.{key} names a file on the server: the federation's, not a run's")
    return raw


def run_config(fed: Config, raw: dict[str, Any], ref: str, run_dir: Path) -> Config:
    """A run's whole config: the federation's [server] (listen, TLS, limits), the run's
    round keys and sections, its task (the operator's reference of the registered name), its
    own checkpoint and metrics folders, and the federation's files (data.dir, the keys file)."""
    server = {k: v for k, v in fed.server.__dict__.items() if k not in RUN_SERVER_KEYS}
    server.update(raw.get("server", {}))
    server.update(checkpoint_dir=str(run_dir / "checkpoints"), out_dir=str(run_dir))
    output = {"tensorboard": fed.output.tensorboard, **raw.get("output", {})}
    data = {**copy.deepcopy(raw), "server": server, "output": output}
    named = data.get("hierarchy", {}).get("edge_names") if isinstance(data.get("hierarchy"), dict) else None
    if named is not None and named != list(fed.hierarchy.edge_names):  # an edge speaks for nodes: the operator's
        raise RunError("bad_config", "hierarchy.edge_names is the federation operator's, not a run's: leave it out")
    if isinstance(data.get("hierarchy", {}), dict):
        data["hierarchy"] = {**data.get("hierarchy", {}), "edge_names": list(fed.hierarchy.edge_names)}
    data["data"] = {**data.get("data", {}), "dir": fed.data.dir}
    if fed.secure_aggregation.keys_file:
        data["secure_aggregation"] = {
            **data.get("secure_aggregation", {}),
            "keys_file": fed.secure_aggregation.keys_file,
        }
    if ref != BUILTIN:
        data["task"] = {**data.get("task", {}), "app": ref}
    try:
        return config_from_dict(data).validate()
    except ConfigError as e:
        raise RunError("bad_config", f"the run's config: {e}") from None


@dataclass
class Submission:
    """A run being submitted: checked in steps (the cheap ones in the event loop, the task in a
    worker), stored only once every step passed."""

    who: str
    entry: TaskEntry
    raw: dict[str, Any]
    cfg: Config


class Federation:
    """The runs of one long-running server: submitted, queued, running, ended."""

    def __init__(self, cfg: Config, db: RunsDB, registered: Callable[[], int] = lambda: 0):
        """``registered``: how many nodes are enabled now (N of a run's central/distributed DP)."""
        self.cfg = cfg
        self.db = db
        self.dir = Path(cfg.federation.dir)
        self.registered = registered
        self.tasks = TaskRegistry(self.dir / REGISTRY_FILE, cfg.federation.tasks)
        self.bundles = BundleStore(
            self.dir / "bundles", cfg.federation.max_bundle_mb << 20, cfg.federation.max_parameters
        )
        self.checker = TaskChecker(cfg.federation.task_check_mb, cfg.federation.task_check_s)
        if any(not e.builtin for e in self.tasks.entries().values()):
            self.checker.warm()  # the worker imports torch meanwhile: the first submission does not wait for it
        self.active: dict[str, ServerService] = {}
        self.user_stopped: set[str] = set()
        self.revoked: set[str] = set()
        self._failing: dict[str, float] = {}  # run -> when its clock's failure was last logged
        self.watch: dict[str, RunWatch] = {}  # run -> its stall clock (server/federation/run_health.py)
        self.waiting: dict[str, str] = {}  # run -> what it waits for (shown in its status)
        self._final: dict[str, dict[str, int]] = {}  # ended run -> its last round and version
        for row in db.runs(("running",)):  # a restart: every run that was running goes on
            self._open(row, resume=True)

    def close(self) -> None:
        """The task check's worker ends with the server."""
        self.checker.close()

    # --- submitting and following runs --------------------------------------------------------

    def submit(self, task: Any, raw: Any, who: str, now: float) -> dict[str, Any]:
        """Queue a run in one call (the steps below, the worker's included, in this thread)."""
        sub = self.prepare(task, raw, who)
        self.check_task(sub)
        return self.enqueue(sub)

    def prepare(self, task: Any, raw: Any, who: str) -> Submission:
        """The cheap checks of a submission, in the event loop: the task is a registered name (only
        looked up: nothing a request names is opened or imported), the config a run's and within
        the federation's floors. RunError (400, one line, logged with ``who``) otherwise."""
        try:
            entry = self._entry(task, who)
            raw = check_run_config(raw)
            if len(json.dumps(raw)) > MAX_RUN_CONFIG_BYTES:
                raise RunError("too_large", f"the run's config is over {MAX_RUN_CONFIG_BYTES} bytes", 413)
            queued = self.db.count("queued")
            if queued >= self.cfg.federation.max_queued:
                raise RunError("queue_full", f"{queued} runs already wait (federation.max_queued); try later", 429)
            cfg = run_config(self.cfg, raw, self._app(entry), self.dir / "checking")
            floor = below_floor(self.cfg.federation, cfg, "the federation's")
            if floor is not None:
                raise RunError("below_floor", floor)
        except RunError as e:
            self._refused(who, task, e)
            raise
        return Submission(who, entry, raw, cfg)

    def check_task(self, sub: Submission) -> None:
        """The slow checks (call it in a thread): the registered source still has its pin, and the
        task loads with the run's arguments and builds its model: in the worker process
        (server/task_check.py) for every task that takes arguments, here for ``builtin`` (its
        [model] + [data] are fixed choices). RunError (logged) otherwise."""
        try:
            if sub.entry.source != "bundle":
                self.tasks.verify(sub.entry)
            if sub.entry.ref == BUILTIN or sub.entry.source == "bundle":  # fixed choices, or a bundle's model as data
                try:
                    task = (
                        self._task(sub.cfg) if sub.entry.ref == BUILTIN else self.bundles.task(sub.entry.ref, sub.who)
                    )
                    svc = ServerService.from_config(sub.cfg, task, self.registered())
                except ShoalError as e:
                    raise RunError("bad_task", f"the run cannot start: {e}") from None
                parameters: int | None = svc.spec.numel
            else:
                parameters, why = self.checker.check(sub.cfg.to_dict(), self.registered())
                if why is not None:
                    raise RunError("bad_task", f"the run cannot start: {why}")
            floor = below_floor(self.cfg.federation, sub.cfg, "the federation's", parameters)
            if floor is not None:
                raise RunError("below_floor", floor)
        except RunError as e:
            self._refused(sub.who, sub.entry.name, e)
            raise

    def enqueue(self, sub: Submission) -> dict[str, Any]:
        """Store the checked run as queued (in the event loop: run ids are handed out in order)."""
        queued = self.db.count("queued")
        if queued >= self.cfg.federation.max_queued:
            raise RunError("queue_full", f"{queued} runs already wait (federation.max_queued); try later", 429)
        run_id = f"run-{self.db.count() + 1}"
        entry = sub.entry
        self.db.add(run_id, entry.name, entry.sha256, sub.raw, sub.who, time.time())
        log.info(
            "%s submitted by %s: task %s (sha256 %s), %s",
            run_id,
            sub.who,
            entry.name,
            entry.sha256[:12],
            json.dumps(sub.raw),
        )
        self.event(run_id, "server", f"submitted by {sub.who}: task {entry.name} (sha256 {entry.sha256[:12]})")
        return {"run": run_id, "status": "queued", "task_sha256": entry.sha256}

    def _entry(self, task: Any, who: str) -> TaskEntry:
        """A run's task: a signed bundle ``who`` uploaded (server/federation/bundle_store.py), or a registered task."""
        return self.bundles.resolve(task, who) if is_bundle(task) else self.tasks.resolve(task)

    @staticmethod
    def _app(entry: TaskEntry) -> str:
        """task.app of a run's config here: the operator's reference, or a bundle's unloadable name."""
        return bundle_app(entry.ref) if entry.source == "bundle" else entry.ref

    def bundles_in_use(self) -> set[str]:
        """The bundles queued or running runs name (kept when a submitter's store makes room)."""
        return {r.task for r in self.db.runs(ACTIVE) if is_bundle(r.task)}

    def upload_bundle(self, who: str, blob: bytes, in_use: set[str]) -> dict[str, Any]:
        """Keep a researcher's bundle (in a thread): its format, limits and hashes checked, never imported."""
        return self.bundles.add(who, blob, in_use)

    def bundle(self, run_id: str, node: str) -> bytes:
        """The signed bundle of a running run, for a node to verify itself (RunError 404 otherwise;
        403 for a node that refused the run or failed in it)."""
        row, svc = self._row(run_id), self.active.get(run_id)
        if svc is None or not is_bundle(row.task):
            raise RunError("no_bundle", f"{run_id} is not running a bundle's task", 404)
        if self.db.answer_of(run_id, node) in ("refused", "failed"):
            raise RunError("refused_run", f"node {node} left {run_id}", 403)
        return self.bundles.blob(row.task, row.submitted_by)

    @staticmethod
    def _refused(who: str, task: Any, e: RunError) -> None:
        log.warning("a run from %s refused (task %.80r): %s: %s", who, task, e.code, e)

    def may_see(self, run_id: str, who: str) -> RunRow:
        """The run, if ``who`` may see, follow, stop or pull it: the admin any run, a researcher
        their own (RunError 403 for another's, 404 for none)."""
        row = self._row(run_id)
        if who != ADMIN and row.submitted_by != who:
            raise RunError("not_your_run", f"{row.id} was submitted by another researcher", 403)
        return row

    def stop(self, run_id: str, who: str) -> dict[str, Any]:
        row = self.may_see(run_id, who)
        if row.status not in ACTIVE:
            return {"run": run_id, "status": row.status}
        reason = f"stopped by {who}"
        svc = self.active.get(run_id)
        self.event(run_id, "server", reason)
        if svc is not None:
            self.user_stopped.add(run_id)
            svc.stop(reason)
        else:
            self.db.set_status(run_id, "stopped", reason, time.time())
        return {"run": run_id, "status": "stopping" if svc is not None else "stopped", "reason": reason}

    def runs(self, who: str = "admin") -> list[dict[str, Any]]:
        """Every run for the admin; a researcher's own runs for a researcher."""
        return [self._summary(r) for r in self.db.runs() if who == ADMIN or r.submitted_by == who]

    def status(self, run_id: str, now: float, who: str = "admin") -> dict[str, Any]:
        """The run's status as ``who`` may see it (server/federation/release.py: a researcher's view of a DP
        run carries only what its accountant covers)."""
        row = self.may_see(run_id, who)
        out = self._summary(row)
        out["config"] = row.config
        out.update(self.health(run_id, now))
        svc = self.active.get(run_id)
        if svc is not None:
            out["service"] = svc.status(now)
        return out if who == ADMIN else researcher_view(out, self._run_cfg(row))

    def health(self, run_id: str, now: float) -> dict[str, Any]:
        """The run's nodes (answer, state, last seen, reason) and what a waiting run waits for: as
        `shoal run status` shows them to the admin (and the dashboard, shoal/web/dashboard.py)."""
        svc = self.active.get(run_id)
        if svc is None:
            return {"nodes": self.db.answers(run_id)}
        out: dict[str, Any] = {"nodes": self._health(run_id, svc, now)}
        if run_id in self.waiting:
            out["waiting_for"] = self.waiting[run_id]
        return out

    def event(self, run_id: str, source: str, line: str) -> None:
        """One line of the run's log (`shoal run logs`): the server's events and its nodes' answers."""
        self.db.add_event(run_id, source, line[:2000], time.time())

    def events(self, run_id: str, after: int, who: str = "admin") -> list[dict[str, Any]]:
        """The run's log lines as ``who`` may see them: a researcher of a DP run gets the server's
        lines only (a node's line can say which round selected it: server/federation/release.py)."""
        row = self.may_see(run_id, who)
        lines = self.db.events(run_id, after)
        cfg = None if who == ADMIN else self._run_cfg(row)
        if who == ADMIN or (cfg is not None and not withholds(cfg)):
            return lines
        return [e for e in lines if e.get("source") == "server"]

    def metrics(self, run_id: str, after: int, who: str = "admin") -> list[tuple[int, dict[str, Any]]]:
        row = self.may_see(run_id, who)
        lines = self.db.metrics(run_id, after)
        if who == ADMIN:
            return lines
        cfg = self._run_cfg(row)
        return [(n, researcher_line(line, cfg)) for n, line in lines]

    def file(self, run_id: str, name: str, who: str = "admin") -> Path | bytes:
        """One of the run's results for `shoal run pull`: the file, or for a researcher of a DP
        run its released part (metrics lines and summary as server/federation/release.py lets out)."""
        row = self.may_see(run_id, who)
        if name not in PULLED:
            raise RunError("not_found", f"a run's files are {', '.join(PULLED)}", 404)
        path = self.dir / run_id / name
        if not path.is_file():
            raise RunError("not_found", f"{run_id} has no {name} yet (it is written when the run ends)", 404)
        cfg = self._run_cfg(row)
        if who == ADMIN or cfg is None or not withholds(cfg) or name == "model.safetensors":
            return path
        return released_file(name, path.read_bytes(), cfg)

    def _run_cfg(self, row: RunRow) -> Config | None:
        """The run's config as it ran (None if it no longer builds: then nothing is let out under
        the assumption of no privacy, see release.py)."""
        try:
            return run_config(self.cfg, row.config, "registered:task", self.dir / row.id)  # never loaded
        except RunError:
            return None

    def _summary(self, row: RunRow) -> dict[str, Any]:
        svc = self.active.get(row.id)
        out: dict[str, Any] = {"run": row.id, "task": row.task, "status": row.status, "submitted_by": row.submitted_by}
        if row.reason:
            out["reason"] = row.reason
        if svc is not None:
            out.update(version=svc.version, round=svc.rounds.round, rounds_target=svc.cfg.server.rounds)
        elif row.status not in ACTIVE:
            out.update(self.final(row))
        return out

    def final(self, row: RunRow) -> dict[str, Any]:
        """An ended run's last round and version (its summary.json, read once), and its target."""
        if row.id not in self._final:
            try:
                summary = json.loads((self.dir / row.id / "summary.json").read_text())
                self._final[row.id] = {"version": int(summary["version"]), "round": int(summary["rounds"])}
            except (OSError, ValueError, KeyError, TypeError):  # it could not start: no summary
                return {}
        rounds = row.config.get("server", {}).get("rounds", ServerConfig().rounds)
        return {**self._final[row.id], "rounds_target": rounds}

    def _row(self, run_id: str) -> RunRow:
        row = self.db.get(run_id) if isinstance(run_id, str) and _RUN_ID.fullmatch(run_id) else None
        if row is None:
            raise RunError("unknown_run", f"no run {run_id[:40]!r} (see `shoal run list`)", 404)
        return row

    # --- what nodes see ---------------------------------------------------------------------

    def offers(self, node: str) -> list[dict[str, Any]]:
        """The running runs ``node`` has not refused: task, its pin and the run's config."""
        out = []
        for run_id, svc in self.active.items():
            if svc.done:
                continue
            row = self.db.get(run_id)
            answer = self.db.answers(run_id).get(node, {})
            if row is None or (answer.get("answer") in ("refused", "failed") and not answer.get("temporary")):
                continue
            out.append(self._offer(row, svc))
        return out

    def task_fields(self, run_id: str) -> dict[str, Any]:
        """What travels with each of a run's tasks: the run, its task and pin and its config, so a
        node checks every task against its operator's limits, not only the offer it joined."""
        svc, row = self.active.get(run_id), self.db.get(run_id)
        return self._offer(row, svc) if svc is not None and row is not None else {}

    @staticmethod
    def _offer(row: RunRow, svc: ServerService) -> dict[str, Any]:
        config = {**row.config, "server": {**row.config.get("server", {}), "poll_s": svc.cfg.server.poll_s}}
        return {"run": row.id, "task": row.task, "task_sha256": row.task_sha256, "config": config}

    def answer(self, run_id: str, node: str, body: Any) -> dict[str, Any]:
        """A node joins a run, or refuses it with its reason (its operator's policy). A refusal with
        ``"temporary": true`` (say, the node's local-DP ledger for that data is busy with another run)
        keeps the run offered to the node, which may join later; any other refusal is for good."""
        row = self._row(run_id)
        if (
            not isinstance(body, dict)
            or body.get("answer") not in ANSWERS
            or set(body) - {"answer", "reason", "temporary"}
        ):
            raise RunError(
                "malformed",
                'send {"answer": "joined"}, {"answer": "refused", "reason": "...", "temporary": false} '
                'or {"answer": "failed", "reason": "..."}',
            )
        reason, temporary = body.get("reason", ""), body.get("temporary", False)
        if not isinstance(reason, str) or len(reason) > 500 or not reason.isprintable():
            raise RunError("malformed", "reason must be printable text of at most 500 characters")
        if not isinstance(temporary, bool) or (temporary and body["answer"] != "refused"):
            raise RunError("malformed", "temporary is true or false, and only a refusal is temporary")
        if body["answer"] != "joined" and not reason:
            raise RunError("malformed", f"answer {body['answer']!r} needs its reason")
        stored = "deferred" if temporary else body["answer"]
        before = self.db.answers(row.id).get(node, {})
        if (before.get("answer"), before.get("reason", "")) != (body["answer"], reason):  # changes only
            what = "refused for now" if temporary else body["answer"]
            self.event(row.id, node, f"{what}: {reason}" if reason else what)
        self.db.answer(row.id, node, stored, reason, time.time())
        svc = self.active.get(run_id)
        if stored in ("refused", "failed") and svc is not None:  # it left the run: no round selects or waits for it
            svc.forget({node})
        if body["answer"] == "failed":
            log.warning("%s: the task failed on node %s: %s", run_id, node, reason)
        elif body["answer"] == "refused":
            log.info("%s: node %s refused it%s: %s", run_id, node, " for now" if temporary else "", reason)
        return {"run": run_id, "answer": body["answer"], **({"temporary": True} if temporary else {})}

    def service(self, run_id: str) -> ServerService | None:
        """The run's protocol state while it trains; None once it ended (RunError if unknown)."""
        svc = self.active.get(run_id)
        if svc is None:
            self._row(run_id)
        return svc

    def ended(self, run_id: str) -> dict[str, Any]:
        """What a node polling an ended run is told: its status and why it ended."""
        row = self._row(run_id)
        return {"run_status": row.status, **({"reason": row.reason} if row.reason else {})}

    @property
    def max_runs(self) -> int:
        return self.cfg.federation.max_runs

    def forget(self, revoked: set[str]) -> None:
        """Revoked nodes: no run selects them again."""
        self.revoked = revoked
        for svc in self.active.values():
            svc.forget(revoked)

    # --- the clock ------------------------------------------------------------------------

    def tick(self, now: float) -> bool:
        """Each run's clock; end the finished ones, start queued ones. True when something changed."""
        changed = False
        for run_id, svc in list(self.active.items()):
            try:
                if self.revoked:
                    svc.forget(self.revoked)
                changed |= svc.tick(now)
                self._check_health(run_id, svc, now)
                if svc.finished(now):
                    self._end(run_id, svc)
                    changed = True
                self._failing.pop(run_id, None)
            except Exception:  # one run's fault never stops the others' clocks
                if now - self._failing.get(run_id, -math.inf) > 60:
                    log.exception("%s: its clock failed; retrying (logged at most once a minute)", run_id)
                    self._failing[run_id] = now
        for row in self.db.runs(("queued",)):
            if len(self.active) >= self.cfg.federation.max_runs:
                break
            self._open(row, resume=False)
            changed = True
        return changed

    def finished(self, now: float) -> bool:
        return False  # a federation stays up until it is stopped

    # --- run health (server/federation/run_health.py) ------------------------------------------------------

    def _health(self, run_id: str, svc: ServerService, now: float) -> dict[str, dict[str, Any]]:
        """Each node's state in the run (online, training, offline, refused, failed)."""
        r = svc.rounds
        training = set(getattr(r, "outstanding", {}))  # async: the tasks nodes hold
        if getattr(r, "open", False):  # sync: selected for the open round, no result yet
            training |= set(getattr(r, "selected", ())) - set(getattr(r, "received", ()))
        horizon = svc.cfg.server.poll_s + 5.0
        return node_health(self.db.answers(run_id), svc.last_seen, now, horizon, training)

    def _check_health(self, run_id: str, svc: ServerService, now: float) -> None:
        """A run that cannot proceed ends ``failed`` with the reason; a waiting run says for what."""
        if svc.done:
            self.waiting.pop(run_id, None)
            return
        watch = self.watch.setdefault(run_id, RunWatch(svc.cfg.server.min_nodes, self.cfg.federation.run_stall_s))
        waiting, fail = watch.check(self._health(run_id, svc, now), self.registered(), now)
        if waiting is None:
            self.waiting.pop(run_id, None)
        elif self.waiting.get(run_id) is None:
            log.info("%s %s", run_id, waiting)  # once when it starts waiting, not at every tick
            self.event(run_id, "server", waiting)
        if waiting is not None:
            self.waiting[run_id] = waiting
        if fail is not None:
            log.warning("%s cannot proceed; it ends failed: %s", run_id, fail)
            svc.stop(fail[:1000])

    def _task(self, cfg: Config):
        """The run's task, in this process: a built-in, or a registered task whose pinned source
        was checked (the operator's code) and whose loading was tried in the worker first."""
        from shoal.assembly import task_from_config

        return task_from_config(cfg)

    def _open(self, row: RunRow, resume: bool) -> None:
        run_dir = self.dir / row.id
        try:
            entry = self._entry(row.task, row.submitted_by)
            if entry.sha256 != row.task_sha256:
                raise RunError(
                    "task_changed",
                    f"task {row.task} was registered again with another source since the run was submitted",
                )
            if entry.source == "bundle":
                cfg = run_config(self.cfg, row.config, self._app(entry), run_dir)
                task = self.bundles.task(entry.ref, row.submitted_by)
            else:
                self.tasks.verify(entry)
                cfg = run_config(self.cfg, row.config, entry.ref, run_dir)
                task = self._task(cfg)
            svc = open_service(
                cfg,
                resume=resume,
                task=task,
                registered=self.registered(),
                started_at=time.monotonic(),
                also=functools.partial(self._record, row.id),
                label=row.id,
                max_body_bytes=self.max_body_bytes(),
            )
        except ShoalError as e:
            log.warning("%s cannot start: %s", row.id, e)
            self.event(row.id, "server", f"failed: cannot start: {e}")
            self.db.set_status(row.id, "failed", f"cannot start: {e}", time.time())
            return
        self.active[row.id] = svc
        if row.status != "running":
            self.db.set_status(row.id, "running")
        log.info("%s %s: task %s, %d rounds", row.id, "resumed" if resume else "started", row.task, cfg.server.rounds)
        self.event(row.id, "server", f"{'resumed' if resume else 'started'}: {cfg.server.rounds} rounds, {svc.mode}")

    def max_body_bytes(self) -> int:
        """A run's requests are at most the federation's server.max_body_bytes (its body buffers'
        size); a larger update travels in chunks (server/chunks.py)."""
        return self.cfg.server.max_body_bytes or DEFAULT_FEDERATION_BODY

    def _record(self, run_id: str, event: Event) -> None:
        if isinstance(event, Record):
            self.db.add_metric(run_id, event.fields)

    def _end(self, run_id: str, svc: ServerService) -> None:
        """The run is over: its final model and summary into its folder, its status into the table
        (should a write fail, the run stays active and the next tick tries again)."""
        reason = svc.stop_reason or ""
        if run_id in self.user_stopped:
            status = "stopped"
        elif svc.stopped is not None:  # server.max_failed_rounds
            status = "failed"
        else:
            status = "finished"
        run_dir = self.dir / run_id
        save_file(
            {k: v.contiguous() for k, v in svc.spec.views(svc.rounds.global_params.detach().clone()).items()},
            str(run_dir / "model.safetensors"),
            metadata={"version": str(svc.version), "spec_hash": svc.spec.hash},
        )
        summary = {
            "run": run_id,
            "status": status,
            **({"reason": reason} if reason else {}),
            "version": svc.version,
            "rounds": svc.rounds.round,
            "last_metrics": svc.last_record,
            "last_federated": svc.last_fed,
            "updates_accepted": svc.counters.accepted,
            "updates_rejected": dict(svc.counters.rejected),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self.db.set_status(run_id, status, reason, time.time())
        del self.active[run_id]
        self.watch.pop(run_id, None)
        self.waiting.pop(run_id, None)
        svc.close_files()  # its TensorBoard writer (a thread and an open file) ends with the run
        log.info("%s %s at version %d%s", run_id, status, svc.version, f": {reason}" if reason else "")
        self.event(run_id, "server", f"{status} at version {svc.version}" + (f": {reason}" if reason else ""))


PULLED = ("model.safetensors", "metrics.jsonl", "summary.json")
DEFAULT_FEDERATION_BODY = 64 * 1024 * 1024  # server.max_body_bytes = 0 in a federation: runs' uploads up to this
