"""The one run loop every engine reports to: progress bar, metrics.jsonl, summary.json, plots.

An engine (in-process sync rounds, the virtual clock's sync and async engines, the Ray engine's
driver, gossip, Flower) is an :class:`Engine`: it runs its rounds and reports each one as a
:class:`Step`, and says its own summary figures; :func:`run_engine` builds it, drives it
through a :class:`RunLoop` and closes it, the same way for all of them, so every long command
shows progress and every run writes the same files with the same keys:

    summary = run_engine(lambda: InProcessSimulation.from_config(cfg), cfg, out_dir)

Whether a round is evaluated is the one rule of ``shoal.rounds.evaluation_due``; an engine
reports a record only for those rounds (and the last).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shoal.config import Config
from shoal.metrics import MetricsLog
from shoal.privacy_plan import plan_of
from shoal.progress import ProgressBar

from .report import final_metrics, plot_curves

log = logging.getLogger(__name__)

OnRecord = Callable[[dict[str, Any]], None]


@dataclass
class Step:
    """What an engine did since its last step: ``advance`` units of progress (rounds or
    versions) and, when it evaluated, a metrics record (the loop adds ``elapsed_s``)."""

    advance: int = 1
    record: dict[str, Any] | None = None


Report = Callable[[Step], None]


class Engine(Protocol):
    """What the run loop drives. ``label`` names the task (summary.json's ``task``), ``title``
    the plots, ``x_axis`` their x (``round``, or ``virtual_time_s`` on the virtual clock)."""

    @property
    def label(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def x_axis(self) -> str: ...

    def drive(self, report: Report) -> None:
        """Run to the end (``simulation.rounds``, the time limit or the privacy budget), reporting
        each step: its progress and, when it evaluated, its metrics record."""
        ...

    def figures(self, last: dict[str, Any]) -> dict[str, Any]:
        """This run's figures for summary.json (``last``: the last record written)."""
        ...

    def close(self) -> None:
        """Free what the engine holds (workers, a runtime it started); called once, also on error."""
        ...


def run_engine(
    build: Callable[[], Engine],
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: OnRecord | None = None,
) -> dict[str, Any]:
    """Build the engine (its time is summary.json's ``setup_s``), drive it through a RunLoop
    of ``simulation.rounds`` steps, write the summary and close the engine; the summary."""
    t0 = time.perf_counter()
    engine = build()
    setup_s = time.perf_counter() - t0
    try:
        with RunLoop(
            cfg,
            out_dir,
            cfg.simulation.rounds,
            engine.label,
            x_axis=engine.x_axis,
            progress=progress,
            on_record=on_record,
        ) as loop:
            engine.drive(loop.step)
            return loop.finish(engine.figures(loop.last), setup_s, title=engine.title)
    finally:
        engine.close()


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
