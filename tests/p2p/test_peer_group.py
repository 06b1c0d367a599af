"""Group averaging between peer services over real HTTPS on 127.0.0.1 (POST /group): an
exchange gives every peer the exact weighted average, a dead peer costs only its deadlines,
bad slices get 4xx and change nothing."""

from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
import pytest
import torch
from aiohttp import web

from shoal.client.training import LocalTrainer
from shoal.config import load_config
from shoal.models import build_model
from shoal.p2p.group_average import SliceMessage, group_id
from shoal.p2p.model_wire import encode_slice
from shoal.p2p.peer import Peer, PeerData, PeerSettings
from shoal.params import ParamSpec
from shoal.tls import client_context, make_private_ca, server_context

TOKEN = "group-token"


def _peer(i: int, sctx, cctx, *settings: str) -> Peer:
    cfg = load_config(None, ['gossip.algorithm="group_average"', "gossip.timeout=2.0", *settings])
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model("logreg", (30,), 5), cfg.train)
    g = torch.Generator().manual_seed(10 + i)
    x, y = torch.randn(20 + 10 * i, 30, generator=g), torch.randint(0, 5, (20 + 10 * i,), generator=g)
    peer = Peer(cfg, trainer, PeerData((x, y)), PeerSettings("https://127.0.0.1:0", (), TOKEN, False, sctx, cctx))
    base = torch.randn(peer.spec.numel, generator=torch.Generator().manual_seed(0))
    # a distinct model per peer, near the others as trained peers' are (within the default merge bound)
    peer.node.params.copy_(base + 0.3 * torch.randn(peer.spec.numel, generator=g))
    return peer


async def _serve(peer: Peer, ctx) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(peer.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    await site.start()
    url = f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    peer.node.membership.self_id = url
    return runner, url


async def _network(tmp_path, n: int, *settings: str):
    pki = make_private_ca(tmp_path)
    sctx, cctx = server_context(pki.cert, pki.key), client_context(pki.ca_cert)
    peers = [_peer(i, sctx, cctx, *settings) for i in range(n)]
    runners, urls = zip(*[await _serve(p, sctx) for p in peers])
    for p in peers:
        for u in urls:
            if u != p.node.id:
                p.node.membership.add(u)
        p._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=p.g.timeout))
    return peers, list(runners), list(urls), cctx


async def _close(peers, runners):
    for p in peers:
        await p._session.close()
    for r in runners:
        await r.cleanup()


@pytest.mark.timeout(60)
def test_an_exchange_over_https_gives_every_peer_the_weighted_average(tmp_path):
    async def main() -> None:
        peers, runners, urls, _ = await _network(tmp_path, 6, "gossip.group_size=3")  # a 2 x 3 grid
        w = torch.tensor([20.0 + 10 * i for i in range(6)], dtype=torch.float64)
        want = (w[:, None] * torch.stack([p.node.params.double() for p in peers])).sum(0) / w.sum()
        step = peers[0].wall_step()
        weights = await asyncio.gather(*[p.group_exchange(step, float(w[i])) for i, p in enumerate(peers)])
        for p, wt in zip(peers, weights):
            assert torch.allclose(p.node.params.double(), want, atol=1e-6)
            assert wt == pytest.approx(float(w.sum()))
            assert p.svc.group_stats["incomplete"] == 0 and p.svc.group_stats["exchanges"] == 1
        # two levels (2 and 3 members): 2 (1 + 2) slice messages per peer, about 2 (1 - 1/6) models
        model = peers[0].spec.nbytes
        for p in peers:
            assert 2 * 5 / 6 * model < p.svc.bytes_sent < 2 * 5 / 6 * model + 6 * 1200
        await _close(peers, runners)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_dead_peer_costs_its_deadlines_and_the_others_agree(tmp_path):
    async def main() -> None:
        peers, runners, urls, _ = await _network(tmp_path, 4, "gossip.group_size=4", "gossip.timeout=1.0")
        await runners[3].cleanup()  # peer 3 is gone: its port refuses connections
        live = peers[:3]
        step = peers[0].wall_step()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*[p.group_exchange(step, 1.0) for p in live])
        assert loop.time() - t0 < 3 * 1.0 + 1.0
        want = torch.stack([p.node.params for p in live]).mean(0)  # (after the exchange all hold it)
        for p in live:
            assert torch.equal(p.node.params, live[0].node.params)
            assert p.svc.group_stats["incomplete"] == 1
            assert urls[3] in p.node.membership.suspected() or urls[3] not in p.node.membership.known
        assert torch.allclose(live[0].node.params, want)
        await _close(peers, runners[:3])

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_bad_slices_are_refused_and_change_nothing(tmp_path):
    async def main() -> None:
        peers, runners, urls, cctx = await _network(tmp_path, 2, "gossip.group_size=2")
        a, b = peers
        step = a.wall_step()
        members = tuple(sorted(urls))
        target = b.node.id
        sender = a.node.id
        idx = members.index(target)
        n = b.spec.numel
        lo, hi = idx * n // 2, (idx + 1) * n // 2
        good = SliceMessage(
            sender, target, step, group_id(step, members), members, idx, "part", 1.0, torch.ones(hi - lo)
        )
        other = ParamSpec.of(build_model("logreg", (31,), 5))
        nan = torch.ones(hi - lo)
        nan[0] = float("nan")
        before = b.node.params.clone()
        cases = {
            "garbage": (b"\x00garbage", 400, "malformed"),
            "other spec": (encode_slice(good, other), 400, "spec_mismatch"),
            "NaN": (encode_slice(dataclasses.replace(good, data=nan), b.spec), 400, "non_finite"),
            "too long": (encode_slice(dataclasses.replace(good, data=torch.ones(n + 1)), b.spec), 400, "malformed"),
            "not for b": (encode_slice(dataclasses.replace(good, target="https://x:1"), b.spec), 400, "malformed"),
            "old round": (encode_slice(dataclasses.replace(good, round=step - 100), b.spec), 409, "stale_round"),
            "oversized": (b"\0" * (b.max_bytes + 1), 413, None),
        }
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
            for name, (body, status, code) in cases.items():
                async with s.post(target + "/group", data=body, headers=auth, ssl=cctx) as r:
                    assert r.status == status, name
                    if code:
                        assert (await r.json())["error"] == code, name
            async with s.post(target + "/group", data=encode_slice(good, b.spec), ssl=cctx) as r:
                assert r.status == 401
            # an exchange is open at b: a slice of another group is refused by the protocol
            task = asyncio.get_running_loop().create_task(b.group_exchange(step, 1.0))
            await asyncio.sleep(0.2)
            wrong = dataclasses.replace(
                good, members=(sender, "https://127.0.0.1:9"), group=group_id(step, (sender, "https://127.0.0.1:9"))
            )
            async with s.post(target + "/group", data=encode_slice(wrong, b.spec), headers=auth, ssl=cctx) as r:
                assert r.status == 409 and (await r.json())["error"] == "not_in_group"
            await task  # a never answers: b's exchange ends at its deadlines
        assert torch.equal(b.node.params, before) and b.svc.rejected == 6
        await _close(peers, runners)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_dpsgd_peers_mix_over_https_and_keep_the_sum(tmp_path):
    async def main() -> None:
        peers, runners, urls, _ = await _network(
            tmp_path, 4, 'gossip.algorithm="dpsgd"', "gossip.degree=2", "gossip.period=1.0"
        )
        before = torch.stack([p.node.params.clone() for p in peers])
        step = peers[0].wall_step() + 1
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[p.dpsgd_step(step, loop.time() + 1.5) for p in peers])
        after = torch.stack([p.node.params for p in peers])
        edges = sum(len(p.svc.mixing[step].neighbours) for p in peers)
        assert edges >= 2 and edges % 2 == 0  # every edge is mixed on both sides
        assert torch.allclose(after.sum(0), before.sum(0), atol=1e-4)
        assert not torch.equal(after, before)
        await _close(peers, runners)

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_secure_group_over_https_gives_every_member_the_weighted_average_and_a_dead_member_drops_out(tmp_path):
    async def main() -> None:
        peers, runners, urls, _ = await _network(
            tmp_path,
            5,
            'gossip.algorithm="secure_groups"',
            "gossip.group_size=5",
            "gossip.period=8.0",
            "secure_aggregation.bits=20",
        )
        for p in peers:  # the initial model is shared; each peer's model moved from it by a small offset
            p.svc.init.copy_(peers[0].svc.init)
            p.node.params.copy_(
                p.svc.init + 0.1 * torch.randn(p.spec.numel, generator=torch.Generator().manual_seed(len(p.node.id)))
            )
        from shoal.p2p.grid_average import grid_path

        step = peers[0].wall_step()
        relay = grid_path(urls, urls[0], step, 5, 1)[0][0]  # the group's first member relays
        dead = next(i for i in range(5) if urls[i] != relay)
        await runners[dead].cleanup()  # one member is gone: its port refuses connections
        live = [p for i, p in enumerate(peers) if i != dead]
        w = torch.tensor([float(20 + 10 * i) for i in range(5) if i != dead])
        offsets = torch.stack([(p.node.params - p.svc.init).clamp(-1, 1) for p in live])
        want = peers[0].svc.init + (w[:, None] * offsets).sum(0) / w.sum()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[p.secure_exchange(step, loop.time() + 6.0) for p in live])
        for p in live:
            assert p.svc.secure_stats["averaged"] == 1, p.svc.secure_stats
            assert torch.allclose(p.node.params, want, atol=1e-4)
        assert all(p.svc.bytes_sent > 4 * p.spec.numel for p in live)  # at least the masked vector
        await _close(peers, [r for i, r in enumerate(runners) if i != dead])

    asyncio.run(main())
