"""Run a virtual-clock simulation (async mode, or sync with heterogeneity) and write the
same outputs as experiment.run_simulation: metrics.jsonl, summary.json, plots.

metrics.jsonl records add ``virtual_time_s``, ``version`` and, for async runs, the
staleness of the updates accepted since the previous record (mean, max, histogram);
summary.json adds the counts of accepted and rejected updates.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shoal.config import Config

from .async_engine import AsyncEngine, VirtualEngine
from .inprocess import InProcessSimulation
from .run_loop import OnRecord, run_engine
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

    def build() -> VirtualEngine:
        return AsyncEngine(cfg, sim) if cfg.simulation.mode == "async" else VirtualSyncEngine(cfg, sim)

    return run_engine(build, cfg, out_dir, progress, on_record)
