"""Secure aggregation through edges at a root on 127.0.0.1 (real sockets): edges relay their nodes'
protocol messages to /v1/edge/secagg/{stage} and send one masked sum each; hostile relays and sums
get a 4xx with nothing changed; an edge lost before its sum is its nodes' drop-out; the root's model
is the survivors' mean."""

from __future__ import annotations

import asyncio
import base64
import time
from contextlib import AsyncExitStack

import numpy as np

from shoal.aggregation.secagg import MaskedSum, UnmaskRequest
from shoal.aggregation.secagg.encoding import FixedPoint
from shoal.aggregation.secagg.tiers import EdgeMaskedSum, seal_message
from shoal.aggregation.secagg.wire import decode_message, encode_message, message_meta

from ..server.live import live_server
from ..server.test_secure_rounds import LATER, Party
from .test_root_http import edge_poll

NODES = [f"n{i}" for i in range(6)]
EDGES = {"edge-a": NODES[:4], "edge-b": NODES[4:]}
EDGE_OF = {n: e for e, ns in EDGES.items() for n in ns}


class Relayed(Party):
    """A node whose messages its edge relays (the edge's session, the node named in the query)."""

    def __init__(self, live, name: str, http, rng, edge_http):
        super().__init__(live, name, http, rng)
        self.edge_http = edge_http

    async def post(self, route: str, body: bytes) -> tuple[int, dict]:
        url = f"{self.live.url}/v1/edge/secagg/{route}"
        async with self.edge_http.post(url, params={"node": self.name}, data=body) as r:
            return r.status, await r.json()

    async def fetch(self, route: str, round_: int | None = None) -> tuple[int, bytes]:
        q = {"node": self.name, "round": str(self.round if round_ is None else round_), "wait": "0"}
        async with self.edge_http.get(f"{self.live.url}/v1/edge/secagg/{route}", params=q) as r:
            return r.status, await r.read()


def test_edges_relay_a_secure_round_and_a_lost_edge_s_nodes_are_drop_outs(tmp_path) -> None:
    asyncio.run(_scenario(tmp_path))


async def _scenario(tmp_path) -> None:
    sections = {"hierarchy": {"edge_names": list(EDGES)}, "secure_aggregation": {"enabled": True, "stage_s": 5.0}}
    async with (
        live_server(tmp_path, [*NODES, *EDGES], sections=sections, clients_per_round=6, min_nodes=6) as live,
        AsyncExitStack() as stack,
    ):
        svc = live.service
        before = svc.rounds.global_params.clone()
        sessions = {who: await stack.enter_async_context(live.session(who)) for who in [*NODES, *EDGES]}
        for edge, nodes in EDGES.items():
            assert (await edge_poll(live, edge, nodes))["status"] == "wait"
        svc.tick(time.monotonic())
        assert svc.sync is not None and svc.sync.open and svc.secure_round is not None
        answer = await edge_poll(live, "edge-a", EDGES["edge-a"])
        assert answer["status"] == "work" and sorted(answer["tasks"]) == EDGES["edge-a"]
        info = answer["secure_aggregation"]  # the edge hands it to its nodes with their tasks
        assert isinstance(info["root_key"], str)
        rng = np.random.default_rng(3)
        parties = {n: Relayed(live, n, sessions[n], rng, sessions[EDGE_OF[n]]) for n in NODES}
        for p in parties.values():
            p.start({"round": answer["round"], "secure_aggregation": info})

        async def post(who: str, route: str, body: bytes, node: str | None = None) -> tuple[int, dict]:
            params = {"node": node} if node else {}
            async with sessions[who].post(f"{live.url}/v1/edge/secagg/{route}", params=params, data=body) as r:
                return r.status, await r.json()

        sr = svc.secure_round
        # hostile relays: another edge's node, a node posing as an edge, a masked input relayed alone
        assert (await post("edge-a", "keys", parties["n4"].keys(), "n4"))[1]["error"] == "not_your_node"
        assert (await post("n0", "keys", parties["n0"].keys(), "n0"))[0] == 403
        assert sr.status()["sent"]["keys"] == []
        for p in parties.values():
            assert (await p.post("keys", p.keys()))[0] == 200
        max_weight = 0.0
        for p in parties.values():
            status, body = await p.fetch("keys")
            assert status == 200
            max_weight = float(message_meta(body, p.params.vector_size)["max_weight"])
            directory = decode_message(body, p.params.vector_size)
            assert (await p.post("shares", encode_message(p.client.share_keys(directory), {"round": p.round})))[
                0
            ] == 200
        masked = {}
        for n, p in parties.items():
            status, delivery = await p.fetch("shares")
            assert status == 200
            masked[n] = decode_message(p.masked(delivery, max_weight), p.params.vector_size)
        assert (await post("edge-a", "masked", encode_message(masked["n0"], {"round": p.round}), "n0"))[0] == 409
        r = parties["n0"].round

        def sum_of(edge: str, nodes: list[str]) -> bytes:
            acc = EdgeMaskedSum(edge, sr.params.vector_size, nodes)
            for n in nodes:
                acc.add(masked[n])
            part = acc.sealed()
            assert part is not None
            return encode_message(MaskedSum(edge, part.senders, part.vector), {"round": r})

        for who, body, want in (
            ("edge-b", sum_of("edge-b", ["n3", "n4"]), (409, "not_your_node")),  # n3 is edge-a's
            ("edge-b", b"not a masked sum", (400, "malformed")),
            ("n5", sum_of("n5", ["n5"]), (403, "not_an_edge")),
        ):
            status, answer = await post(who, "masked_sum", body)
            assert (status, answer["error"]) == want, answer
        assert sr.status()["sent"]["masked"] == [] and sr.server.u3 == []
        status, answer = await post("edge-a", "masked_sum", sum_of("edge-a", EDGES["edge-a"]))
        assert (status, answer["status"], answer["nodes"]) == (200, "accepted", 4)
        assert (await post("edge-a", "masked_sum", sum_of("edge-a", EDGES["edge-a"])))[1]["status"] == "duplicate"
        status, answer = await post("edge-a", "masked_sum", sum_of("edge-a", ["n0"]))
        assert (status, answer["error"]) == (409, "conflict")
        assert sr.status()["sent"]["masked"] == EDGES["edge-a"] and sorted(sr.server.u3) == EDGES["edge-a"]
        # edge-b dies before its sum reaches the root: the masked stage closes without n4 and n5
        assert svc.tick(time.monotonic() + LATER) and sr.stage == "unmask"
        for n in EDGES["edge-a"]:
            p = parties[n]
            status, body = await p.fetch("masked")
            request = decode_message(body, p.params.vector_size)
            assert status == 200 and isinstance(request, UnmaskRequest) and request.dropped == ["n4", "n5"]
            plain = encode_message(p.client.unmask(request), {"round": r})
            if n == "n0":  # an answer in the clear would be readable by the edge: refused, nothing taken
                status, answer = await p.post("unmask", plain)
                assert (status, answer["error"]) == (400, "malformed") and "sealed" in answer["detail"]
            sealed = seal_message(plain, base64.b64decode(info["root_key"]), p.params.session, n, {"round": r})
            assert (await p.post("unmask", sealed))[0] == 200
        assert svc.version == 1
        w = np.array([parties[n].examples / max_weight for n in EDGES["edge-a"]])
        expected = sum(wk * parties[n].delta for wk, n in zip(w, EDGES["edge-a"], strict=True)) / w.sum()
        q = FixedPoint(1.0, 16, 6).quantum
        bound = 3 * q / w.sum() * (1 + np.abs(expected).max())
        got = (svc.rounds.global_params - before).double().numpy()
        assert np.abs(got - expected).max() <= bound, (np.abs(got - expected).max(), bound)
