"""Secure aggregation in server rounds, over real HTTP: the test plays the nodes with
the same SecAggClient state machines a `shoal client` runs, and drives the clock."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack

import numpy as np
import pytest
import torch

from shoal.aggregation.secagg import MaskedInput, SecAggClient, UnmaskShares
from shoal.aggregation.secagg.encoding import FixedPoint, encode_weighted, example_weight
from shoal.aggregation.secagg.wire import decode_message, encode_message, message_meta, params_from_json
from shoal.update import Update
from shoal.wire import encode_update

from .live import live_server

NODES = ["n0", "n1", "n2", "n3"]
SECURE = {"secure_aggregation": {"enabled": True, "stage_s": 5.0}}
LATER = 10_000.0  # a `now` past every deadline: closes the current stage with whoever answered


class Party:
    """One node of the test: its HTTP session, its task and its protocol state."""

    def __init__(self, live, name: str, http, rng: np.random.Generator):
        self.live, self.name, self.http = live, name, http
        self.delta = rng.normal(0, 0.05, live.service.spec.numel)
        self.examples = int(rng.integers(5, 50))

    async def task(self) -> dict:
        async with self.http.get(self.live.url + "/v1/task", params={"wait": "0"}) as r:
            return await r.json()

    def start(self, task: dict) -> None:
        self.round = task["round"]
        self.info = task["secure_aggregation"]
        self.params = params_from_json(self.info)
        self.client = SecAggClient(self.name, self.params)
        self.public = self.client.advertise_keys()

    async def post(self, route: str, body: bytes) -> tuple[int, dict]:
        async with self.http.post(f"{self.live.url}/v1/secagg/{route}", data=body) as r:
            return r.status, await r.json()

    async def fetch(self, route: str, round_: int | None = None) -> tuple[int, bytes]:
        q = {"round": str(self.round if round_ is None else round_), "wait": "0"}
        async with self.http.get(f"{self.live.url}/v1/secagg/{route}", params=q) as r:
            return r.status, await r.read()

    def keys(self, **meta) -> bytes:
        return encode_message(
            self.public, {"round": self.round, "num_examples": self.examples, "train_loss": 0.5, **meta}
        )

    def masked(self, delivery_body: bytes, max_weight: float) -> bytes:
        k, bits = self.info["summands"], self.info["bits"]
        values, weights = FixedPoint(self.info["clip"], bits, k), FixedPoint(1.0, bits, k)
        w = example_weight(self.examples, max_weight, self.info["weighting"])
        x = encode_weighted(self.delta, w, values, weights, np.random.default_rng(0))
        delivery = decode_message(delivery_body, self.params.vector_size)
        return encode_message(self.client.masked_input(delivery, x), {"round": self.round})


async def _parties(live, stack) -> list[Party]:
    rng = np.random.default_rng(5)
    out = []
    for n in NODES:
        http = await stack.enter_async_context(live.session(n))
        out.append(Party(live, n, http, rng))
    for p in out:  # be seen, so the round selects every node
        assert (await p.task())["status"] == "wait"
    svc = live.service
    assert svc.tick(time.monotonic()) and svc.rounds.open and svc.secure_round is not None
    for p in out:
        p.start(await p.task())
    return out


async def _through_shares(parties: list[Party]) -> float:
    """Every party advertises and shares; returns the round's max weight."""
    for p in parties:
        assert await p.post("keys", p.keys()) == (200, {"status": "accepted", "round": p.round, "stage": "keys"})
    max_weight = 0.0
    for p in parties:
        status, body = await p.fetch("keys")
        assert status == 200
        max_weight = message_meta(body, p.params.vector_size)["max_weight"]
        directory = decode_message(body, p.params.vector_size)
        status, _ = await p.post("shares", encode_message(p.client.share_keys(directory), {"round": p.round}))
        assert status == 200
    return max_weight


def test_secure_round_over_http_sums_the_survivors_and_removes_a_dropouts_masks(tmp_path):
    """n3 drops after sharing its keys, before its masked input: the new model is the
    exact weighted mean of n0..n2 within the fixed-point bound."""

    async def scenario():
        async with (
            live_server(tmp_path, NODES + ["idle"], sections=SECURE, min_nodes=4) as live,
            AsyncExitStack() as stack,
        ):
            svc = live.service
            before = svc.rounds.global_params.clone()
            parties = await _parties(live, stack)
            max_weight = await _through_shares(parties)
            assert svc.secure_round.stage == "masked"
            for p in parties[:3]:
                status, delivery = await p.fetch("shares")
                assert status == 200
                assert (await p.post("masked", p.masked(delivery, max_weight)))[0] == 200
            assert svc.tick(time.monotonic() + LATER) and svc.secure_round.stage == "unmask"  # n3 is late
            assert (await parties[3].fetch("masked"))[0] == 409  # excluded now
            for p in parties[:3]:
                status, body = await p.fetch("masked")
                assert status == 200
                request = decode_message(body, p.params.vector_size)
                assert request.dropped == ["n3"]
                assert (await p.post("unmask", encode_message(p.client.unmask(request), {"round": p.round})))[0] == 200
            assert svc.version == 1 and svc.secure_round is None
            assert svc.status(time.monotonic())["secure_aggregation"]["included"] == 3
            w = np.array([p.examples / max_weight for p in parties[:3]])
            expected = sum(wk * p.delta for wk, p in zip(w, parties[:3])) / w.sum()
            q = FixedPoint(1.0, 16, 4).quantum  # clip 1, 16 bits, 4 selected: the sum and the weight
            bound = 3 * q / w.sum() * (1 + np.abs(expected).max())  # are each off by < 3 quanta
            got = (svc.rounds.global_params - before).double().numpy()
            assert np.abs(got - expected).max() <= bound, (np.abs(got - expected).max(), bound)
            all4 = sum(p.examples * p.delta for p in parties) / sum(p.examples for p in parties)
            assert np.abs(got - all4).max() > 10 * bound  # n3's input is not in it

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_bad_secure_messages_get_4xx_json_and_change_nothing(tmp_path):
    async def scenario():
        async with (
            live_server(tmp_path, NODES + ["idle"], sections=SECURE, min_nodes=4) as live,
            AsyncExitStack() as stack,
        ):
            svc = live.service
            parties = await _parties(live, stack)
            a, b = parties[0], parties[1]
            idle = await stack.enter_async_context(live.session("idle"))

            def snapshot():
                st = svc.secure_round.status()
                return st["stage"], st["sent"], dict(svc.secure_round.meta)

            good = a.keys()
            other = SecAggClient("n1", a.params).advertise_keys()
            cases = {
                "garbage": (a, "keys", b"not a wire body", 400, "malformed"),
                "wrong_round": (a, "keys", a.keys(round=a.round + 1), 409, "wrong_round"),
                "forged_sender": (
                    a,
                    "keys",
                    encode_message(other, {"round": a.round, "num_examples": 3}),
                    400,
                    "malformed",
                ),
                "no_examples": (
                    a,
                    "keys",
                    encode_message(SecAggClient("n0", a.params).advertise_keys(), {"round": a.round}),
                    400,
                    "malformed",
                ),
                "wrong_kind": (a, "keys", encode_message(UnmaskShares("n0"), {"round": a.round}), 400, "malformed"),
                "other_algorithm": (a, "keys", a.keys(fednova_a=12.0), 400, "malformed"),  # FedAvg takes no a_k
                "wrong_stage": (a, "shares", good, 409, "wrong_stage"),
                "unknown_stage": (a, "nonsense", good, 409, "unknown_stage"),
            }
            before = snapshot()
            for case, (p, route, body, status, code) in cases.items():
                got = await p.post(route, body)
                assert got[0] == status and got[1]["error"] == code and got[1]["detail"], (case, got)
                assert snapshot() == before, case
            async with idle.post(f"{live.url}/v1/secagg/keys", data=good) as r:  # not selected
                assert r.status == 409 and (await r.json())["error"] == "not_selected"
            upd = Update(torch.zeros(svc.spec.numel), 10, svc.version, "n0")
            async with a.http.post(f"{live.url}/v1/update", data=encode_update(upd, svc.spec, {"round": a.round})) as r:
                assert r.status == 409 and (await r.json())["error"] == "secure_round"
            assert (await a.fetch("keys"))[0] == 202  # the stage is still open
            async with a.http.get(f"{live.url}/v1/secagg/keys", params={"round": "x"}) as r:
                assert r.status == 400 and (await r.json())["error"] == "bad_request"
            assert snapshot() == before
            assert (await a.post("keys", good))[0] == 200
            got = await a.post("keys", a.keys())
            assert got[0] == 409 and got[1]["error"] == "duplicate"
            assert svc.secure_round.meta["n0"] == (a.examples, 0.5)
            # a masked vector of the wrong length is refused by the state machine, nothing added
            for p in parties[1:]:
                assert (await p.post("keys", p.keys()))[0] == 200
            await _shares_only(parties)
            status, delivery = await b.fetch("shares")
            short = encode_message(MaskedInput("n1", np.zeros(b.params.vector_size - 1, np.uint32)), {"round": b.round})
            got = await b.post("masked", short)
            assert got[0] == 400 and svc.secure_round.status()["sent"]["masked"] == []
            body = b.masked(delivery, 50.0)
            assert (await b.post("masked", body))[0] == 200
            got = await b.post("masked", body)
            assert got[0] == 409 and got[1]["error"] == "duplicate"
            assert svc.secure_round.status()["sent"]["masked"] == ["n1"]

    asyncio.run(asyncio.wait_for(scenario(), 30))


async def _shares_only(parties: list[Party]) -> None:
    for p in parties:
        status, body = await p.fetch("keys")
        assert status == 200
        directory = decode_message(body, p.params.vector_size)
        assert (await p.post("shares", encode_message(p.client.share_keys(directory), {"round": p.round})))[0] == 200


def test_too_few_survivors_abort_the_round_and_the_next_round_runs(tmp_path, caplog):
    async def scenario():
        async with live_server(tmp_path, NODES, sections=SECURE, min_nodes=4) as live, AsyncExitStack() as stack:
            svc = live.service
            before = svc.rounds.global_params.clone()
            parties = await _parties(live, stack)
            first = svc.rounds.round
            for p in parties[:2]:  # t = 3 of 4: two keys are too few
                assert (await p.post("keys", p.keys()))[0] == 200
            with caplog.at_level(logging.WARNING, logger="shoal.server.secure_round"):
                assert svc.tick(time.monotonic() + LATER)
            assert svc.secure_round is None and not svc.rounds.open
            assert svc.version == 0 and torch.equal(svc.rounds.global_params, before)
            assert svc.counters.rounds_abandoned == 1
            assert any(
                "aborted by secure aggregation, model and version unchanged" in r.message
                and "threshold is 3" in r.message
                for r in caplog.records
            )
            status, body = await parties[0].fetch("keys", first)
            assert status == 409  # the aborted round is gone
            for p in parties:
                await p.task()  # still connected
            assert svc.tick(time.monotonic()) and svc.rounds.open and svc.rounds.round == first + 1
            assert svc.secure_round is not None and svc.secure_round.round == first + 1

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_sum_below_min_inputs_is_not_unmasked_by_the_server(tmp_path, caplog):
    """Four nodes, min_inputs = 4: three masked inputs pass the threshold (3) but not the minimum."""
    sections = {"secure_aggregation": {**SECURE["secure_aggregation"], "min_inputs": 4}}

    async def scenario():
        async with live_server(tmp_path, NODES, sections=sections, min_nodes=4) as live, AsyncExitStack() as stack:
            svc = live.service
            parties = await _parties(live, stack)
            assert all(p.params.min_inputs == 4 for p in parties)  # the nodes are told it with the task
            max_weight = await _through_shares(parties)
            assert svc.secure_round.stage == "masked"
            for p in parties[:3]:
                status, delivery = await p.fetch("shares")
                assert status == 200 and (await p.post("masked", p.masked(delivery, max_weight)))[0] == 200
            with caplog.at_level(logging.WARNING, logger="shoal.server.secure_round"):
                assert svc.tick(time.monotonic() + LATER)
            assert svc.secure_round is None and svc.version == 0 and svc.counters.rounds_abandoned == 1
            assert "a sum of 3 masked inputs is not unmasked" in svc.secure_last["aborted"]
            assert any("min_inputs = 4" in r.message for r in caplog.records)

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_secure_server_config_is_checked_up_front(tmp_path):
    from shoal.errors import ConfigError
    from shoal.server.store import open_service

    from .live import small_config

    with pytest.raises(ConfigError, match="server.mode = 'async'"):
        small_config(tmp_path, SECURE, mode="async")
    with pytest.raises(ConfigError, match="lower bits"):  # 300 x 2^24 does not fit 2^32
        open_service(
            small_config(tmp_path, {"secure_aggregation": {"enabled": True, "bits": 24}}, clients_per_round=300)
        )
