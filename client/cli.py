"""`shoal client`: join a server as a node and train on this node's own data."""

from __future__ import annotations

import asyncio
from pathlib import Path

import typer

from shoal.cli_help import as_written
from shoal.errors import ConfigError
from shoal.pki import read_secret


def client(
    server: str = typer.Option(
        ...,
        "--server",
        help="Server URL, e.g. https://host:8443; or several, comma-separated (edge aggregators): the node "
        "moves to the next when the one it uses stops answering.",
    ),
    token_file: Path | None = typer.Option(
        None, "--token-file", help="File holding this node's token (or enroll by key: --cert and --key)."
    ),
    data: Path = typer.Option(
        ...,
        "--data",
        help="This node's data, read by the task's local_data() (built-in "
        "task: a shard file, or a folder with one, from `shoal data split`).",
    ),
    task: str | None = typer.Option(
        None,
        "--task",
        "-t",
        help=as_written(
            "Your task: path/to/file.py:name or "
            "package.module:name (default: [task] app, else the built-in task); "
            "the server's task and model."
        ),
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help=as_written("TOML with [task] (or [model]) and [train].")
    ),
    set_: list[str] | None = typer.Option(None, "--set", help="Override: section.key=value (repeatable)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    ca_cert: Path | None = typer.Option(None, "--ca-cert", help="Trust only this CA (a private deployment)."),
    cert: Path | None = typer.Option(
        None, "--cert", help="This node's certificate (NAME.pem from the operator's `shoal server nodes add --csr`)."
    ),
    key: Path | None = typer.Option(None, "--key", help="This node's private key (NAME.key of `shoal pki node-key`)."),
    name: str = typer.Option(
        "", "--name", help="Name for the logs (default: the shard's client id, else the --data file's name)."
    ),
    privacy_ledger: Path | None = typer.Option(
        None,
        "--privacy-ledger",
        help="Local DP: the file where this node keeps the rounds it spent on its data, "
        "so a restart goes on from them (default: the token or cert file's name + .privacy.json).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Long-poll for work, train locally, upload the update; the data never leaves this node."""
    from shoal.assembly import task_from_config
    from shoal.cli_common import setup_logging, with_task
    from shoal.client.device import select_device
    from shoal.config import load_config
    from shoal.shards import load_shard
    from shoal.tasks import BuiltinTask, builtin_local_data
    from shoal.tls import client_context

    from .node import Node, read_local_data

    setup_logging(verbose)
    if (token_file is None) == (cert is None):
        raise ConfigError(
            "give --token-file (a node added with a token) or --cert and --key (a node enrolled by key), one of the two"
        )
    token = ""
    if token_file is not None:
        if not token_file.is_file():
            raise ConfigError(f"--token-file {str(token_file)!r} not found")
        token = read_secret(token_file, "--token-file")
    cfg = load_config(config, with_task(set_, task))
    urls = [u.strip() for u in server.split(",") if u.strip()]
    if urls and all(u.startswith("https://") for u in urls):
        ctx = client_context(ca_cert, cert, key)
    elif urls and all(u.startswith("http://") for u in urls):
        if cert is not None:
            raise ConfigError("--cert and --key authenticate over TLS: give an https:// --server")
        ctx = None
    else:
        raise ConfigError(
            f"--server {server!r} must be URLs that start with https:// (or all http:// for --insecure servers)"
        )
    the_task = task_from_config(cfg)
    if isinstance(the_task, BuiltinTask) and not cfg.task.app:  # a shard of `shoal data split`, as before tasks
        shard = load_shard(data)
        local = builtin_local_data(the_task, shard)
        name = name or shard.client_id
    else:
        local = read_local_data(the_task, data)
    credential = token_file if token_file is not None else cert
    assert credential is not None  # one of the two, checked above
    ledger = privacy_ledger or credential.with_name(credential.name + ".privacy.json")
    node = Node.from_config(
        server,
        token,
        local,
        cfg,
        select_device(device),
        ctx,
        poll_s=cfg.server.poll_s,
        name=name or data.stem,
        task=the_task,
        privacy_ledger=ledger,
        state_dir=credential.with_name(credential.name + ".state"),  # the algorithm's client state, if it keeps any
    )
    raise typer.Exit(asyncio.run(node.run()))


node_app = typer.Typer(
    help="Join a federation once and take part in every run this node allows.",
    invoke_without_command=True,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
)


@node_app.callback()
def node(
    ctx: typer.Context,
    config: Path = typer.Option(
        None, "--config", "-c", help=as_written("The node config: [node], [limits], [[tasks]].")
    ),
    server: str | None = typer.Option(
        None,
        "--server",
        help="The federation's URL, or several comma-separated (instead of node.server): the node moves to "
        "the next when the one it uses stops answering.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run as a long-lived daemon: wait for runs, check each against this node's config
    (allowed tasks pinned by hash, limits), take part or refuse with the reason; reconnect
    with backoff when the server goes away. Stop with SIGINT/SIGTERM."""
    if ctx.invoked_subcommand is not None:
        return
    from shoal.cli_common import setup_logging
    from shoal.client.device import select_device
    from shoal.tls import client_context

    from .daemon import NodeDaemon
    from .node_config import load_node_config, parse_servers

    setup_logging(verbose)
    if config is None:
        raise ConfigError("give the node config with --config (see docs/deploy.md, 'Nodes')")
    cfg = load_node_config(config)
    if server is not None:
        cfg.servers = parse_servers(server, "--server")
        cfg.server = cfg.servers[0]
    token = ""
    if cfg.token_file is not None:
        if not cfg.token_file.is_file():
            raise ConfigError(f"node.token_file {str(cfg.token_file)!r} not found")
        token = read_secret(cfg.token_file, "node.token_file")
    if cfg.server.startswith("https://"):
        ctx_ssl = client_context(cfg.ca_cert, cfg.cert, cfg.key)
    elif cfg.cert is not None:
        raise ConfigError("node.cert and node.key authenticate over TLS: give an https:// node.server")
    else:
        ctx_ssl = None
    daemon = NodeDaemon(cfg, token, select_device(cfg.device), ctx_ssl)
    raise typer.Exit(asyncio.run(daemon.run()))


@node_app.command("pin")
def pin(ref: str = typer.Argument(..., help="A task reference: path/to/file.py:name or package.module:name.")) -> None:
    """Print the SHA-256 that pins REF's source (the sha256 of its tasks entry in a node config)."""
    from .node_config import source_sha256

    typer.echo(source_sha256(ref))
