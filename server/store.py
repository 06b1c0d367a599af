"""Where the aggregator's events become files: metrics.jsonl, checkpoints, the privacy ledger.

server/service.py decides and emits (:class:`~shoal.server.service.Record`,
:class:`~shoal.server.service.Checkpoint`, :class:`~shoal.server.service.PrivacyLedger`);
this module writes each at once, in the order emitted, so "a checkpoint before its
metrics line" and "the ledger before a charged round's tasks" hold on disk. It also reads
what an earlier run left (:meth:`ServerStore.restore`) and the task's central test set, and
puts the three together in :func:`open_service`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.assembly import task_from_config
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.privacy_plan import plan_of
from shoal.task import ClientData, Task, call_part, check_data
from shoal.tensorboard import TensorBoardLog

from .checkpoint import newest_intact, save_checkpoint, write_durably
from .edge.intake import PartialIntake
from .events import Checkpoint, Event, PrivacyLedger, Record, Restored
from .service import ServerService

log = logging.getLogger(__name__)


class ServerStore:
    """The files of one aggregator: ``server.out_dir``/metrics.jsonl and, in
    ``server.checkpoint_dir``, the checkpoints and privacy.json (the privacy ledger)."""

    def __init__(self, cfg: Config):
        s = cfg.server
        self.cfg = cfg
        self.ckpt_dir = Path(s.checkpoint_dir)
        self.out_dir = Path(s.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.privacy_path = self.ckpt_dir / "privacy.json"  # the ledger: every charged round, before it runs
        self.keep = s.keep_checkpoints
        # [output] tensorboard (per run in a federation: the run's own config): event files beside metrics.jsonl
        self.tensorboard = TensorBoardLog(self.out_dir) if cfg.output.tensorboard else None

    def restore(self, resume: bool) -> Restored:
        """The latest checkpoint and the privacy ledger when resuming; a fresh run starts an
        empty metrics.jsonl (and, with ``resume=False``, a new ledger: the old one is reported)."""
        checkpoint = None
        if resume and (found := newest_intact(self.ckpt_dir)) is not None:
            checkpoint = found
        elif not resume or not self.metrics_path.exists():
            self.metrics_path.write_text("")
        ledger = self._read_ledger(resume) if plan_of(self.cfg).enabled else None
        # elapsed_s goes on from where the run was, not from 0: its last record's, or the checkpoint's
        # (a DP run's records do not carry it: shoal/privacy_plan.py SERVED_TIMING)
        if checkpoint is None:
            return Restored(checkpoint, ledger, 0.0)
        kept = checkpoint[2].get("elapsed_s")
        elapsed = max(last_elapsed(self.metrics_path), float(kept) if isinstance(kept, (int, float)) else 0.0)
        return Restored(checkpoint, ledger, elapsed)

    def _read_ledger(self, resume: bool) -> dict | None:
        if not self.privacy_path.exists():
            return None
        try:
            state = json.loads(self.privacy_path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"the privacy ledger {self.privacy_path} cannot be read ({e}): without it the rounds "
                "already charged are unknown; restore it, or use another server.checkpoint_dir"
            ) from None
        if not resume:
            log.warning(
                "--fresh: a new privacy ledger; the earlier run charged %s rounds on the same nodes' data, "
                "which this run's epsilon does not include",
                state.get("rounds_charged"),
            )
            return None
        return state

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def write(self, event: Event) -> None:
        """Make one event durable now (the service emits them in the order they must land)."""
        if isinstance(event, Record):
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(event.fields) + "\n")
            if self.tensorboard is not None:
                self.tensorboard.write(event.fields)
        elif isinstance(event, Checkpoint):
            save_checkpoint(self.ckpt_dir, event.version, event.tensors, event.state, self.keep)
        elif isinstance(event, PrivacyLedger):  # whole, fsynced, renamed into place
            write_durably(self.privacy_path, json.dumps(event.state).encode())
        else:
            raise TypeError(f"unknown server event {type(event).__name__}")


def central_test_data(cfg: Config, task: Task) -> ClientData | None:
    """The task's central test set when ``server.eval`` asks for one (the built-in task: the
    dataset's test split); a real aggregator usually has no data and relies on the nodes."""
    if not cfg.server.eval:
        return None
    data = call_part(task, "central_test_data()", task.central_test_data)
    test = check_data(task, data, "central_test_data()", allow_none=True)
    if test is None:
        log.info("the task gives no central_test_data(): no central evaluation")
    return test


def _both(first: Callable[[Event], None], then: Callable[[Event], None]) -> Callable[[Event], None]:
    def emit(event: Event) -> None:
        first(event)
        then(event)

    return emit


def open_service(
    cfg: Config,
    resume: bool = True,
    task: Task | None = None,
    registered: int | None = None,
    started_at: float | None = None,
    also: Callable[[Event], None] | None = None,
    **service: Any,
) -> ServerService:
    """An aggregator whose events land in its files: restored from the latest checkpoint and
    ledger unless ``resume`` is False, evaluating on the task's central test set, with a root's
    edge intake when ``hierarchy.edge_names`` lists edges. ``also`` sees each event after it is
    written (a federation's database keeps the metrics lines); ``service``: more of
    ServerService's keywords (a federation's run label and body cap)."""
    task = task if task is not None else task_from_config(cfg)
    store = ServerStore(cfg)
    return ServerService.from_config(
        cfg,
        task,
        registered,
        test=central_test_data(cfg, task),
        restored=store.restore(resume),
        emit=store.write if also is None else _both(store.write, also),
        started_at=started_at,
        close_files=store.close,
        tier=PartialIntake if cfg.hierarchy.edge_names else None,
        **service,
    )


def last_elapsed(path: Path, tail: int = 64 * 1024) -> float:
    """The ``elapsed_s`` of the last metrics line that has one (0 without any): read from the file's
    last ``tail`` bytes, so a long run's metrics are not read whole."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - tail))
            lines = f.read().splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            value = json.loads(line).get("elapsed_s")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf:
            return float(value)
    return 0.0
