"""The `shoal` command: one sub-command per job a user comes for (DESIGN.md)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import ShoalError

app = typer.Typer(
    name="shoal",
    help="Federated and decentralized training for PyTorch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

@app.callback()
def _root() -> None:
    """Federated and decentralized training for PyTorch.

    Jobs: simulate many clients on one machine (simulate), deploy an aggregator
    (server), join as a client node (client), gossip without a server (peer), and
    evaluate privacy/accuracy tradeoffs (privacy-sweep).
    """


SetOpt = typer.Option(None, "--set", help="Override one config value: section.key=value (repeatable).")


def _setup_logging(verbose: bool, quiet: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )


@app.command()
def simulate(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML experiment file (default: built-in Synthetic(1,1) demo)."),
    set_: Optional[list[str]] = SetOpt,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: output.dir)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, warnings only."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Simulate many clients on this machine; write metrics.jsonl, summary.json and plots."""
    _setup_logging(verbose, quiet)
    from .config import load_config
    from shoal.simulations.experiment import run_simulation

    cfg = load_config(config, set_ or [])
    out_dir = out or Path(cfg.output.dir)
    summary = run_simulation(cfg, out_dir, progress=None if not quiet else False)
    acc = summary["final_test_accuracy"]
    typer.echo(
        f"final test accuracy {acc:.4f} after {summary['rounds']} rounds "
        f"({summary['wall_s']:.1f} s); outputs in {out_dir}/"
    )


@app.command("privacy-sweep")
def privacy_sweep(
    config: Path = typer.Option(..., "--config", "-c", help="TOML experiment file with a [privacy] sweep grid."),
    set_: Optional[list[str]] = SetOpt,
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output folder (default: output.dir)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings only."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Baseline + a grid of DP noise levels: accuracy vs epsilon and a membership-inference audit."""
    _setup_logging(verbose, quiet)
    from .config import load_config
    from shoal.simulations.privacy_sweep import markdown_table, run_privacy_sweep

    cfg = load_config(config, set_ or [])
    out_dir = out or Path(cfg.output.dir)
    rows = run_privacy_sweep(cfg, out_dir)
    typer.echo(markdown_table(rows) + f"outputs in {out_dir}/ (results.csv, results.md, accuracy_vs_epsilon.png)")


def main() -> None:
    """Entry point: a ShoalError becomes one line on stderr and exit status 2."""
    try:
        app()
    except ShoalError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
