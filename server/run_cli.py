"""`shoal run`: submit runs to a federation and follow them (the researcher's side).

A thin client of the server's ``/v1/runs`` routes (docs/protocol.md, "Runs"), with the admin
token of server.admin_token_file or a researcher's token (federation.researcher_tokens_file).
The server, its CA and the token come from options or from SHOAL_SERVER, SHOAL_CA_CERT and
SHOAL_TOKEN_FILE.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import typer

from shoal.cli_help import as_written
from shoal.errors import ConfigError

app = typer.Typer(help="Submit runs to a federation server and follow them.", no_args_is_help=True)

ServerOpt = typer.Option(..., "--server", envvar="SHOAL_SERVER", help="The federation's URL, e.g. https://host:8443")
TokenOpt = typer.Option(
    ..., "--token-file", envvar="SHOAL_TOKEN_FILE", help="The admin token, or a researcher's token."
)
CaOpt = typer.Option(None, "--ca-cert", envvar="SHOAL_CA_CERT", help="Trust only this CA (a private deployment).")


CONNECT_S = 30.0  # a refused connection (the server still starting) is retried this long


class Api:
    """Requests to /v1/runs with the submitter's token; a refusal is one ConfigError line."""

    def __init__(self, server: str, token_file: Path, ca_cert: Path | None):
        from shoal.tls import client_context

        if not token_file.is_file():
            raise ConfigError(f"--token-file {str(token_file)!r} not found")
        self.url = server.rstrip("/")
        self.token = token_file.read_text().strip()
        self.ssl: ssl.SSLContext | None = client_context(ca_cert) if self.url.startswith("https://") else None

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Any:
        return json.loads(self.raw(method, path, body, timeout))

    def raw(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", **({"Content-Type": "application/json"} if data else {})},
        )
        try:
            return self._send(req, timeout)
        except urllib.error.HTTPError as e:
            try:
                info = json.loads(e.read())
                msg = f"{info.get('error')}: {info.get('detail')}"
            except ValueError:
                msg = e.reason
            raise ConfigError(f"the server refused {method} {path}: {e.code} {msg}") from None
        except (urllib.error.URLError, OSError) as e:
            raise ConfigError(f"cannot reach {self.url}: {getattr(e, 'reason', e)}") from None

    def _send(self, req: urllib.request.Request, timeout: float) -> bytes:
        end = time.monotonic() + CONNECT_S
        while True:
            try:
                with urllib.request.urlopen(req, timeout=timeout, context=self.ssl) as resp:
                    return resp.read()
            except urllib.error.URLError as e:  # a server still starting: retried for CONNECT_S
                if not isinstance(e.reason, ConnectionRefusedError) or time.monotonic() > end:
                    raise
                time.sleep(0.5)


@app.command("submit")
def submit(
    config: Path = typer.Option(
        ..., "--config", "-c", help=as_written("The run's TOML: [server] rounds, [train], [privacy] ...")
    ),
    task: str = typer.Option(..., "--task", "-t", help="The task, as the server and the nodes have it installed."),
    server: str = ServerOpt,
    token_file: Path = TokenOpt,
    ca_cert: Path | None = CaOpt,
) -> None:
    """Queue a run; prints its id. It starts when fewer than federation.max_runs train."""
    try:
        raw = tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {config}: {e}") from None
    out = Api(server, token_file, ca_cert).call("POST", "/v1/runs", {"task": task, "config": raw})
    typer.echo(out["run"])


@app.command("list")
def list_runs(server: str = ServerOpt, token_file: Path = TokenOpt, ca_cert: Path | None = CaOpt) -> None:
    """Every run: id, status, version of target, task."""
    for r in Api(server, token_file, ca_cert).call("GET", "/v1/runs")["runs"]:
        progress = f"{r['version']}/{r['rounds_target']}" if "version" in r else "-"
        reason = f"\t{r['reason']}" if r.get("reason") else ""
        typer.echo(f"{r['run']}\t{r['status']}\t{progress}\t{r['task']}{reason}")


@app.command("status")
def status(run: str, server: str = ServerOpt, token_file: Path = TokenOpt, ca_cert: Path | None = CaOpt) -> None:
    """A run's status as JSON: where it is, its nodes' answers (refusals with their reasons)."""
    typer.echo(json.dumps(Api(server, token_file, ca_cert).call("GET", f"/v1/runs/{run}"), indent=2))


@app.command("logs")
def logs(
    run: str,
    follow: bool = typer.Option(
        False, "--follow", "-f", help="Keep printing metrics as they come, until the run ends."
    ),
    server: str = ServerOpt,
    token_file: Path = TokenOpt,
    ca_cert: Path | None = CaOpt,
) -> None:
    """The run's metrics lines (JSON, as metrics.jsonl)."""
    api, after = Api(server, token_file, ca_cert), 0
    while True:
        wait = "&wait=20" if follow else ""
        out = api.call("GET", f"/v1/runs/{run}/metrics?after={after}{wait}", timeout=40)
        for line in out["lines"]:
            after = line.pop("seq")
            typer.echo(json.dumps(line))
        sys.stdout.flush()
        if not follow or (out["status"] not in ("queued", "running") and not out["lines"]):
            if follow:
                typer.echo(f"# {run} {out['status']}", err=True)
            return
        if not out["lines"]:
            time.sleep(0.2)


@app.command("stop")
def stop(run: str, server: str = ServerOpt, token_file: Path = TokenOpt, ca_cert: Path | None = CaOpt) -> None:
    """End a run now: the model stays at its last version; its nodes are told done."""
    out = Api(server, token_file, ca_cert).call("POST", f"/v1/runs/{run}/stop")
    typer.echo(f"{run} {out['status']}")


@app.command("pull")
def pull(
    run: str,
    out: Path = typer.Option(None, "--out", "-o", help="Folder to write (default: ./RUN)."),
    server: str = ServerOpt,
    token_file: Path = TokenOpt,
    ca_cert: Path | None = CaOpt,
) -> None:
    """The ended run's final model (model.safetensors), metrics.jsonl and summary.json."""
    from shoal.server.federation import PULLED

    api = Api(server, token_file, ca_cert)
    folder = out or Path(run)
    folder.mkdir(parents=True, exist_ok=True)
    for name in PULLED:
        (folder / name).write_bytes(api.raw("GET", f"/v1/runs/{run}/files/{name}", timeout=300))
    typer.echo(f"{run}: {', '.join(PULLED)} written to {folder}/")
