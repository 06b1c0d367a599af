"""The Flower engine: the same experiment through Flower's Ray-backed simulation.

``simulation.engine = "flower"`` runs the ServerApp and ClientApp of
:mod:`shoal.flower.apps` under ``flwr.simulation.run_simulation``: each
client is a Flower SuperNode (client i of the task's ``simulation_data``), its training runs in a Ray actor with
``simulation.flower_client_cpus`` / ``flower_client_gpus`` reserved, on this machine
(``simulation.ray_num_cpus`` CPUs) or on the Ray cluster at ``simulation.ray_address``.
Sampling, seeds and aggregation are shoal's, and both engines load the same task
(``[task] app`` or the built-in one; a task file's path is made absolute before the
config reaches the Ray workers, which import the file themselves), so with the same
config and seed the global model matches the in-process engine's; outputs are the same
metrics.jsonl (``test_<metric>``, ``fed_<metric>``), summary.json and plots. The
in-process engine is far faster on one machine (see bench/engines.py); this one is for
runs that need more than one machine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shoal.assembly import with_absolute_task
from shoal.config import Config
from shoal.errors import ConfigError, EngineError
from shoal.rounds import RoundSummary
from shoal.simulations.run_loop import Report, Step, run_engine

from .apps import make_server_app, setup_for
from .client_app import make_client_app

log = logging.getLogger(__name__)


@dataclass
class FlowerRun:
    summary: dict[str, Any]
    global_params: torch.Tensor  # the global model after the last round (CPU)


def backend_config(cfg: Config) -> dict[str, Any]:
    """Flower's backend config: client resources from the config, and ray.init arguments
    (an existing cluster's address, or a new local runtime limited to ``ray_num_cpus``).

    ``address = "local"`` matters: without an address ``ray.init`` joins a Ray instance it finds
    running on the machine, and when another session's instance held the CPUs Flower's actors
    never started and the run waited forever (shoal's Ray engine starts its own the same way)."""
    sim = cfg.simulation
    if sim.ray_address:
        init_args: dict[str, Any] = {"address": sim.ray_address}
    else:
        cpus = sim.ray_num_cpus or os.cpu_count() or 1
        if sim.flower_client_cpus > cpus:
            raise ConfigError(
                f"simulation.flower_client_cpus = {sim.flower_client_cpus} is more than the "
                f"{cpus} CPU(s) Ray may use here: no client could start; lower it or raise simulation.ray_num_cpus"
            )
        init_args = {"address": "local", "num_cpus": cpus, "include_dashboard": False}
    return {
        "client_resources": {"num_cpus": sim.flower_client_cpus, "num_gpus": sim.flower_client_gpus},
        "init_args": init_args,
    }


class FlowerEngine:
    """The run loop's Engine (simulations/run_loop.py) of Flower's simulation runtime: the
    ServerApp calls back after each evaluated round, and each call is reported as a step."""

    x_axis = "round"

    def __init__(self, cfg: Config):
        self.cfg = with_absolute_task(cfg)  # Ray workers load the task themselves, maybe from another folder
        self.backend = backend_config(self.cfg)
        self.setup = setup_for(self.cfg, self.cfg.simulation.device)  # the ServerApp (a thread here) reuses it
        self.final: torch.Tensor | None = None  # the global model after the last round (CPU)
        self.model_bytes = 4 * self.setup.spec.numel  # Flower's ArrayRecord carries each float32 model raw
        self.up = self.down = self.round = 0

    @property
    def label(self) -> str:
        return self.setup.label

    @property
    def title(self) -> str:
        return f"{self.setup.label} / {self.cfg.strategy.name} (flower)"

    def _record(self, summary: RoundSummary, ev: dict[str, float]) -> dict[str, Any]:
        up = self.model_bytes * (summary.num_results + sum(summary.rejected.values()))
        down = self.model_bytes * summary.num_selected
        self.up += up
        self.down += down
        return {
            "round": summary.round,
            "version": summary.version,
            **ev,
            "train_loss": summary.train_loss,
            "num_results": summary.num_results,
            "num_examples": summary.num_examples,
            "bytes_up": up,
            "bytes_down": down,
            "bytes_up_total": self.up,
            "bytes_down_total": self.down,
            "rejected": summary.rejected,
        }

    def drive(self, report: Report) -> None:
        import ray
        from flwr.simulation import run_simulation

        cfg = self.cfg

        def on_round(summary: RoundSummary, ev: dict[str, float], params: torch.Tensor) -> None:
            report(Step(summary.round - self.round, self._record(summary, ev)))
            self.round = summary.round
            self.final = params

        # Flower's per-round INFO lines, its deprecation notice for run_simulation and
        # its database layer's start-up lines stay out of shoal's log unless debugging.
        quiet = {name: logging.getLogger(name) for name in ("flwr", "alembic")}
        levels = {name: lg.level for name, lg in quiet.items()}
        if log.getEffectiveLevel() > logging.DEBUG:
            for lg in quiet.values():
                lg.setLevel(logging.ERROR)
        started_ray = not ray.is_initialized()
        errors: list[BaseException] = []
        try:
            run_simulation(
                server_app=make_server_app(cfg, on_round, strict=True, errors=errors),
                client_app=make_client_app(cfg, cfg.simulation.device),
                num_supernodes=self.setup.num_clients,
                backend_config=self.backend,
            )
        except RuntimeError as e:  # Flower's generic "An error was encountered": say what we know
            if errors:
                raise errors[0] from None
            raise EngineError(
                f"Flower's simulation runtime stopped ({e}); its log above says why, e.g. 'ActorPool is empty' "
                "when one client's resources (simulation.flower_client_cpus / flower_client_gpus) do not fit "
                "what Ray has here"
            ) from None
        finally:
            for name, lg in quiet.items():
                lg.setLevel(levels[name])
            if started_ray and ray.is_initialized():
                ray.shutdown()
        if errors:
            raise errors[0]
        if self.final is None or self.round != cfg.simulation.rounds:
            raise RuntimeError(f"the Flower simulation stopped after round {self.round} of {cfg.simulation.rounds}")

    def figures(self, last: dict[str, Any]) -> dict[str, Any]:
        return {
            "rounds": self.cfg.simulation.rounds,
            "num_clients": self.setup.num_clients,
            "num_parameters": self.setup.spec.numel,
            "device": str(self.setup.trainer.device),
            "engine": "flower",
            "bytes_up_total": self.up,
            "bytes_down_total": self.down,
        }

    def close(self) -> None:
        """Nothing left to free: :meth:`drive` shuts down a Ray runtime it started."""


def run_flower(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> FlowerRun:
    """Run ``cfg`` on Flower's simulation engine; write metrics.jsonl, summary.json, plots."""
    built: list[FlowerEngine] = []

    def build() -> FlowerEngine:
        built.append(FlowerEngine(cfg))
        return built[0]

    summary = run_engine(build, cfg, Path(out_dir or cfg.output.dir), progress, on_record)
    final = built[0].final
    assert final is not None  # drive() raised otherwise
    return FlowerRun(summary, final)


def run_flower_simulation(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """:func:`run_flower`, returning the summary as the in-process ``run_simulation`` does."""
    return run_flower(cfg, out_dir, progress, on_record).summary
