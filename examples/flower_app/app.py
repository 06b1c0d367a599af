"""A Flower ServerApp using a shoal strategy, and a ClientApp built from shoal's trainer.

Run it on Flower's simulation engine (Ray, on this machine):

    python examples/flower_app/app.py [--ray-cpus 2] [--task path/to/your_task.py:name]

With ``flwr run`` or a deployed SuperLink, ``server_app`` and ``client_app`` below are
the app's components (pyproject.toml here; docs/flower.md); both read shoal.toml, which
travels beside app.py.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

from flwr.app import ArrayRecord, Context, MetricRecord  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from shoal.config import Config, load_config  # noqa: E402
from shoal.flower.apps import (  # noqa: E402
    ShoalStrategy,
    config_from_context,
    evaluated_round,
    from_arrays,
    make_client_app,
    round_strategy,
    setup_for,
    to_arrays,
)

CONFIG = Path(__file__).with_name("shoal.toml")


def build_server_app(cfg: Config | None = None) -> ServerApp:
    """A ServerApp whose aggregation is shoal's (here FedAdam, from the [strategy] table)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        c = cfg or config_from_context(context)
        setup = setup_for(c)  # the task (here the built-in one of shoal.toml), its initial model and ParamSpec
        due = evaluated_round(c)  # every simulation.eval_every rounds and the last
        strategy = ShoalStrategy(
            round_strategy(c, setup, setup.trainer.device),  # [strategy], and SCAFFOLD's control variate
            setup.spec,
            clients_per_round=c.simulation.clients_per_round,
            fraction=c.simulation.fraction,
            seed=c.simulation.seed,
            federated_eval=due if setup.has_client_test else None,  # nodes evaluate on their own test data
        )

        def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            ev = {}
            if setup.test is not None:  # the task's central test set, with the task's metrics
                metrics = setup.trainer.evaluate_data(from_arrays(arrays, setup.spec), setup.test)
                ev = {f"test_{k}": v for k, v in metrics.items() if k != "num_examples"}
            if server_round > 0 and due(server_round):
                ev.update(strategy.last_federated)  # fed_<metric>: this round's federated evaluation
            if ev:
                print(f"round {server_round:3d}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
            return MetricRecord(ev) if ev else None

        strategy.start(
            grid, to_arrays(setup.initial, setup.spec), num_rounds=c.simulation.rounds, evaluate_fn=central_eval
        )

    return app


# The app's components for `flwr run` / a SuperLink.
server_app = build_server_app(load_config(CONFIG))
client_app = make_client_app(load_config(CONFIG))


if __name__ == "__main__":
    from flwr.simulation import run_simulation

    from shoal.assembly import with_absolute_task
    from shoal.cli_common import with_task
    from shoal.flower.engine import backend_config

    ap = argparse.ArgumentParser(description="shoal strategy + shoal clients on Flower's simulation engine")
    ap.add_argument("--ray-cpus", type=int, default=0, help="CPUs Ray may use (0 = all)")
    ap.add_argument("--task", default=None, help="your task, path/to/file.py:name (default: shoal.toml's)")
    args = ap.parse_args()
    cfg = load_config(CONFIG, with_task([f"simulation.ray_num_cpus={args.ray_cpus}"], args.task))
    cfg = with_absolute_task(cfg)  # the Ray workers import the task file themselves
    run_simulation(
        server_app=build_server_app(cfg),
        client_app=make_client_app(cfg),
        num_supernodes=setup_for(cfg).num_clients,  # the task may split into another number of clients
        backend_config=backend_config(cfg),
    )
