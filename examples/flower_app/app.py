"""A Flower ServerApp using a shoal strategy, and a ClientApp built from shoal's trainer.

Run it on Flower's simulation engine (Ray, on this machine):

    python examples/flower_app/app.py [--ray-cpus 2]

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

from shoal.aggregation import make_strategy  # noqa: E402
from shoal.config import Config, load_config  # noqa: E402
from shoal.simulations.flower_apps import (  # noqa: E402
    ShoalStrategy,
    config_from_context,
    from_arrays,
    make_client_app,
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
        setup = setup_for(c)  # data (for the test set), the initial model, its ParamSpec
        strategy = ShoalStrategy(
            make_strategy(c.strategy, setup.spec.numel), setup.spec,
            clients_per_round=c.simulation.clients_per_round, fraction=c.simulation.fraction,
            seed=c.simulation.seed,
        )

        def central_eval(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            ev = setup.trainer.evaluate(from_arrays(arrays, setup.spec), setup.data.test.x, setup.data.test.y)
            print(f"round {server_round:3d}: test accuracy {ev['accuracy']:.4f}, loss {ev['loss']:.4f}")
            return MetricRecord(ev)

        strategy.start(grid, to_arrays(setup.initial, setup.spec), num_rounds=c.simulation.rounds,
                       evaluate_fn=central_eval)

    return app


# The app's components for `flwr run` / a SuperLink.
server_app = build_server_app(load_config(CONFIG))
client_app = make_client_app(load_config(CONFIG))


if __name__ == "__main__":
    from flwr.simulation import run_simulation

    from shoal.simulations.flower_engine import backend_config

    ap = argparse.ArgumentParser(description="shoal strategy + shoal clients on Flower's simulation engine")
    ap.add_argument("--ray-cpus", type=int, default=0, help="CPUs Ray may use (0 = all)")
    args = ap.parse_args()
    cfg = load_config(CONFIG, [f"simulation.ray_num_cpus={args.ray_cpus}"])
    run_simulation(
        server_app=build_server_app(cfg),
        client_app=make_client_app(cfg),
        num_supernodes=cfg.simulation.num_clients,
        backend_config=backend_config(cfg),
    )
