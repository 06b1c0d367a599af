"""Every bad upload gets its 4xx JSON error and leaves the model and the counts as they were."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from shoal.server.http_common import CHANGED, REVOCATIONS
from shoal.update import Update
from shoal.wire import encode, encode_update

from .live import live_server

NODES = ["n0", "n1", "n2"]


def _good(svc, node: str, version: int | None = None, value: float = 0.01) -> bytes:
    v = svc.version if version is None else version
    upd = Update(torch.full((svc.spec.numel,), value), num_examples=10, base_version=v, sender=node)
    return encode_update(upd, svc.spec, {"round": svc.rounds.round})


def _open_round(svc) -> None:
    now = time.monotonic()
    for n in NODES:
        svc.seen(n, now)
    assert svc.tick(now) and svc.rounds.open


def _selected_unselected(svc) -> tuple[str, str]:
    sel = sorted(svc.rounds.selected)
    return sel[0], next(n for n in NODES if n not in sel)


def _body(case: str, svc, node: str) -> tuple[str, bytes]:
    """(the node that sends, the body) for one bad-input case."""
    n, v, hash_ = svc.spec.numel, svc.version, svc.spec.hash
    hdr = {
        "kind": "update",
        "spec_hash": hash_,
        "encoding": "dense",
        "base_version": v,
        "num_examples": 10,
        "sender": node,
        "metrics": {},
        "round": svc.rounds.round,
    }
    if case == "wrong_spec":
        return node, encode({"delta": torch.zeros(n)}, {**hdr, "spec_hash": "0123456789abcdef"})
    if case == "wrong_shape":
        return node, encode({"delta": torch.zeros(n + 1)}, hdr)
    if case == "wrong_dtype":
        return node, encode({"delta": torch.zeros(n, dtype=torch.float64)}, hdr)
    if case in ("nan", "inf"):
        d = torch.zeros(n)
        d[3] = float("nan") if case == "nan" else float("inf")
        return node, encode({"delta": d}, hdr)
    if case == "oversized":
        return node, b"\0" * (svc.max_body_bytes + 1)
    if case == "truncated":
        return node, _good(svc, node)[:-17]
    if case == "unknown_version":
        return node, _good(svc, node, version=v + 5)
    if case == "too_stale":
        return node, _good(svc, node, version=v - 1)
    raise AssertionError(case)


CASES = {  # case: (status, error code)
    "wrong_spec": (400, "spec_mismatch"),
    "wrong_shape": (400, "spec_mismatch"),
    "wrong_dtype": (400, "spec_mismatch"),
    "nan": (400, "non_finite"),
    "inf": (400, "non_finite"),
    "oversized": (413, "too_large"),
    "truncated": (400, "malformed"),
    "unknown_version": (409, "unknown_version"),
    "too_stale": (409, "stale"),
    "duplicate": (409, "duplicate"),
    "not_selected": (409, "not_selected"),
}


def _snapshot(svc):
    r = svc.rounds
    return (
        r.global_params.clone(),
        r.version,
        r.round,
        set(r.received),
        r.strategy.num_accumulated,
        svc.counters.accepted,
    )


def _same(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1:] == b[1:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_upload_is_refused_and_changes_nothing(tmp_path, case):
    async def scenario():
        async with live_server(tmp_path, NODES, clients_per_round=2, min_nodes=3) as live:
            svc = live.service
            if case == "too_stale":  # needs a version > 0: complete round 1 first
                _open_round(svc)
                for node in sorted(svc.rounds.selected):
                    async with live.session(node) as http:
                        async with http.post(live.url + "/v1/update", data=_good(svc, node)) as resp:
                            assert resp.status == 200, await resp.text()
                assert svc.version == 1
            _open_round(svc)
            chosen, other = _selected_unselected(svc)
            if case == "duplicate":
                async with live.session(chosen) as http:
                    async with http.post(live.url + "/v1/update", data=_good(svc, chosen)) as resp:
                        assert resp.status == 200
                sender, body = chosen, _good(svc, chosen, value=0.5)
            elif case == "not_selected":
                sender, body = other, _good(svc, other)
            else:
                sender, body = _body(case, svc, chosen)
            before = _snapshot(svc)
            async with live.session(sender) as http:
                async with http.post(live.url + "/v1/update", data=body) as resp:
                    status, info = resp.status, await resp.json()
            assert (status, info["error"]) == CASES[case], info
            assert isinstance(info["detail"], str) and info["detail"]
            _same(_snapshot(svc), before)
            assert svc.counters.rejected.get(CASES[case][1]) == 1
            # The round still takes a good update from a node that has not sent one.
            if case != "duplicate":
                async with live.session(chosen) as http:
                    async with http.post(live.url + "/v1/update", data=_good(svc, chosen)) as resp:
                        assert resp.status == 200
                assert svc.counters.accepted == before[5] + 1

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_auth_unknown_is_401_and_revoked_is_403(tmp_path):
    async def scenario():
        async with live_server(tmp_path, NODES) as live:
            async with live.session(None) as http:
                for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": "Basic abc"}):
                    async with http.get(live.url + "/v1/task", headers=headers, params={"wait": "0"}) as resp:
                        assert resp.status == 401
                        assert (await resp.json())["error"] == "unauthenticated"
            live.registry.revoke("n1")
            async with live.session("n1") as http:
                async with http.get(live.url + "/v1/task", params={"wait": "0"}) as resp:
                    assert resp.status == 403
                    assert (await resp.json())["error"] == "revoked"
            async with live.session("n0") as http:
                async with http.get(live.url + "/v1/task", params={"wait": "0"}) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["status"] == "wait"
            assert "n1" not in live.service.last_seen  # a refused request is not a sign of life

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_revoked_node_is_dropped_from_the_open_round_and_its_held_poll_at_once(tmp_path):
    """Revocation in one place (server/registry.py's Revocations, which the server's clock
    refreshes): on a one-run server a revoked node's held long poll is answered 403 at once, and
    the open round it was selected for closes once the others reported, not at its deadline."""

    async def scenario():
        async with live_server(tmp_path, NODES, clients_per_round=2, min_nodes=3, deadline_s=600) as live:
            svc = live.service
            _open_round(svc)
            victim, idle = _selected_unselected(svc)
            other = next(n for n in sorted(svc.rounds.selected) if n != victim)
            version = svc.version
            async with live.session(idle) as http:
                held = asyncio.ensure_future(http.get(live.url + "/v1/task", params={"wait": "20"}))
                await asyncio.sleep(0.2)  # its poll is held: no work for it in this round
                assert not held.done()
                for n in (victim, idle):
                    live.registry.revoke(n)
                assert live.app[REVOCATIONS].refresh() == {victim, idle}  # what the server's clock does
                resp = await asyncio.wait_for(held, 5)
                assert resp.status == 403 and (await resp.json())["error"] == "revoked"
                resp.release()
            async with live.session(other) as http:
                async with http.post(live.url + "/v1/update", data=_good(svc, other)) as resp:
                    assert resp.status == 200, await resp.text()
            svc.tick(time.monotonic())  # (the upload's own tick may have closed it already)
            assert svc.version == version + 1  # the round did not wait 600 s for the victim
            assert not svc.rounds.open or victim not in svc.rounds.selected

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_expect_continue_refuses_oversized_before_the_body_and_accepts_a_good_one(tmp_path):
    """With Expect: 100-continue the size and token are checked before the body moves."""

    async def scenario():
        async with live_server(tmp_path, NODES, clients_per_round=2, min_nodes=3) as live:
            svc = live.service
            _open_round(svc)
            chosen, _ = _selected_unselected(svc)
            before = _snapshot(svc)
            async with live.session(chosen) as http:
                big = b"\0" * (svc.max_body_bytes + 1)
                async with http.post(live.url + "/v1/update", data=big, expect100=True) as resp:
                    assert resp.status == 413 and (await resp.json())["error"] == "too_large"
                _same(_snapshot(svc), before)
            async with live.session(None) as http:
                async with http.post(live.url + "/v1/update", data=_good(svc, chosen), expect100=True) as resp:
                    assert resp.status == 401
            async with live.session(chosen) as http:
                async with http.post(live.url + "/v1/update", data=_good(svc, chosen), expect100=True) as resp:
                    assert resp.status == 200, await resp.text()
            assert svc.counters.accepted == 1 and chosen in svc.rounds.received
            assert live.app[CHANGED]["slots"].qsize() == svc.cfg.server.ingest_slots  # every buffer back

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_server_refuses_a_privacy_config_it_cannot_make_sound(tmp_path):
    """Central DP over a fraction of the connected nodes would make q change with the network:
    refused, naming the key (test_deploy_privacy.py has the other cases)."""
    from shoal.config import load_config
    from shoal.errors import ConfigError
    from shoal.server.store import open_service

    cfg = load_config(None, ['privacy.mode="central"', f'server.checkpoint_dir="{tmp_path}/ck"'])
    with pytest.raises(ConfigError, match="server.clients_per_round = K > 0"):
        open_service(cfg)
