"""`shoal client`: join a server as a node and train on a local shard."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Optional

import typer

from shoal.errors import ConfigError


def client(
    server: str = typer.Option(..., "--server", help="Server URL, e.g. https://host:8443"),
    token_file: Path = typer.Option(..., "--token-file", help="File holding this node's token."),
    data: Path = typer.Option(..., "--data", help="Shard file (or a folder with one) from `shoal data split`."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML with [model] and [train]."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Override: section.key=value (repeatable)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda | cuda:N"),
    ca_cert: Optional[Path] = typer.Option(None, "--ca-cert", help="Trust only this CA (a private deployment)."),
    name: str = typer.Option("", "--name", help="Name for the logs (default: the shard's client id)."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Long-poll for work, train locally, upload the update; the data never leaves this node."""
    from shoal.cli import setup_logging
    from shoal.client.device import select_device
    from shoal.config import load_config
    from shoal.shards import load_shard
    from shoal.tls import client_context

    from .node import Node

    setup_logging(verbose)
    if not token_file.is_file():
        raise ConfigError(f"--token-file {str(token_file)!r} not found")
    token = token_file.read_text().strip()
    cfg = load_config(config, set_ or [])
    if server.startswith("https://"):
        ctx = client_context(ca_cert)
    elif server.startswith("http://"):
        ctx = None
    else:
        raise ConfigError(f"--server {server!r} must start with https:// (or http:// for an --insecure server)")
    node = Node(server, token, load_shard(data), cfg, select_device(device), ctx,
                poll_s=cfg.server.poll_s, name=name)
    raise typer.Exit(asyncio.run(node.run()))
