"""Run a simulation from a Config and write its outputs: metrics.jsonl, summary.json, plots."""

from __future__ import annotations

import logging
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from shoal.config import Config
from shoal.errors import ConfigError
from shoal.metrics import MetricsLog

from .inprocess import InProcessSimulation
from .report import final_metrics, plot_curves

log = logging.getLogger(__name__)


def _progress(enabled: bool, total: int):
    if not enabled:
        return nullcontext(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(), TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(), transient=False,
    )


class progress_bar:
    """A rich progress bar of ``total`` steps on a terminal (nothing otherwise); ``advance(status)``."""

    def __init__(self, total: int, label: str = "round", enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.label = total, label
        self._bar = self._task = None

    def __enter__(self) -> "progress_bar":
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn(f"[bold]{self.label}"), MofNCompleteColumn(), BarColumn(),
                                 TextColumn("{task.fields[status]}"), TimeElapsedColumn())
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total, status="")
        return self

    def advance(self, status: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, advance=1, status=status)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)


def progress_status(record: dict[str, Any]) -> str:
    """The progress bar's status: the first evaluation metric of the last record."""
    for key in ("test_accuracy", "fed_accuracy"):
        if record.get(key) is not None:
            return f"acc {record[key]:.4f}"
    figures = final_metrics(record)
    if figures:
        k, v = next(iter(figures.items()))
        return f"{k} {v:.4g}"
    return ""


def flower_engine():
    """``shoal.flower.engine.run_flower_simulation``, or a ConfigError naming the extra to install."""
    try:
        from shoal.flower.engine import run_flower_simulation
    except ImportError as e:
        if "flwr" not in str(e) and "ray" not in str(e):
            raise
        raise ConfigError("simulation.engine = 'flower' needs Flower, an optional extra: "
                          "pip install 'shoal[flower]' (or use simulation.engine = 'inprocess')") from None
    return run_flower_simulation


def run_simulation(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    sim: InProcessSimulation | None = None,
) -> dict[str, Any]:
    """Run ``cfg.simulation.rounds`` rounds (fewer if the privacy budget runs out); returns
    the summary (also written to disk). ``sim``: a simulation built by the caller."""
    if cfg.simulation.engine == "flower":  # Flower's simulation runtime (Ray) drives shoal's rounds
        run_flower_simulation = flower_engine()

        return run_flower_simulation(cfg, out_dir, progress, on_record)
    if cfg.simulation.mode == "gossip":  # decentralized peers, no server (simulations/gossip_sim.py)
        from .gossip_sim import run_gossip_simulation

        return run_gossip_simulation(cfg, out_dir, progress, on_record)
    if cfg.simulation.mode == "async" or cfg.heterogeneity.enabled:  # on the virtual clock
        from .virtual_run import run_virtual

        return run_virtual(cfg, out_dir, on_record)
    out = Path(out_dir or cfg.output.dir)
    sim_cfg = cfg.simulation
    t0 = time.perf_counter()
    sim = sim or InProcessSimulation(cfg)
    setup_s = time.perf_counter() - t0
    metrics = MetricsLog(out)
    show = sim_cfg.progress and sys.stderr.isatty() if progress is None else progress
    last: dict[str, Any] = {}
    t_start = time.perf_counter()
    with _progress(show, sim_cfg.rounds) as bar:
        task = bar.add_task("sim", total=sim_cfg.rounds, status="") if bar else None
        for r in range(1, sim_cfg.rounds + 1):
            summary = sim.run_round()
            stop = sim.privacy is not None and not sim.privacy.allows_next_round()
            if r % sim_cfg.eval_every == 0 or r == sim_cfg.rounds or stop:
                ev = sim.evaluate()
                last = {
                    "round": summary.round,
                    "version": summary.version,
                    **ev,
                    "train_loss": summary.train_loss,
                    "num_results": summary.num_results,
                    "num_examples": summary.num_examples,
                    "elapsed_s": round(time.perf_counter() - t_start, 4),
                    **sim.wire.counts(),
                    "rejected": summary.rejected,
                }
                if sim.privacy is not None:
                    last.update(sim.privacy.metrics())
                metrics.write(last)
                if on_record:
                    on_record(last)
            if bar is not None:
                status = progress_status(last)
                bar.update(task, advance=1, status=status)
            if stop:
                break
    wall = time.perf_counter() - t_start
    accs = [r["test_accuracy"] for r in metrics.records if r.get("test_accuracy") is not None]
    summary_out = {
        "final_test_accuracy": last.get("test_accuracy"),
        "final_test_loss": last.get("test_loss"),
        "best_test_accuracy": max(accs) if accs else None,
        "final_metrics": final_metrics(last),
        "task": sim.task_label,
        "rounds": sim.rounds.version,
        "num_clients": len(sim.client_ids),
        "num_parameters": sim.spec.numel,
        "device": str(sim.device),
        "wall_s": round(wall, 3),
        "setup_s": round(setup_s, 3),
        "bytes_up_total": sim.wire.total_up,
        "bytes_down_total": sim.wire.total_down,
        "config": cfg.to_dict(),
    }
    if sim.privacy is not None:
        summary_out.update(sim.privacy.summary())  # epsilon, delta, the sampling and the accountant
    metrics.summary(summary_out)
    if cfg.output.plots:
        plot_curves(metrics.records, out, title=f"{sim.task_label} / {cfg.strategy.name}")
    log.info("wrote %s", out)
    return summary_out
