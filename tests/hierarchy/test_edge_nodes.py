"""An edge aggregator's state without I/O (server/edge/service.py's EdgeNodes): the root's answers are
checked before anything changes, nodes get their tasks only with the round's model, updates are
checked as a root checks them and summed into one partial equal to the root's own sum."""

from __future__ import annotations

import pytest
import torch

from shoal.errors import ShoalError
from shoal.server.edge.service import EdgeNodes, edge_spec
from shoal.server.service import ModelDownload
from shoal.update import Update
from shoal.wire import encode_update

from ..server.live import small_config

TASKS = {"n0": 11, "n1": 12, "n2": 13}


def edge(tmp_path, **hierarchy) -> EdgeNodes:
    cfg = small_config(tmp_path, {"hierarchy": {"parent": "http://127.0.0.1:1", **hierarchy}})
    return EdgeNodes(cfg, edge_spec(cfg))


def work(round_: int = 3, version: int = 2, **extra) -> dict:
    return {"edge": "edge-a", "status": "work", "round": round_, "version": version, "tasks": TASKS, **extra}


def body(e: EdgeNodes, node: str, version: int = 2, round_: int = 3, examples: int = 5) -> bytes:
    g = torch.Generator().manual_seed(int(node[1:]))
    u = Update(torch.randn(e.spec.numel, generator=g) * 0.01, examples, version, node, {"train_loss": 0.1})
    return encode_update(u, e.spec, {"round": round_})


def test_hostile_root_answers_change_nothing(tmp_path) -> None:
    e = edge(tmp_path)
    bad = [
        None,
        [],
        {"status": "work"},  # no edge name
        {"edge": "edge-a", "status": "later"},
        work(round_=-1),
        work(version=True),
        {**work(), "tasks": {"n0": "seed"}},
        {**work(), "tasks": []},
        {**work(), "tasks": {}},
        work(deadline_s=-1),
        work(deadline_s="soon"),
    ]
    for answer in bad:
        with pytest.raises(ShoalError) as err:
            e.from_root(answer, 0.0)
        assert err.value.code == "malformed", answer
        assert e.round is None and not e.done
    # a round this edge cannot run as the root does: one line naming the key (it stops, not retries)
    from shoal.errors import ConfigError

    with pytest.raises(ConfigError, match="^privacy.mode: this edge runs 'none'"):
        e.from_root(work(privacy={"z": 1.0}), 0.0)
    assert e.round is None
    assert e.from_root(work(deadline_s=30.0), 0.0)
    assert not e.from_root(work(deadline_s=29.0), 1.0)  # the same round: nothing new
    assert e.round is not None and e.round.close_at == 30.0 - e.cfg.hierarchy.edge_margin_s


def test_tasks_wait_for_the_model_and_updates_sum_into_one_partial(tmp_path) -> None:
    e = edge(tmp_path, edge_quorum=1.0)
    e.from_root(work(deadline_s=30.0), 0.0)
    assert e.poll("n0", 0.1) is None  # the round's model is not here yet
    e.model = ModelDownload(2, '"x-v2"', b"", memoryview(b"model"))
    task = e.poll("n0", 0.2)
    assert task is not None and (task["round"], task["version"], task["seed"]) == (3, 2, 11)
    assert task["deadline_s"] == pytest.approx(30.0 - e.cfg.hierarchy.edge_margin_s - 0.2)
    assert e.poll("stranger", 0.2) is None  # not one of this round's nodes here
    refusals = [
        ("stranger", body(e, "n0"), "not_selected"),
        ("n0", body(e, "n0", version=1), "stale"),
        ("n0", body(e, "n0", round_=4), "round_closed"),
        ("n0", b"\x00" * 64, "malformed"),
        ("n0", body(e, "n0")[:-8], "malformed"),
    ]
    for node, data, code in refusals:
        with pytest.raises(ShoalError) as err:
            e.submit(node, memoryview(bytearray(data)), 0.3)
        assert err.value.code == code, (node, err.value)
    assert e.round is not None and e.round.acc.count == 0  # nothing of the refusals counted
    for n in ("n0", "n1"):
        assert e.submit(n, memoryview(bytearray(body(e, n))), 0.4)["status"] == "accepted"
    with pytest.raises(ShoalError) as err:
        e.submit("n0", memoryview(bytearray(body(e, "n0"))), 0.5)
    assert err.value.code == "duplicate"
    assert e.poll("n0", 0.5) is None  # its update is in: no task again
    e.failed("n2", b'{"round": 3, "version": 2, "reason": "diverged"}', 0.6)
    assert e.round.should_close(0.6)  # every node it waits for reported
    part = e.round.close()
    assert part is not None and part.senders == {"n0", "n1"} and part.total_weight == 10.0
    want = sum(
        5.0 * (torch.randn(e.spec.numel, generator=torch.Generator().manual_seed(i)) * 0.01).double() for i in (0, 1)
    )
    torch.testing.assert_close(part.weighted_sum, want, atol=1e-9, rtol=0)
    e.from_root({"edge": "edge-a", "status": "done", "version": 3}, 1.0)
    assert e.poll("n0", 1.1) == {"status": "done", "version": 3}
    assert not e.finished(1.2, 1.0)  # n1, n2 and the stranger are connected and not told yet
    for n in ("n1", "n2", "stranger"):
        e.poll(n, 1.3)
    assert e.finished(1.4, 1.0)


def test_an_edge_refuses_what_it_cannot_run_with_the_reason(tmp_path) -> None:
    from shoal.config import config_from_dict
    from shoal.errors import ConfigError

    base = {"data": {"dataset": "synthetic"}, "model": {"name": "logreg"}, "hierarchy": {"parent": "http://r:1"}}
    for extra, words in (
        (
            {"secure_aggregation": {"enabled": True, "threshold": 0.7, "malicious_server": True, "keys_file": "k"}},
            "consistency round through edges is not built",
        ),
        (
            {"server": {"mode": "async"}, "asynchronous": {"algorithm": "fedasync"}},
            "FedBuff's buffer only",
        ),
        ({"privacy": {"mode": "central", "noise_multiplier": 1.0}}, "distributed DP with secure aggregation"),
        ({"privacy": {"mode": "distributed", "noise_multiplier": 1.0}}, "distributed DP with secure aggregation"),
        ({"algorithm": {"name": "scaffold"}}, "each node's own step"),
    ):
        with pytest.raises(ConfigError) as err:
            config_from_dict({**base, **extra}).validate()
        assert "hierarchy.parent" in str(err.value) and words in str(err.value), err.value
    with pytest.raises(ConfigError):
        config_from_dict({**base, "hierarchy": {"parent": "root:8443"}}).validate()


def test_the_edge_s_node_routes_refuse_hostile_requests(tmp_path) -> None:
    import asyncio
    import time

    import aiohttp
    from aiohttp import web

    from shoal.server.edge.app import _edge_app
    from shoal.server.registry import Registry

    async def scenario() -> None:
        e = edge(tmp_path, edge_quorum=1.0)
        registry = Registry(e.cfg.server.db)
        token = registry.add("n0")
        runner = web.AppRunner(_edge_app(e, registry), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        auth = {"Authorization": f"Bearer {token}"}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:

                async def call(method: str, path: str, **kw) -> tuple[int, dict]:
                    async with http.request(method, url + path, **kw) as r:
                        return r.status, await r.json()

                assert (await call("GET", "/v1/task?wait=0"))[0] == 401  # no token
                # a node busy in a secure round's stages polls no task, yet it is connected: the edge
                # keeps naming it to its root (else the root gives it no task in the next round)
                assert e.connected(time.monotonic()) == []
                status, answer = await call("POST", "/v1/secagg/keys", headers=auth, data=b"x")
                assert (status, answer["error"]) == (409, "round_closed")  # no secure round here
                assert e.connected(time.monotonic()) == ["n0"]
                e.last_seen.clear()
                status, answer = await call("GET", "/v1/secagg/shares?round=1&wait=0", headers=auth)
                assert (status, answer["error"]) == (409, "round_closed")
                assert e.connected(time.monotonic()) == ["n0"]
                status, answer = await call("GET", "/v1/task?wait=0", headers={**auth, "X-Shoal-Spec-Hash": "other"})
                assert status == 400 and answer["error"] == "spec_mismatch"  # as the root answers it
                assert await call("GET", "/v1/task?wait=0", headers=auth) == (200, {"status": "wait", "version": 0})
                assert (await call("GET", "/v1/model", headers=auth))[0] == 503  # not fetched from the root yet
                status, answer = await call("POST", "/v1/update", headers=auth, data=body(e, "n0"))
                assert (status, answer["error"]) == (409, "round_closed")  # no round here yet
                e.from_root(work(deadline_s=30.0), 0.0)
                e.model = ModelDownload(2, '"x-v2"', b"", memoryview(b"model bytes"))
                status, answer = await call("GET", "/v1/task?wait=0", headers=auth)
                assert (status, answer["status"], answer["seed"]) == (200, "work", 11)
                big = bytes(e.max_body_bytes + 1)
                assert (await call("POST", "/v1/update", headers=auth, data=big))[0] == 413
                status, answer = await call("POST", "/v1/update", headers=auth, data=b"junk" * 10)
                assert (status, answer["error"]) == (400, "malformed")
                async with http.get(url + "/v1/model", headers={**auth, "Range": "bytes=0-4"}) as r:
                    assert r.status == 206 and await r.read() == b"model"
                async with http.get(url + "/v1/model", headers={**auth, "If-None-Match": '"x-v2"'}) as r:
                    assert r.status == 304
                status, answer = await call("POST", "/v1/update", headers=auth, data=body(e, "n0"))
                assert (status, answer["status"]) == (200, "accepted")
                assert e.round is not None and e.round.acc.senders == {"n0"}
                # the root revokes n0 (its next poll answer says so): this edge's copy of the registry still
                # has it, yet every route refuses it at once, the model included, and it is named no more
                waiting = asyncio.ensure_future(call("GET", "/v1/task?wait=5", headers=auth))
                await asyncio.sleep(0.2)
                assert e.from_root({"edge": "edge-a", "status": "wait", "revoked": ["n0"]}, 1.0)
                from shoal.server.http_common import notify

                notify(runner.app)
                assert (await waiting)[0] == 403  # its long poll ends with the refusal
                for method, path, data in (("GET", "/v1/model", None), ("POST", "/v1/update", body(e, "n0"))):
                    status, answer = await call(method, path, headers=auth, data=data)
                    assert (status, answer["error"]) == (403, "revoked"), (path, answer)
                assert e.refused["revoked"] == 2 and "n0" not in e.connected(time.monotonic())
                assert not e.from_root({"edge": "edge-a", "status": "wait", "revoked": ["n0"]}, 1.1)  # known
        finally:
            await runner.cleanup()
            registry.close()

    asyncio.run(scenario())


def test_an_edge_that_cannot_reach_its_root_stops_with_one_line_naming_the_fix(tmp_path, monkeypatch) -> None:
    """The node's connection hints, with the edge's keys: a root whose CA the edge does not trust
    (hierarchy.parent_ca_cert), http:// against an HTTPS root, https:// against a plain one, and an
    unknown host, which ends after the bounded attach (ATTACH_S, 1 s here) with the reason."""
    import asyncio
    import dataclasses

    from shoal.errors import ConfigError
    from shoal.pki import write_secret
    from shoal.server.edge import app as edge_app
    from shoal.server.edge import uplink
    from shoal.server.registry import Registry
    from shoal.tls import make_private_ca, server_context

    from ..server.live import live_server

    monkeypatch.setattr(uplink, "ATTACH_S", 1.0)
    pki = make_private_ca(tmp_path / "pki")
    base = edge(tmp_path / "e")
    registry = Registry(base.cfg.server.db)
    write_secret(tmp_path / "edge.token", b"not-used-by-the-root-here")

    async def stops(parent: str, ca: str = "") -> str:
        h = dataclasses.replace(
            base.cfg.hierarchy, parent=parent, parent_ca_cert=ca, parent_token_file=str(tmp_path / "edge.token")
        )
        cfg = dataclasses.replace(base.cfg, hierarchy=h, server=dataclasses.replace(base.cfg.server, port=0))
        with pytest.raises(ConfigError) as err:
            await asyncio.wait_for(edge_app.serve_edge(cfg, registry, None), 30)
        assert "\n" not in str(err.value)
        return str(err.value)

    async def scenario() -> None:
        tls = server_context(pki.cert, pki.key)
        async with live_server(tmp_path / "r", ["n0"], ssl_context=tls) as live:
            msg = await stops(live.url)  # the system's trust store: not this private CA
            assert "not signed by a CA this edge trusts" in msg and "hierarchy.parent_ca_cert" in msg, msg
            msg = await stops(live.url.replace("https://", "http://"))
            assert "speaks HTTPS" in msg and "in hierarchy.parent" in msg, msg
        async with live_server(tmp_path / "p", ["n0"]) as live:
            msg = await stops(live.url.replace("http://", "https://"), str(pki.ca_cert))
            assert "speaks plain HTTP" in msg, msg
        msg = await stops("https://no-such-root.invalid:8443")
        assert "did not answer this edge for 1 s" in msg and "'no-such-root.invalid'" in msg and "DNS" in msg, msg

    for d in ("r", "p"):
        (tmp_path / d).mkdir()
    try:
        asyncio.run(scenario())
    finally:
        registry.close()
