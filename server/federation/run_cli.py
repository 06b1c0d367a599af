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
        data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
        kind = "application/octet-stream" if isinstance(body, bytes) else "application/json"
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.token}", **({"Content-Type": kind} if data else {})},
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
    task: str = typer.Option(
        ...,
        "--task",
        "-t",
        help="The task, as the server and the nodes have it installed; with --bundle, its entry: file.py:name.",
    ),
    bundle: Path | None = typer.Option(
        None, "--bundle", help="Pack the task's folder (or .py file) as a signed bundle; or send a bundle file."
    ),
    key: Path | None = typer.Option(None, "--key", help="--bundle: the publisher key (`shoal bundle keygen`)."),
    server: str = ServerOpt,
    token_file: Path = TokenOpt,
    ca_cert: Path | None = CaOpt,
) -> None:
    """Queue a run; prints its id. It starts when fewer than federation.max_runs train. With
    --bundle the task travels, signed: nodes that trust the publisher key run it."""
    try:
        raw = tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {config}: {e}") from None
    api = Api(server, token_file, ca_cert)
    if bundle is not None:
        from shoal.bundle_cli import bundle_for_run

        blob = bundle_for_run(bundle, task, key, raw)
        task = api.call("POST", "/v1/runs/bundles", blob, timeout=120.0)["task"]
    out = api.call("POST", "/v1/runs", {"task": task, "config": raw})
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
    """The run's log on stderr (the server's events: submitted, started, waiting for nodes, ended
    and why; each node's answers and failures, `# TIME SOURCE: LINE`) and its metrics lines on
    stdout (JSON, as metrics.jsonl: `> run.jsonl` keeps them)."""
    api, after, events_after = Api(server, token_file, ca_cert), 0, 0
    while True:
        news = api.call("GET", f"/v1/runs/{run}/events?after={events_after}", timeout=40)
        for e in news["lines"]:
            events_after = e["seq"]
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(e["at"]))
            typer.echo(f"# {stamp} {e['source']}: {e['line']}", err=True)
        wait = "&wait=2" if follow else ""  # short: the log's lines are asked for between the waits
        out = api.call("GET", f"/v1/runs/{run}/metrics?after={after}{wait}", timeout=40)
        for line in out["lines"]:
            after = line.pop("seq")
            typer.echo(json.dumps(line))
        sys.stdout.flush()
        ended = out["status"] not in ("queued", "running") and not out["lines"] and not news["lines"]
        if not follow or ended:
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
    from shoal.server.federation.runs import PULLED

    api = Api(server, token_file, ca_cert)
    folder = out or Path(run)
    folder.mkdir(parents=True, exist_ok=True)
    for name in PULLED:
        (folder / name).write_bytes(api.raw("GET", f"/v1/runs/{run}/files/{name}", timeout=300))
    typer.echo(f"{run}: {', '.join(PULLED)} written to {folder}/")


@app.command("wait")
def wait(
    run: str,
    poll: float = typer.Option(2.0, "--poll", help="Seconds between status requests."),
    timeout: float = typer.Option(0.0, "--timeout", help="Give up after this many seconds (0: wait until it ends)."),
    server: str = ServerOpt,
    token_file: Path = TokenOpt,
    ca_cert: Path | None = CaOpt,
) -> None:
    """Wait until the run ends, with a progress bar of its rounds (and what it waits for); exit 0
    when it finished, 1 when it failed or was stopped (its reason on stderr)."""
    from shoal.progress import ProgressBar

    api = Api(server, token_file, ca_cert)
    end = time.monotonic() + timeout if timeout > 0 else float("inf")
    st = api.call("GET", f"/v1/runs/{run}")
    with ProgressBar(int(st.get("rounds_target") or 0), run) as bar:
        done = 0
        while st["status"] in ("queued", "running"):
            version = int(st.get("version") or 0)
            status = st.get("waiting_for") or st["status"]
            bar.advance(status[:100], max(0, version - done))
            done = max(done, version)
            if not bar.enabled:  # no terminal: one line when something changes
                line = f"{run} {st['status']} {version}/{st.get('rounds_target', '?')}: {status}"
                if line != getattr(bar, "last", None):
                    typer.echo(line, err=True)
                    bar.last = line  # type: ignore[attr-defined]
            if time.monotonic() > end:
                raise ConfigError(f"{run} is still {st['status']} after --timeout {timeout:g} s")
            time.sleep(max(0.2, poll))
            st = api.call("GET", f"/v1/runs/{run}")
        bar.advance(st["status"], max(0, int(st.get("version") or done) - done))
    reason = f": {st['reason']}" if st.get("reason") else ""
    typer.echo(f"{run} {st['status']} at version {st.get('version', '?')}{reason}", err=st["status"] != "finished")
    if st["status"] != "finished":
        raise typer.Exit(1)


@app.command("validate")
def validate(
    config: Path = typer.Option(..., "--config", "-c", help=as_written("The run's TOML, as for submit.")),
    task: str = typer.Option(..., "--task", "-t", help="The task, as the server has it installed."),
    nodes: int = typer.Option(
        0, "--nodes", help="The federation's registered nodes (N of central and distributed DP; 0: those checks skip)."
    ),
) -> None:
    """Check a run's config and task here, with the checks the server makes when it takes the run
    and when it starts it (the task loads, its model builds, DP and secure aggregation fit); nothing
    is sent."""
    import tempfile

    from shoal.assembly import task_from_config
    from shoal.config import Config
    from shoal.server.federation.runs import check_run_config, run_config, task_sha256
    from shoal.server.service import ServerService
    from shoal.task import load_task

    try:
        raw = tomllib.loads(config.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--config {config}: {e}") from None
    check_run_config(raw)
    digest = task_sha256(task)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = run_config(Config(), raw, task, Path(tmp))
        loaded = load_task(cfg.task.app, cfg.task.args) if cfg.task.app else task_from_config(cfg)
        ServerService.from_config(cfg, loaded, nodes or None)
    what = f"{nodes} nodes" if nodes else "no --nodes: checks that need N skipped"
    typer.echo(f"ok: {task} (sha256 {digest[:12]}), {cfg.server.rounds} rounds of {cfg.server.mode} ({what})")
