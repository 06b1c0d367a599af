"""The `shoal` command: one sub-command per job a user comes for (DESIGN.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from .cli_common import setup_logging, with_task
from .cli_help import as_written
from .errors import ConfigError, ShoalError

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
    (server), join as a client node (client), gossip without a server (peer),
    evaluate privacy/accuracy tradeoffs (privacy-sweep), and compare runs (report).
    """


SetOpt = typer.Option(None, "--set", help="Override one config value: section.key=value (repeatable).")
TaskOpt = typer.Option(
    None,
    "--task",
    "-t",
    help=as_written(
        "Your task: path/to/file.py:name or package.module:name "
        "(default: [task] app, else the built-in task of [model] + [data])."
    ),
)


@app.command()
def simulate(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="TOML experiment file (default: built-in Synthetic(1,1) demo)."
    ),
    set_: list[str] | None = SetOpt,
    task: str | None = TaskOpt,
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: output.dir)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar, warnings only."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Simulate many clients on this machine; write metrics.jsonl, summary.json and plots."""
    setup_logging(verbose, quiet)
    from shoal.simulations.experiment import run_simulation

    from .config import load_config

    cfg = load_config(config, with_task(set_, task))
    out_dir = out or Path(cfg.output.dir)
    summary = run_simulation(cfg, out_dir, progress=None if not quiet else False)
    figures = summary.get("final_metrics") or {}
    acc = summary.get("final_test_accuracy")
    head = (
        f"final test accuracy {acc:.4f}"
        if acc is not None
        else ", ".join(f"{k} {v:.4g}" for k, v in list(figures.items())[:3]) or "finished"
    )
    avg = summary.get("final_average_model_accuracy")  # gossip: the peers' mean, and their average model
    if acc is not None and avg is not None:
        head = f"final test accuracy {acc:.4f} (mean over peers; their average model {avg:.4f})"
    typer.echo(f"{head} after {summary['rounds']} rounds ({summary['wall_s']:.1f} s); outputs in {out_dir}/")


# --- deploy: `shoal server`, `shoal client`, `shoal data split` (issue 4) --------------
from shoal.client.cli import client as _client_command  # noqa: E402
from shoal.server.cli import app as _server_app  # noqa: E402

app.add_typer(_server_app, name="server")
app.command("client")(_client_command)
from shoal.client.cli import node_app as _node_app  # noqa: E402
from shoal.server.federation.run_cli import app as _run_app  # noqa: E402

app.add_typer(_node_app, name="node")
app.add_typer(_run_app, name="run")
from shoal.client.keygen import keygen as _keygen_command  # noqa: E402

app.command("keygen")(_keygen_command)
from shoal.pki_cli import app as _pki_app  # noqa: E402

app.add_typer(_pki_app, name="pki")
_data_app = typer.Typer(help="Node data shards.", no_args_is_help=True)
app.add_typer(_data_app, name="data")


@_data_app.command("split")
def data_split(
    config: Path | None = typer.Option(None, "--config", "-c", help=as_written("TOML with [data] and [simulation].")),
    set_: list[str] | None = SetOpt,
    task: str | None = TaskOpt,
    out: Path = typer.Option(..., "--out", "-o", help="Folder for one <client-id>.safetensors per client."),
) -> None:
    """Write the simulator's client split as one shard file per node (x, y; with --task, the
    task's simulation_data() clients, when they are tensors)."""
    from .config import load_config
    from .shard_split import write_shards

    paths = write_shards(load_config(config, with_task(set_, task)), out)
    typer.echo(f"wrote {len(paths)} shards to {out}/")


# --- gossip peer (p2p/cli.py) ---------------------------------------------------------
@app.command()
def peer(
    listen: str = typer.Option(..., "--listen", help="HOST:PORT to serve on."),
    bootstrap: str = typer.Option("", "--bootstrap", help="Comma-separated URLs of peers to join through."),
    data: str = typer.Option(
        ...,
        "--data",
        help="This peer's own data, read by the task's local_data(PATH); "
        "or client:<i>, client i of the task's simulation split (a simulation convenience).",
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help=as_written("TOML file ([task], [train], [gossip]).")
    ),
    set_: list[str] | None = SetOpt,
    task: str | None = TaskOpt,
    token: str | None = typer.Option(
        None,
        "--token",
        help="Network token shared by the peers (default: $SHOAL_TOKEN; --token-file keeps it out of ps).",
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="File holding the network token (mode 0600), instead of --token."
    ),
    advertise: str | None = typer.Option(
        None, "--advertise", help="URL other peers reach this one at (default: from --listen)."
    ),
    tls_cert: Path | None = typer.Option(None, "--tls-cert"),
    tls_key: Path | None = typer.Option(None, "--tls-key"),
    ca_cert: Path | None = typer.Option(None, "--ca-cert", help="CA that signed the other peers' certificates."),
    insecure: bool = typer.Option(False, "--insecure", help="Plain HTTP (tests, trusted networks only)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Folder for this peer's metrics.jsonl."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Gossip without a server: train locally, exchange and merge models with peers."""
    setup_logging(verbose)
    from shoal.p2p.cli import run_peer

    from .config import load_config
    from .pki import read_secret

    if token_file is not None:
        if token is not None:
            raise ConfigError("give the network token with --token or --token-file, not both")
        token = read_secret(token_file, "--token-file")

    run_peer(
        load_config(config, with_task(set_, task)),
        listen,
        bootstrap,
        data,
        token,
        advertise,
        tls_cert,
        tls_key,
        ca_cert,
        insecure,
        out,
    )


@app.command("privacy-sweep")
def privacy_sweep(
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help=as_written("TOML file with a [privacy] sweep grid (default: the built-in grid of [privacy])."),
    ),
    set_: list[str] | None = SetOpt,
    task: str | None = TaskOpt,
    out: Path | None = typer.Option(None, "--out", "-o", help="Output folder (default: output.dir)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Warnings only."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Baseline + a grid of DP noise levels: accuracy vs epsilon and a membership-inference audit."""
    setup_logging(verbose, quiet)
    from shoal.simulations.privacy_sweep import markdown_table, run_privacy_sweep

    from .config import load_config

    cfg = load_config(config, with_task(set_, task))
    out_dir = out or Path(cfg.output.dir)
    rows = run_privacy_sweep(cfg, out_dir)
    typer.echo(markdown_table(rows) + f"outputs in {out_dir}/ (results.csv, results.md, accuracy_vs_epsilon.png)")


@app.command()
def report(
    runs: list[Path] = typer.Argument(..., help="Run output folders (each with a metrics.jsonl)."),
    out: Path = typer.Option(Path("report"), "--out", "-o", help="Writes OUT.png and OUT.html."),
) -> None:
    """Several runs' curves together (accuracy, loss, bytes, epsilon): one PNG and one self-contained HTML."""
    from .report import report as make_report

    png, page = make_report(runs, out)
    typer.echo(f"wrote {png} and {page}")


def main() -> None:
    """Entry point: a ShoalError becomes one line on stderr and exit status 2."""
    try:
        app()
    except ShoalError as e:
        print_error(e)
        sys.exit(2)


def print_error(e: ShoalError) -> None:
    """``error: <one line>`` on stderr; with ``-v``/``--verbose`` first the traceback of what the
    user's code raised (a UserCodeError's cause), which the one line names."""
    if {"-v", "--verbose"} & set(sys.argv[1:]) and e.__cause__ is not None:
        import traceback

        traceback.print_exception(e.__cause__, file=sys.stderr)
    print(f"error: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
