"""Run a virtual-clock simulation (async mode, or sync with heterogeneity) and write the
same outputs as experiment.run_simulation: metrics.jsonl, summary.json, plots.

metrics.jsonl records add ``virtual_time_s``, ``version`` and, for async runs, the
staleness of the updates accepted since the previous record (mean, max, histogram);
summary.json adds the counts of accepted and rejected updates.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from shoal.config import Config

from .async_engine import AsyncEngine
from .inprocess import InProcessSimulation
from .run_loop import OnRecord, RunLoop, progress_status
from .sync_engine import VirtualSyncEngine

log = logging.getLogger(__name__)


def run_virtual(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: OnRecord | None = None,
    sim: InProcessSimulation | None = None,
) -> dict[str, Any]:
    """``sim``: the clients' simulation, built by the caller (the Ray engine's), else made here."""
    t0 = time.perf_counter()
    engine = AsyncEngine(cfg, sim) if cfg.simulation.mode == "async" else VirtualSyncEngine(cfg, sim)
    setup_s = time.perf_counter() - t0
    algorithm = cfg.asynchronous.algorithm if cfg.simulation.mode == "async" else "sync"
    label = engine.sim.task_label
    # progress in server steps (sync: rounds closed; async: versions) out of simulation.rounds
    with RunLoop(
        cfg, out_dir, cfg.simulation.rounds, label, x_axis="virtual_time_s", progress=progress, on_record=on_record
    ) as loop:
        done = 0
        for rec in engine.run():
            now = getattr(engine, "rounds_done", engine.rounds.version)
            loop.record(rec, advance=max(0, now - done))
            done = max(done, now)
            log.info("virtual %.0fs  version %d  %s", rec["virtual_time_s"], rec["version"], progress_status(rec))
        return loop.finish(
            {
                # server steps taken (sync: rounds closed, failed ones included; async: versions)
                "rounds": getattr(engine, "rounds_done", engine.rounds.version),
                "mode": cfg.simulation.mode,
                "algorithm": algorithm,
                **engine.totals(),
                "num_clients": len(engine.sim.client_ids),
                "num_parameters": engine.sim.spec.numel,
                "device": str(engine.sim.device),
                **engine.sim.pool_figures(),
            },
            setup_s,
            title=f"{label} / {algorithm}",
        )
