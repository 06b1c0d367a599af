"""A gossip peer's page over real HTTP on 127.0.0.1: behind its network token, its steps and
metric curve from its metrics records, its view and directory."""

from __future__ import annotations

import asyncio

import aiohttp
import torch
from aiohttp import web

from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.models import build_model
from shoal.p2p.peer import Peer, PeerData, PeerSettings
from shoal.web.dashboard import COOKIE, CSP

from .events import assert_events_match_metrics

TOKEN = "peer-network-token-of-this-test"
NEIGHBOUR = "http://127.0.0.1:9"  # never answers: the page shows it in the view


def test_peer_page_behind_its_token(tmp_path):
    torch.manual_seed(0)
    cfg = Config()
    cfg.output.tensorboard = True  # a peer's --out gets event files too
    trainer = LocalTrainer(build_model("logreg", (60,), 10), cfg.train)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 60, generator=g), torch.randint(0, 10, (40,), generator=g)
    settings = PeerSettings("http://127.0.0.1:1", (NEIGHBOUR,), TOKEN, True, out_dir=tmp_path)
    peer = Peer(cfg, trainer, PeerData((x, y), (x, y)), settings)

    async def main() -> None:
        runner = web.AppRunner(peer.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            for _ in range(2):
                await peer.local_step()
                await peer.evaluate()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
                async with http.get(url + "/", allow_redirects=False) as resp:
                    assert resp.status == 303 and resp.headers["Location"] == "/login"
                async with http.get(url + "/v1/dashboard/runs") as resp:
                    assert resp.status == 401 and resp.headers["Content-Security-Policy"] == CSP
                async with http.get(url + "/status") as resp:  # the peer's own routes keep their token check
                    assert resp.status == 401
                form, origin = {"token": TOKEN}, {"Origin": url}
                async with http.post(url + "/login", data=form, headers=origin, allow_redirects=False) as resp:
                    assert resp.status == 303 and resp.headers["Location"] == "/"
                    line = resp.headers["Set-Cookie"]
                session = {"Cookie": line.split(";", 1)[0]}
                assert line.startswith(COOKIE + "=") and "HttpOnly" in line and "SameSite=Strict" in line
                async with http.get(url + "/", headers=session) as resp:
                    assert resp.status == 200 and "dashboard.js" in await resp.text()
                async with http.get(url + "/v1/dashboard/runs", headers=session) as resp:
                    body = await resp.json()
                assert body["kind"] == "peer"
                (run,) = body["runs"]
                assert (run["run"], run["round"], run["mode"]) == ("peer", 2, "gossip: gossip")
                async with http.get(url + "/v1/dashboard/runs/peer", headers=session) as resp:
                    detail = await resp.json()
                records = peer.metrics.records
                assert detail["metrics"]["local_test_accuracy"] == [
                    [r["round"], r["local_test_accuracy"]] for r in records
                ]
                assert detail["traffic"]["bytes_up"] == peer.svc.bytes_sent
                async with http.get(url + "/v1/dashboard/nodes", headers=session) as resp:
                    nodes = (await resp.json())["nodes"]
                assert [(n["name"], n["in_view"]) for n in nodes] == [(NEIGHBOUR, True)]
                async with http.post(url + "/login", data={"token": "wrong"}, headers=origin) as resp:
                    assert str(resp.url).endswith("/login?failed=1")
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(main(), 60))
    assert_events_match_metrics(tmp_path, ("local_test_accuracy", "bytes_sent"))
