"""`shoal server`: run the aggregator; `shoal server nodes add|list|revoke` manage nodes."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import time
from pathlib import Path

import typer

from shoal.cli_help import as_written
from shoal.config import Config, load_config
from shoal.errors import ConfigError

log = logging.getLogger(__name__)

app = typer.Typer(
    help="Run the aggregator server and manage its nodes.",
    invoke_without_command=True,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
)
nodes_app = typer.Typer(help="The node registry: add, list, revoke.", no_args_is_help=True)
app.add_typer(nodes_app, name="nodes")
tasks_app = typer.Typer(
    help="The federation's task registry: the tasks runs may name (add, list, remove).", no_args_is_help=True
)
app.add_typer(tasks_app, name="tasks")

ConfigOpt = typer.Option(None, "--config", "-c", help=as_written("TOML config with a [server] table."))
SetOpt = typer.Option(None, "--set", help="Override one config value: section.key=value (repeatable).")
DbOpt = typer.Option(None, "--db", help="Node database (default: server.db of the config).")
TaskOpt = typer.Option(
    None,
    "--task",
    "-t",
    help=as_written(
        "Your task: path/to/file.py:name or package.module:name "
        "(default: [task] app, else the built-in task of [model] + [data]); the nodes use the same."
    ),
)


def _db(config: Path | None, set_: list[str] | None, db: Path | None) -> Path:
    return db or Path(load_config(config, set_ or []).server.db)


def run_server(cfg: Config, insecure: bool = False, fresh: bool = False) -> None:
    from shoal.assembly import task_from_config
    from shoal.tls import server_context

    from .app import serve
    from .registry import Registry
    from .store import open_service

    s = cfg.server
    task = None if cfg.federation.enabled else task_from_config(cfg)  # a task that does not load is one line
    if s.tls_cert:
        ctx = server_context(s.tls_cert, s.tls_key, s.tls_client_ca or None)
    elif insecure:
        ctx = None
        log.warning("--insecure: serving plain HTTP; tokens and updates travel unencrypted")
    else:
        raise ConfigError(
            "server.tls_cert / server.tls_key are not set: give a certificate, "
            "or pass --insecure for plain HTTP on a trusted network"
        )
    registry = Registry(s.db)
    try:
        if cfg.hierarchy.parent:  # an edge aggregator under that root (server/edge/app.py)
            from .edge.app import serve_edge

            asyncio.run(serve_edge(cfg, registry, ctx, task=task))
            return
        if cfg.federation.enabled:
            _serve_federation(cfg, registry, ctx, fresh)
            return
        service = open_service(cfg, resume=not fresh, task=task, started_at=time.monotonic())
        asyncio.run(serve(service, registry, ctx))
    finally:
        registry.close()


def _serve_federation(cfg: Config, registry, ctx, fresh: bool) -> None:
    """[federation] enabled: host the runs submitted with `shoal run submit`, resuming the running ones."""
    from pathlib import Path

    from .app import serve
    from .federation.runs import Federation
    from .federation.runs_db import RunsDB

    if fresh:
        raise ConfigError("--fresh is for a one-run server; a federation's runs are stopped with `shoal run stop`")
    db = RunsDB(Path(cfg.federation.dir) / "runs.sqlite")
    try:
        fed = Federation(cfg, db, registered=lambda: sum(1 for n in registry.list() if n.enabled))
        try:
            asyncio.run(serve(fed, registry, ctx))
        finally:
            fed.close()
    finally:
        db.close()


@app.callback()
def server(
    ctx: typer.Context,
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    task: str | None = TaskOpt,
    insecure: bool = typer.Option(False, "--insecure", help="Serve plain HTTP (no TLS). Warns."),
    fresh: bool = typer.Option(False, "--fresh", help="Ignore existing checkpoints and start at version 0."),
    parent: str | None = typer.Option(
        None,
        "--parent",
        help="Run as an edge aggregator under the root at this URL (hierarchy.parent; docs/hierarchy.md).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Serve rounds over HTTPS until server.rounds versions are made; resumes from the latest checkpoint.

    With federation.enabled = true it serves until stopped and hosts the runs submitted with
    `shoal run submit` (several at once), resuming every running run after a restart.

    The model is the task's (--task); the server loads no data unless the task gives
    central_test_data() (evaluated each version when server.eval is true)."""
    if ctx.invoked_subcommand is not None:
        return
    from shoal.cli_common import setup_logging, with_task

    setup_logging(verbose)
    sets = with_task(set_, task)
    if parent is not None:
        sets = [*sets, f"hierarchy.parent={json.dumps(parent)}"]
    run_server(load_config(config, sets), insecure=insecure, fresh=fresh)


@nodes_app.command("add")
def nodes_add(
    name: str,
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    db: Path | None = DbOpt,
    token_file: Path | None = typer.Option(
        None, "--token-file", help="Write the token to this file (mode 0600) instead of printing it."
    ),
    csr: Path | None = typer.Option(
        None,
        "--csr",
        help="Enroll by key: the node's NAME.csr from `shoal pki node-key`; its public key is "
        "registered and the CA of --ca-dir signs the node's certificate. No token.",
    ),
    ca_dir: Path | None = typer.Option(None, "--ca-dir", help="With --csr: the folder of ca.pem and ca.key."),
    cert_out: Path | None = typer.Option(
        None, "--cert-out", help="With --csr: where the node's certificate goes (default: NAME.pem beside the CSR)."
    ),
    days: int = typer.Option(825, "--days", help="With --csr: days the node's certificate is valid."),
) -> None:
    """Register NAME: print its token (shown only this once), or with --csr enroll its key."""
    import os

    from shoal.pki import fingerprint, load_ca, read_node_csr, sign_node

    from .registry import Registry

    if csr is None and (ca_dir is not None or cert_out is not None):
        raise ConfigError("--ca-dir and --cert-out go with --csr (enrollment by key)")
    if csr is not None:
        if token_file is not None:
            raise ConfigError("--token-file and --csr exclude each other: a node has a token or a key")
        if ca_dir is None:
            raise ConfigError("--csr needs --ca-dir: the folder of the CA (ca.pem, ca.key) that signs node certs")
        request = read_node_csr(csr, name)
        load_ca(ca_dir)  # checked before the node is registered
        reg = Registry(_db(config, set_, db))
        try:
            reg.add_key(name, fingerprint(request))
        finally:
            reg.close()
        out = sign_node(ca_dir, request, name, cert_out or csr.with_suffix(".pem"), days)
        typer.echo(
            f"node {name!r} enrolled by key {fingerprint(request)}; give it {out} and {ca_dir / 'ca.pem'} "
            "(both public); set server.tls_client_ca to that ca.pem"
        )
        return
    fd = None
    if token_file is not None:  # opened before the node is registered: a token is never lost
        token_file.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"--token-file {str(token_file)!r} exists: give a new file") from None
    reg = Registry(_db(config, set_, db))
    try:
        token = reg.add(name)
    except ConfigError:
        if fd is not None and token_file is not None:
            os.close(fd)
            token_file.unlink()
        raise
    finally:
        reg.close()
    if fd is None or token_file is None:
        typer.echo(token)
        return
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    typer.echo(f"node {name!r} added; its token is in {token_file} (mode 0600)")


@nodes_app.command("list")
def nodes_list(config: Path | None = ConfigOpt, set_: list[str] | None = SetOpt, db: Path | None = DbOpt) -> None:
    """Registered nodes: name, enabled, last seen (UTC)."""
    from .registry import Registry

    reg = Registry(_db(config, set_, db))
    try:
        for n in reg.list():
            seen = (
                dt.datetime.fromtimestamp(n.last_seen, dt.UTC).isoformat(timespec="seconds") if n.last_seen else "never"
            )
            how = f"key {n.key}" if n.key else "token"
            typer.echo(f"{n.name}\t{'enabled' if n.enabled else 'revoked'}\t{seen}\t{how}")
    finally:
        reg.close()


@nodes_app.command("revoke")
def nodes_revoke(
    name: str, config: Path | None = ConfigOpt, set_: list[str] | None = SetOpt, db: Path | None = DbOpt
) -> None:
    """Disable NAME: its token gets 403 from now on."""
    from .registry import Registry

    reg = Registry(_db(config, set_, db))
    try:
        reg.revoke(name)
        typer.echo(f"revoked {name}")
    finally:
        reg.close()


@app.command("admin-token")
def admin_token(
    path: Path = typer.Argument(..., help="File to write; set server.admin_token_file to it."),
    force: bool = typer.Option(False, "--force", help="Replace an existing file."),
) -> None:
    """Make the admin token of GET /v1/status and /metrics (readable by this user only)."""
    import os
    import secrets

    if path.exists() and not force:
        raise ConfigError(f"{path} exists: pass --force to replace the admin token")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    typer.echo(
        f'admin token written to {path}; set server.admin_token_file = "{path}" and send it as '
        "'Authorization: Bearer <token>' to /v1/status and /metrics"
    )


@app.command("researcher-token")
def researcher_token(
    name: str = typer.Argument(..., help="The researcher's name (shown as the submitter of their runs)."),
    tokens_file: Path = typer.Option(
        ..., "--tokens-file", help="The federation.researcher_tokens_file to add NAME to (made with mode 0600)."
    ),
    token_out: Path | None = typer.Option(
        None,
        "--token-out",
        help="Write NAME's token here (mode 0600, for `shoal run --token-file`) instead of printing it.",
    ),
    remove: bool = typer.Option(
        False, "--remove", help="Take NAME out of the file instead (their token stops working)."
    ),
) -> None:
    """Add a researcher to the tokens file of federation.researcher_tokens_file (or --remove one).

    The file holds lines of NAME TOKEN and is rewritten atomically with mode 0600; the server reads
    it when it starts (restart it after a change)."""
    from .federation.researchers import add_researcher, remove_researcher

    if remove:
        if token_out is not None:
            raise ConfigError("--token-out goes with adding a researcher, not with --remove")
        remove_researcher(tokens_file, name)
        typer.echo(f"researcher {name!r} removed from {tokens_file}; restart the server to apply it")
        return
    token = add_researcher(tokens_file, name, token_out)
    where = f"their token is in {token_out} (mode 0600)" if token_out is not None else "their token (shown once):"
    typer.echo(
        f'researcher {name!r} added to {tokens_file}; set federation.researcher_tokens_file = "{tokens_file}" '
        f"and restart the server; {where}"
    )
    if token_out is None:
        typer.echo(token)


def _registry_file(config: Path | None, set_: list[str] | None) -> Path:
    from .task_registry import REGISTRY_FILE

    return Path(load_config(config, set_ or []).federation.dir) / REGISTRY_FILE


@tasks_app.command("add")
def tasks_add(
    name: str = typer.Argument(..., help="The name runs give the task (`shoal run submit --task NAME`)."),
    ref: str = typer.Argument(..., help="The task on this machine: path/to/file.py:name or package.module:name."),
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
) -> None:
    """Register a task runs may name, pinned by the SHA-256 of its source now (run it again after
    changing the source: a run naming a changed task is refused until then)."""
    from .task_registry import add_task

    path = _registry_file(config, set_)
    entry = add_task(path, name, ref)
    typer.echo(f"task {entry.name!r} -> {entry.ref} (sha256 {entry.sha256}) registered in {path}")
    typer.echo(f'nodes allow it with [[tasks]] name = "{entry.name}", sha256 = "{entry.sha256}" and their own ref')


@tasks_app.command("list")
def tasks_list(config: Path | None = ConfigOpt, set_: list[str] | None = SetOpt) -> None:
    """Every task runs may name: NAME, where it comes from, its pin and reference."""
    from .task_registry import TaskRegistry

    cfg = load_config(config, set_ or [])
    for e in TaskRegistry(_registry_file(config, set_), cfg.federation.tasks).entries().values():
        typer.echo(f"{e.name}\t{e.source}\t{e.sha256[:16]}\t{e.ref}")


@tasks_app.command("remove")
def tasks_remove(
    name: str = typer.Argument(..., help="The registered task's name."),
    config: Path | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
) -> None:
    """Unregister a task: new runs naming it are refused, and so is a queued run when it would start."""
    from .task_registry import remove_task

    path = _registry_file(config, set_)
    remove_task(path, name)
    typer.echo(f"task {name!r} removed from {path}")
