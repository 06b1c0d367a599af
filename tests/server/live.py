"""An aggregator on 127.0.0.1 inside the test's event loop (real sockets, real aiohttp)."""

from __future__ import annotations

import asyncio
import secrets
import ssl
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from shoal.config import config_from_dict
from shoal.pki import write_secret
from shoal.server.app import make_app, run_clock
from shoal.server.registry import Registry
from shoal.server.service import ServerService
from shoal.server.store import open_service

ADMIN = "admin"  # Live.session(ADMIN): the admin token of server.admin_token_file (GET /v1/status, /metrics)


def small_config(tmp: Path, sections: dict | None = None, **server):
    """Logistic regression on Synthetic(1,1), 5 clients: builds in milliseconds.
    ``server`` keys go to [server]; ``sections`` adds other tables."""
    data = {
        "simulation": {"seed": 1, "num_clients": 5},
        "data": {"dataset": "synthetic"},
        "model": {"name": "logreg"},
        "train": {"batch_size": 10, "lr": 0.05},
        "server": {
            "checkpoint_dir": str(tmp / "ck"),
            "db": str(tmp / "nodes.sqlite"),
            "out_dir": str(tmp / "run"),
            "eval": False,
            "rounds": 5,
            **server,
        },
    }
    return config_from_dict({**data, **(sections or {})}).validate()


@dataclass
class Live:
    url: str
    service: ServerService
    registry: Registry
    tokens: dict[str, str]
    app: web.Application

    def session(self, node: str | None, **kw) -> aiohttp.ClientSession:
        """Requests as ``node`` (its token), as the admin (``ADMIN``), or with no token (None)."""
        token = self.tokens[node] if node else None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=20), **kw)


@asynccontextmanager
async def live_server(
    tmp: Path,
    nodes: list[str],
    ssl_context: ssl.SSLContext | None = None,
    clock: bool = False,
    sections: dict | None = None,
    **server,
):
    """``clock=True`` runs the server's clock (rounds open and close by themselves);
    without it the test drives ``service.tick`` itself."""
    admin = secrets.token_urlsafe(32)
    write_secret(tmp / "admin.token", admin.encode())
    cfg = small_config(tmp, sections, **{"admin_token_file": str(tmp / "admin.token"), **server})
    registry = Registry(cfg.server.db)
    tokens = {n: registry.add(n) for n in nodes}
    tokens[ADMIN] = admin
    service = open_service(cfg)
    app = make_app(service, registry)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=cfg.server.idle_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
    await site.start()
    port = runner.addresses[0][1]
    scheme = "https" if ssl_context else "http"
    stop = asyncio.Event()
    ticker = asyncio.ensure_future(run_clock(app, stop)) if clock else None
    try:
        yield Live(f"{scheme}://127.0.0.1:{port}", service, registry, tokens, app)
    finally:
        stop.set()
        if ticker is not None:
            await ticker
        await runner.cleanup()
        registry.close()
