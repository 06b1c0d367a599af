"""A federation server and node daemons inside the test's event loop (real sockets, real aiohttp,
real training): the run loop's behaviour without process start-up costs."""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from aiohttp import web

from shoal.client.daemon import NodeDaemon
from shoal.client.node_config import load_node_config, source_sha256
from shoal.config import config_from_dict
from shoal.pki import write_secret
from shoal.server.app import run_clock
from shoal.server.federation.routes import make_federation_app
from shoal.server.federation.runs import Federation
from shoal.server.federation.runs_db import RunsDB
from shoal.server.registry import Registry
from tests.server.task_files import write_node_data, write_task

NODE_TOML = """
[node]
server = "{url}"
token_file = "{token_file}"
name = "{name}"
device = "cpu"
state_dir = "{state}"
poll_s = 0.3

[limits]
max_epochs = {max_epochs}

[[tasks]]
ref = "{ref}"
sha256 = "{sha}"
data = "{data}"
"""


@dataclass
class LiveFederation:
    url: str
    fed: Federation
    registry: Registry
    admin: str
    tmp: Path
    task_ref: str
    daemons: dict[str, NodeDaemon] = field(default_factory=dict)
    runners: dict[str, asyncio.Task] = field(default_factory=dict)

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.admin}"}, timeout=aiohttp.ClientTimeout(total=20)
        )

    async def submit(self, config: dict) -> str:
        async with (
            self.session() as s,
            s.post(self.url + "/v1/runs", json={"task": self.task_ref, "config": config}) as r,
        ):
            body = await r.json()
            assert r.status == 201, body
            return body["run"]

    async def status(self, run: str) -> dict:
        async with self.session() as s, s.get(f"{self.url}/v1/runs/{run}") as r:
            return await r.json()

    async def wait_ended(self, run: str, timeout: float) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = await self.status(run)
            if st["status"] not in ("queued", "running"):
                return st
            await asyncio.sleep(0.1)
        raise AssertionError(f"{run} did not end in {timeout} s: {await self.status(run)}")

    def start_node(self, name: str, max_epochs: int = 10, sha: str | None = None) -> NodeDaemon:
        """A daemon allowing the regression task (pinned by ``sha``, default its true hash)."""
        data = write_node_data(self.tmp / f"{name}.pt", seed=int(name[-1]) + 1)
        toml = self.tmp / f"{name}.toml"
        toml.write_text(
            NODE_TOML.format(
                url=self.url,
                token_file=self.tmp / f"{name}.token",
                name=name,
                state=self.tmp / f"{name}-state",
                max_epochs=max_epochs,
                ref=self.task_ref,
                sha=sha or source_sha256(self.task_ref),
                data=data,
            )
        )
        cfg = load_node_config(toml)
        assert cfg.token_file is not None
        daemon = NodeDaemon(cfg, cfg.token_file.read_text().strip(), torch.device("cpu"), None)
        self.daemons[name] = daemon
        self.runners[name] = asyncio.ensure_future(daemon.run())
        return daemon


@asynccontextmanager
async def live_federation(
    tmp: Path,
    nodes: list[str],
    researchers: dict[str, str] | None = None,
    federation: dict | None = None,
    **server,
):
    """A federation on 127.0.0.1 with the regression task of tests/server/task_files.py installed
    and registered (federation.tasks, by its reference); ``researchers``: name -> token of
    federation.researcher_tokens_file; ``federation``: more [federation] keys (floors)."""
    torch.set_num_threads(1)
    admin = secrets.token_urlsafe(32)
    write_secret(tmp / "admin.token", admin.encode())
    task = write_task(tmp / "tasks")
    cfg = config_from_dict(
        {
            "server": {
                "db": str(tmp / "nodes.sqlite"),
                "admin_token_file": str(tmp / "admin.token"),
                **server,
            },
            "federation": {
                "enabled": True,
                "dir": str(tmp / "fed"),
                "max_runs": 2,
                "researcher_tokens_file": str(tmp / "researchers") if researchers else "",
                "tasks": [f"{task}:Regression"],
                **(federation or {}),
            },
        }
    ).validate()
    if researchers:
        (tmp / "researchers").write_text("".join(f"{n} {t}\n" for n, t in researchers.items()))
    registry = Registry(cfg.server.db)
    for n in nodes:
        write_secret(tmp / f"{n}.token", registry.add(n).encode())
    db = RunsDB(tmp / "fed" / "runs.sqlite")
    fed = Federation(cfg, db, registered=lambda: sum(1 for n in registry.list() if n.enabled))
    app = make_federation_app(fed, registry)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    stop = asyncio.Event()
    clock = asyncio.ensure_future(run_clock(app, stop))
    live = LiveFederation(url, fed, registry, admin, tmp, f"{task}:Regression")
    try:
        yield live
    finally:
        for d in live.daemons.values():
            d.stop.set()
        if live.runners:
            await asyncio.wait(list(live.runners.values()), timeout=20)
        stop.set()
        await clock
        await runner.cleanup()
        fed.close()
        registry.close()
        db.close()


@dataclass
class ServedFederation:
    url: str
    fed: Federation
    registry: Registry
    tokens: dict[str, str]  # node -> token, and "admin" -> the admin token
    app: web.Application


@asynccontextmanager
async def served_federation(
    tmp: Path,
    nodes: list[str],
    run: dict,
    ssl_context=None,
    researchers: dict[str, str] | None = None,
    federation: dict | None = None,
    **server,
):
    """A federation on 127.0.0.1 with one built-in-task run already started (``run``: its config);
    no clock: the test drives ``fed.tick`` or the run's ``tick`` itself (the fuzzer does).
    ``researchers``: name -> token; ``federation``: more [federation] keys."""
    admin = secrets.token_urlsafe(32)
    write_secret(tmp / "admin.token", admin.encode())
    if researchers:
        write_secret(tmp / "researchers", "".join(f"{n} {t}\n" for n, t in researchers.items()).encode())
    cfg = config_from_dict(
        {
            "server": {"db": str(tmp / "nodes.sqlite"), "admin_token_file": str(tmp / "admin.token"), **server},
            "federation": {
                "enabled": True,
                "dir": str(tmp / "fed"),
                "researcher_tokens_file": str(tmp / "researchers") if researchers else "",
                **(federation or {}),
            },
        }
    ).validate()
    registry = Registry(cfg.server.db)
    tokens = {n: registry.add(n) for n in nodes}
    tokens["admin"] = admin
    db = RunsDB(tmp / "fed" / "runs.sqlite")
    fed = Federation(cfg, db, registered=lambda: len(nodes))
    fed.submit("builtin", run, "admin", time.monotonic())
    fed.tick(time.monotonic())
    app = make_federation_app(fed, registry)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    scheme = "https" if ssl_context else "http"
    try:
        yield ServedFederation(f"{scheme}://127.0.0.1:{runner.addresses[0][1]}", fed, registry, tokens, app)
    finally:
        await runner.cleanup()
        fed.close()
        registry.close()
        db.close()
