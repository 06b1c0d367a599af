"""POST /v1/partial on a root on 127.0.0.1 (real sockets): edges' partials close the round into the
flat mean, a retransmit is answered as a duplicate, a node cannot send a partial, hostile and
oversized bodies get a 4xx and the server keeps serving."""

from __future__ import annotations

import asyncio
import time

import torch

from shoal.aggregation.partial import Accumulator, encode_partial
from shoal.update import Update

from ..server.live import live_server

NODES = [f"n{i}" for i in range(6)]
EDGES = {"edge-a": NODES[:4], "edge-b": NODES[4:]}


async def edge_poll(live, edge: str, nodes: list[str]) -> dict:
    """POST /v1/edge/poll: ``edge`` names its connected nodes (no wait)."""
    async with (
        live.session(edge) as http,
        http.post(live.url + "/v1/edge/poll", params={"wait": "0"}, json={"nodes": nodes}) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


def test_edges_post_partials_over_http(tmp_path) -> None:
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path) -> None:
    sections = {"hierarchy": {"edge_names": list(EDGES)}}
    async with live_server(tmp_path, [*NODES, *EDGES], sections=sections, clients_per_round=6, min_nodes=6) as live:
        svc = live.service
        for edge, nodes in EDGES.items():  # the edges name their nodes; the root counts them connected
            answer = await edge_poll(live, edge, nodes)
            assert answer["status"] == "wait" and answer["nodes"] == len(nodes)
        now = time.monotonic()
        svc.tick(now)  # the last poll's own tick may have opened it
        assert svc.sync is not None and svc.sync.open
        works = {n: svc.poll(n, now) or {} for n in NODES}
        answer = await edge_poll(live, "edge-a", ["n0", "n1", "n2", "n3", "n4"])  # n4 is edge-b's
        assert answer["status"] == "work" and sorted(answer["tasks"]) == EDGES["edge-a"]
        assert answer["refused"] == {"n4": "not_claimable"}
        assert answer["tasks"]["n0"] == works["n0"]["seed"]
        async with live.session("n0") as http, http.post(live.url + "/v1/edge/poll", json={"nodes": []}) as r:
            assert r.status == 403  # a node is no edge
        g0 = svc.rounds.global_params.clone()
        ups = {
            n: Update(torch.randn(svc.spec.numel, generator=torch.Generator().manual_seed(i)) * 0.01, 3 + i, 0, n)
            for i, n in enumerate(NODES)
        }

        def body(edge: str, nodes: list[str]) -> bytes:
            acc = Accumulator(works[nodes[0]]["round"], 0, svc.spec.numel)
            for n in nodes:
                acc.add_update(ups[n])
            return encode_partial(acc.partial().sealed(edge), svc.spec.hash)

        async def post(who: str, data: bytes) -> tuple[int, dict]:
            async with live.session(who) as http, http.post(live.url + "/v1/partial", data=data) as r:
                return r.status, await r.json()

        status, answer = await post("edge-a", body("edge-a", EDGES["edge-a"]))
        assert (status, answer["status"], answer["nodes"]) == (200, "accepted", 4)
        status, answer = await post("edge-a", body("edge-a", EDGES["edge-a"]))  # the retransmit
        assert (status, answer["status"]) == (200, "duplicate")
        status, answer = await post("n5", body("n5", ["n5"]))  # a node speaking for itself as an edge
        assert (status, answer["error"]) == (403, "not_an_edge")
        status, answer = await post("edge-b", b"not a partial at all")
        assert (status, answer["error"]) == (400, "malformed")
        status, answer = await post("edge-b", bytes(svc.spec.numel * 8 + (2 << 20)))
        assert (status, answer["error"]) == (413, "too_large")
        status, answer = await post("edge-b", body("edge-b", ["n3", *EDGES["edge-b"]]))  # n3 is edge-a's
        assert (status, answer["error"]) == (409, "not_your_node")
        assert svc.version == 0 and svc.sync is not None and svc.sync.received == set(EDGES["edge-a"])
        status, answer = await post("edge-b", body("edge-b", EDGES["edge-b"]))
        assert (status, answer["status"]) == (200, "accepted")
        assert svc.version == 1  # every selected node is in: the request's tick closed the round
        w = torch.tensor([float(u.num_examples) for u in ups.values()], dtype=torch.float64)
        mean = (torch.stack([u.delta.double() for u in ups.values()]) * w[:, None]).sum(0) / w.sum()
        torch.testing.assert_close(svc.rounds.global_params, g0 + mean.float(), atol=1e-6, rtol=0)
        async with live.session("n0") as http, http.get(live.url + "/v1/model") as r:
            assert r.status == 200  # still serving


def test_the_edge_retransmits_when_the_answer_is_lost_and_the_root_counts_it_once(tmp_path) -> None:
    asyncio.run(_lost_answer(tmp_path))


async def _lost_answer(tmp_path) -> None:
    """A relay on 127.0.0.1 passes the edge's first POST to the root and then drops the connection
    before the answer reaches the edge: the edge sends it again and hears ``duplicate``."""
    import aiohttp
    from aiohttp import web

    from shoal.server.edge.partial_sender import PartialRefused, send_partial

    sections = {"hierarchy": {"edge_names": list(EDGES)}}
    async with live_server(tmp_path, [*NODES, *EDGES], sections=sections, clients_per_round=6, min_nodes=6) as live:
        svc = live.service
        for edge, nodes in EDGES.items():
            await edge_poll(live, edge, nodes)
        now = time.monotonic()
        svc.tick(now)  # the last poll's own tick may have opened it
        assert svc.sync is not None and svc.sync.open
        works = {n: svc.poll(n, now) or {} for n in NODES}
        acc = Accumulator(works["n0"]["round"], 0, svc.spec.numel)
        for i, n in enumerate(EDGES["edge-a"]):
            acc.add_update(Update(torch.full((svc.spec.numel,), 0.01 * (i + 1)), 2 + i, 0, n))
        body = encode_partial(acc.partial().sealed("edge-a"), svc.spec.hash)
        seen: list[int] = []

        async def relay(request: web.Request) -> web.StreamResponse:
            data = await request.read()
            async with (
                live.session("edge-a") as http,
                http.post(live.url + "/v1/partial", data=data) as r,
            ):
                answer, status = await r.read(), r.status
            seen.append(status)
            if len(seen) == 1 and request.transport is not None:
                request.transport.close()  # the root took it; its answer is lost on the way back
                raise ConnectionResetError("answer lost")
            return web.Response(body=answer, status=status, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/partial", relay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        relay_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                loop = asyncio.get_running_loop()
                answer = await send_partial(http, relay_url, body, give_up_at=loop.time() + 30, first_s=0.05)
                assert answer["status"] == "duplicate" and seen == [200, 200]
                assert svc.sync is not None and svc.sync.received == set(EDGES["edge-a"])
                assert svc.counters.accepted == 4  # counted once
                other = encode_partial(acc.partial().sealed("x"), "another spec")
                try:
                    await send_partial(http, relay_url, other, give_up_at=loop.time() + 30, first_s=0.05)
                    raise AssertionError("a refused partial was taken")
                except PartialRefused as e:
                    assert e.status == 400 and len(seen) == 3  # refused once, never sent again
        finally:
            await runner.cleanup()


def test_edges_are_not_nodes_in_the_dp_population(tmp_path) -> None:
    """8 nodes and 2 edges in the registry, K = 8: the accountant's N is the 8 nodes, so q = K / 8 = 1
    (an edge authenticates as a registered name but is never selected)."""

    async def scenario():
        sections = {
            "hierarchy": {"edge_names": ["edge-a", "edge-b"]},
            "privacy": {"mode": "central", "noise_multiplier": 1.0, "clip_norm": 1.0},
        }
        nodes = [f"n{i}" for i in range(8)]
        async with live_server(tmp_path, [*nodes, "edge-a", "edge-b"], sections=sections, clients_per_round=8) as live:
            return live.service.privacy

    privacy = asyncio.run(scenario())
    assert (privacy.registered, privacy.q) == (8, 1.0)
