"""The one run loop every engine reports to: progress bar, metrics.jsonl, summary.json, plots.

An engine (in-process sync rounds, the virtual clock, gossip, Flower, a distributed
engine) only produces records and its own summary figures; :class:`RunLoop` does the
rest the same way for all of them, so every long command shows progress and every run
writes the same files with the same keys:

    with RunLoop(cfg, out_dir, total=cfg.simulation.rounds, label=...) as loop:
        for step in engine.steps():          # pull style: an iterator of Step
            loop.step(step)
        summary = loop.finish(engine_figures, setup_s)

An engine that drives its own loop (Flower calls back after each round) pushes instead:
``loop.record(rec, advance=...)`` from its callback.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.config import Config
from shoal.metrics import MetricsLog
from shoal.privacy_plan import plan_of

from .report import final_metrics, plot_curves

log = logging.getLogger(__name__)

OnRecord = Callable[[dict[str, Any]], None]


@dataclass
class Step:
    """What an engine did since its last step: ``advance`` units of progress (rounds or
    versions) and, when it evaluated, a metrics record (the loop adds ``elapsed_s``)."""

    advance: int = 1
    record: dict[str, Any] | None = None


class ProgressBar:
    """A rich progress bar of ``total`` units on a terminal (nothing otherwise)."""

    def __init__(self, total: int, label: str = "round", enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.label = total, label
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn(f"[bold]{self.label}"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total, status="")
        return self

    def advance(self, status: str = "", by: int = 1) -> None:
        if self._bar is not None:  # drawn now: a short step's status is seen, not skipped by the refresh rate
            self._bar.update(self._task, advance=by, status=status, refresh=True)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def progress_status(record: dict[str, Any]) -> str:
    """The progress bar's status: accuracy when the task reports it, else its first figure."""
    for key in ("test_accuracy", "fed_accuracy"):
        if record.get(key) is not None:
            return f"acc {record[key]:.4f}"
    figures = final_metrics(record)
    if figures:
        k, v = next(iter(figures.items()))
        return f"{k} {v:.4g}"
    return ""


class RunLoop:
    """Progress, records and the summary of one run; engines report to it."""

    def __init__(
        self,
        cfg: Config,
        out_dir: str | Path | None,
        total: int,
        label: str,
        x_axis: str = "round",
        progress: bool | None = None,
        on_record: OnRecord | None = None,
        unit: str = "round",
    ):
        self.cfg = cfg
        self.plan = plan_of(cfg)  # what a DP run may write (privacy.release)
        self.out = Path(out_dir or cfg.output.dir)
        self.metrics = MetricsLog(self.out, tensorboard=cfg.output.tensorboard)
        self.label, self.x_axis = label, x_axis
        self.on_record = on_record
        show = cfg.simulation.progress and sys.stderr.isatty() if progress is None else progress
        self.bar = ProgressBar(total, unit, show)
        self.last: dict[str, Any] = {}
        self.t_start = time.perf_counter()

    def __enter__(self) -> RunLoop:
        self.bar.__enter__()
        self.t_start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)
        self.metrics.close()

    def record(self, record: dict[str, Any], advance: int = 0) -> dict[str, Any]:
        """Write one metrics record (``elapsed_s`` added; under DP only what ``privacy.release``
        lets out), tell ``on_record``, move the bar."""
        rec = self.plan.release_record({**record, "elapsed_s": round(time.perf_counter() - self.t_start, 4)})
        self.metrics.write(rec)
        self.last = rec
        if self.on_record:
            self.on_record(rec)
        self.bar.advance(progress_status(rec), advance)
        return rec

    def step(self, step: Step) -> None:
        if step.record is not None:
            self.record(step.record, step.advance)
        else:
            self.bar.advance(progress_status(self.last), step.advance)

    def finish(self, figures: dict[str, Any], setup_s: float, title: str = "") -> dict[str, Any]:
        """summary.json: the last evaluation, the engine's ``figures``, times and the config; plots."""
        records = self.metrics.records
        accs = [r["test_accuracy"] for r in records if r.get("test_accuracy") is not None]
        last = self.last
        summary = {
            "final_test_accuracy": last.get("test_accuracy"),
            "final_test_loss": last.get("test_loss"),
            "best_test_accuracy": max(accs) if accs else None,
            "final_metrics": final_metrics(last),
            "task": self.label,
            **self.plan.release_summary(figures),
            "wall_s": round(time.perf_counter() - self.t_start, 3),
            "setup_s": round(setup_s, 3),
            "config": self.cfg.to_dict(),
        }
        self.metrics.summary(summary)
        if self.cfg.output.plots:
            plot_curves(records, self.out, x=self.x_axis, title=title or self.label)
        log.info("wrote %s", self.out)
        return summary
