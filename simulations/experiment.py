"""Run a simulation from a Config and write its outputs: metrics.jsonl, summary.json, plots."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from shoal.config import Config
from shoal.errors import ConfigError

from .inprocess import InProcessSimulation
from .run_loop import OnRecord, run_engine

log = logging.getLogger(__name__)


def flower_engine():
    """``shoal.flower.engine.run_flower_simulation``, or a ConfigError naming the extra to install."""
    try:
        from shoal.flower.engine import run_flower_simulation
    except ImportError as e:
        if "flwr" not in str(e) and "ray" not in str(e):
            raise
        raise ConfigError(
            "simulation.engine = 'flower' needs Flower, an optional extra: "
            "pip install 'shoal[flower]' (or use simulation.engine = 'inprocess')"
        ) from None
    return run_flower_simulation


def ray_engine():
    """``shoal.simulations.ray_engine.run_ray_simulation``, or a ConfigError naming the extra to install."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(
            "simulation.engine = 'ray' needs Ray, an optional extra: pip install 'shoal[ray]' "
            "(or use simulation.engine = 'inprocess')"
        ) from None
    from .ray_engine import run_ray_simulation

    return run_ray_simulation


def run_simulation(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: OnRecord | None = None,
    sim: InProcessSimulation | None = None,
) -> dict[str, Any]:
    """Run ``cfg.simulation.rounds`` rounds (fewer if the privacy budget runs out); returns
    the summary (also written to disk). ``sim``: a simulation built by the caller (the Ray
    engine passes one whose clients train on its workers)."""
    if cfg.simulation.engine == "flower":  # Flower's simulation runtime (Ray) drives shoal's rounds
        run_flower_simulation = flower_engine()

        return run_flower_simulation(cfg, out_dir, progress, on_record)
    if cfg.simulation.engine == "ray" and sim is None:  # shoal's rounds here, clients on Ray workers
        from .ray_gpu_sharing import engine_for_run

        cfg = engine_for_run(cfg)  # several workers on one local GPU: the in-process engine instead
    if cfg.simulation.engine == "ray" and sim is None:
        return ray_engine()(cfg, out_dir, progress, on_record)
    if cfg.simulation.mode == "gossip":  # decentralized peers, no server (simulations/gossip/)
        from .gossip import run_gossip_simulation

        return run_gossip_simulation(cfg, out_dir, progress, on_record)
    if cfg.simulation.mode == "async" or cfg.heterogeneity.enabled:  # on the virtual clock
        from .virtual_run import run_virtual

        return run_virtual(cfg, out_dir, progress, on_record, sim=sim)
    built = sim
    return run_engine(lambda: built or InProcessSimulation.from_config(cfg), cfg, out_dir, progress, on_record)
