"""Differential privacy in `shoal server` / `shoal client`, in one process: the server's state
machine (Poisson selection over the registered nodes, the accountant, the budget stop, the
survivor check of distributed DP before any unmasking share is asked for, the ledger across a
restart), the refusals of configs that cannot be sound, the noise that reaches a deployed
aggregate, the nodes' own privacy (checks, local-DP ledger), and top-k error feedback settled
by each upload's outcome. Real aiohttp servers on 127.0.0.1; the end-to-end runs with
processes are in test_deploy_privacy_e2e.py."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from contextlib import AsyncExitStack
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web

from shoal.accounting import LEDGER_ORDERS, epsilon, rdp_to_epsilon
from shoal.accounting_dpsgd import LocalDpSgdAccountant, dp_sgd_schedule
from shoal.aggregation.secagg.encoding import FixedPoint, encode_weighted
from shoal.aggregation.secagg.wire import decode_message, encode_message
from shoal.client.http import NodeError
from shoal.client.node import Node
from shoal.client.task_message import TaskMessage
from shoal.config import config_from_dict
from shoal.errors import ConfigError
from shoal.privacy_state import NodePrivacy
from shoal.server.service import ServerService
from shoal.server.store import open_service
from shoal.shard_split import write_shards
from shoal.shards import Shard, load_shard
from shoal.update import Update
from shoal.wire import decode_update, encode_model, encode_update

from .hostile import good_update
from .live import ADMIN, live_server, small_config
from .test_secure_rounds import LATER, Party

CENTRAL = {"privacy": {"mode": "central", "noise_multiplier": 1.0, "clip_norm": 1.0}}


def _records(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def _node_cfg(sections: dict | None = None, **train):
    return config_from_dict(
        {"model": {"name": "logreg"}, "train": {"batch_size": 10, "lr": 0.05, **train}, **(sections or {})}
    ).validate()


def _shards(tmp: Path, n: int = 5) -> list[Path]:
    return write_shards(small_config(tmp), tmp / "shards")[:n]


# --- the server's state machine ------------------------------------------------------------


def test_poisson_selection_samples_connected_nodes_at_k_over_the_registered(tmp_path):
    """N = 10 registered nodes, K = 3, so q = 0.3; only 6 are connected. Over 80 rounds each
    connected node is selected at rate 0.3 (within 4 standard errors), not 3/6 = 0.5; round
    sizes have the binomial mean and variance of 6 draws at q; every round is charged, and the
    reported epsilon is dp-accounting's for q = 0.3. The draws are secret: a second server
    with the same config (and seed) selects differently."""
    rounds, connected = 80, [f"n{i}" for i in range(6)]  # ~0.1 s a round: the accountant's RDP
    cfg = small_config(
        tmp_path, CENTRAL, clients_per_round=3, rounds=10**6, deadline_s=1.0, min_nodes=1, max_failed_rounds=0
    )  # nobody reports: every round fails, and the run must go on to sample 80 of them

    def run(svc: ServerService, count: int) -> list[list[str]]:
        now, picks = 0.0, []
        for _ in range(count):
            for n in connected:
                svc.seen(n, now)
            assert svc.tick(now) and svc.rounds.open
            picks.append(sorted(svc.rounds.selected))
            now += 1.5
            assert svc.tick(now) and not svc.rounds.open  # deadline: failed (nobody reports) or empty
        return picks

    svc = open_service(cfg, registered=10)
    assert svc.rounds.sampling == "poisson" and svc.rounds.sampling_rate(6) == pytest.approx(0.3)
    picks = run(svc, rounds)
    se = math.sqrt(0.3 * 0.7 / rounds)
    pooled = sum(len(p) for p in picks) / (rounds * len(connected))
    assert abs(pooled - 0.3) < 4 * se / math.sqrt(len(connected)), pooled
    for n in connected:
        rate = sum(n in p for p in picks) / rounds
        assert abs(rate - 0.3) < 4 * se, (n, rate)
    sizes = np.array([len(p) for p in picks])
    assert abs(sizes.mean() - 1.8) < 4 * math.sqrt(6 * 0.21 / rounds), sizes.mean()
    assert 0.5 < sizes.var() / (6 * 0.21) < 1.5
    st = svc.status(0.0)["privacy"]
    assert st["rounds_charged"] == rounds and st["sampling_rate"] == pytest.approx(0.3)
    assert st["epsilon"] == pytest.approx(epsilon(0.3, 1.0, rounds, 1e-5))
    other = open_service(
        small_config(tmp_path / "b", CENTRAL, clients_per_round=3, rounds=10**6, deadline_s=1.0, max_failed_rounds=0),
        registered=10,
    )
    assert run(other, 10) != picks[:10]
    # the draws and task seeds rest on 256 bits from the OS, not on simulation.seed
    assert isinstance(svc.rounds.secret, bytes) and len(svc.rounds.secret) == 32
    assert svc.rounds.secret != other.rounds.secret


@pytest.mark.parametrize(
    "sections,server,registered,match",
    [
        ({}, {"mode": "async"}, 5, "server.mode = 'sync'"),
        ({}, {"clients_per_round": 0}, 5, "server.clients_per_round = K > 0"),
        ({"privacy": {"sampling": "fixed"}}, {}, 5, "privacy.sampling = 'fixed' in shoal server"),
        ({"asynchronous": {"over_selection": 0.5}}, {}, 5, "over_selection"),
        ({"asynchronous": {"late": "fold"}}, {}, 5, "late = 'fold'"),
        ({"privacy": {"noise_multiplier": 0.0}}, {}, 5, "noise_multiplier = 0"),
        ({}, {"clients_per_round": 6}, 5, "more than the 5 registered nodes"),
        ({"privacy": {"target_epsilon": 1.0}}, {}, 5, "below the epsilon of a single round"),
        (
            {"privacy": {"mode": "distributed"}, "secure_aggregation": {"enabled": True, "clip": 1.0}},
            {},
            5,
            r"would clip the distributed-DP noise.*t = 3 noise shares.*set secure_aggregation.clip >= 5\.619",
        ),
    ],
)
def test_configs_that_cannot_be_sound_are_refused_with_the_fix(tmp_path, sections, server, registered, match):
    privacy = {**CENTRAL["privacy"], **sections.get("privacy", {})}
    cfg = small_config(tmp_path, {**sections, "privacy": privacy}, **{"clients_per_round": 5, **server})
    with pytest.raises(ConfigError, match=match):
        open_service(cfg, registered=registered)


def test_make_app_binds_n_to_the_registered_nodes(tmp_path):
    """N comes from the registry the server serves: 4 enabled nodes, K = 2, q = 0.5; a
    revoked node is not in the population."""

    async def scenario():
        async with live_server(tmp_path, ["a", "b", "c", "d", "e"], sections=CENTRAL, clients_per_round=2) as live:
            return live.service

    live_reg = tmp_path / "nodes.sqlite"
    from shoal.server.registry import Registry

    reg = Registry(live_reg)
    reg.add("x")
    reg.revoke("x")
    reg.close()
    svc = asyncio.run(scenario())
    assert svc.privacy.registered == 5 and svc.privacy.q == pytest.approx(0.4)


def test_budget_stops_before_target_and_the_nodes_are_told(tmp_path, caplog):
    """Central DP, q = 1, z = 1: 4.73 after one round, 7.08 after two, 9.01 after three; with
    target_epsilon = 8 the run stops after two rounds and says so: a log line, status,
    Prometheus, a metrics record, and every node told done with the reason."""
    names = ["n0", "n1", "n2"]
    sections = {"privacy": {**CENTRAL["privacy"], "target_epsilon": 8.0}}

    async def scenario():
        server = {"min_nodes": 3, "clients_per_round": 3, "rounds": 10, "poll_s": 1.0, "deadline_s": 10.0}
        async with live_server(tmp_path, names, clock=True, sections=sections, **server) as live:
            shards = _shards(tmp_path, 3)
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    load_shard(shards[i]),
                    _node_cfg(sections),
                    torch.device("cpu"),
                    None,
                    poll_s=1.0,
                    name=n,
                )
                for i, n in enumerate(names)
            ]
            with caplog.at_level(logging.INFO):
                assert await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 40) == [0, 0, 0]
            async with live.session(ADMIN) as http:
                async with http.get(live.url + "/v1/status") as r:
                    status = await r.json()
                async with http.get(live.url + "/metrics") as r:
                    prom = await r.text()
            return status, prom

    status, prom = asyncio.run(scenario())
    assert status["done"] and status["version"] == 2
    p = status["privacy"]
    assert p["epsilon"] == pytest.approx(epsilon(1.0, 1.0, 2, 1e-5)) and p["epsilon"] < 8 < p["epsilon_next"]
    assert p["stopped"].startswith("privacy budget reached: epsilon = 7.077 now, 9.01 after one more round")
    assert "shoal_privacy_budget_exhausted 1" in prom and "shoal_privacy_target_epsilon 8.0" in prom
    assert f"shoal_privacy_epsilon {p['epsilon']}" in prom
    records = _records(tmp_path)
    assert [r.get("version") for r in records] == [1, 2, 2] and "stopped" in records[-1]
    assert [round(r["epsilon"], 3) for r in records] == [4.729, 7.077, 7.077]
    assert all(r["epsilon"] <= 8 for r in records)
    text = caplog.text
    assert "stopping: privacy budget reached" in text
    assert text.count("server reports done at version 2 (privacy budget reached") == 3


def test_survivor_check_aborts_before_any_unmasking_share_is_asked(tmp_path):
    """Distributed DP + secure aggregation, 4 nodes, min_survivors = 1: every share is sized for
    t = 4. Round 1: 3 masked inputs (enough for the protocol's own threshold of 3), fewer than
    t: the round aborts when the masked stage closes, no unmasking request is made, and the round
    is released as an empty one (noise alone, a new version, a record like any round's) and charged.
    Round 2: all 4 mask and the sum is released. q = 1 and no privacy.abort_bound: every round is
    charged as the worst case, a node deciding the abort at sensitivity K_max C = 4C (a Gaussian of
    multiplier z/4, RDP 8 a per round at order a)."""
    names = ["n0", "n1", "n2", "n3"]
    sections = {
        "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0, "min_survivors": 1.0},
        "secure_aggregation": {"enabled": True, "stage_s": 5.0, "clip": 6.0, "max_weight": 100.0},
    }

    def masked(p, delivery_body: bytes) -> bytes:
        """Distributed DP's vector [clip(delta), n / max_weight]: the count is only ever summed."""
        k, bits = p.info["summands"], p.info["bits"]
        values, weights = FixedPoint(p.info["clip"], bits, k), FixedPoint(1.0, bits, k)
        x = encode_weighted(p.delta, 1.0, values, weights, np.random.default_rng(0))
        x[-1:] = weights.encode(np.array([p.examples / 100.0]), np.random.default_rng(1))
        delivery = decode_message(delivery_body, p.params.vector_size)
        return encode_message(p.client.masked_input(delivery, x), {"round": p.round})

    async def secure_round(live, stack, maskers: int):
        svc, rng = live.service, np.random.default_rng(3)
        parties = []
        for n in names:
            p = Party(live, n, await stack.enter_async_context(live.session(n)), rng)
            assert (await p.task())["status"] in ("wait", "work")
            parties.append(p)
        if not svc.rounds.open:
            assert svc.tick(time.monotonic()) and svc.secure_round is not None
        for p in parties:
            task = await p.task()
            assert task["privacy"] == {
                "mode": "distributed",
                "noise_multiplier": 1.0,
                "clip_norm": 1.0,
                "delta": 1e-5,
                "noise_shares": 4,
            }
            assert task["secure_aggregation"]["weighting"] == "uniform"
            p.start(task)
            # a count or a loss beside the masked vector would be read in the clear: refused, nothing changes
            status, reply = await p.post("keys", p.keys())
            assert status == 400 and "no num_examples or train_loss in the clear" in reply["detail"]
            assert (await p.post("keys", encode_message(p.public, {"round": p.round})))[0] == 200
        for p in parties:
            status, body = await p.fetch("keys")
            directory = decode_message(body, p.params.vector_size)
            assert (await p.post("shares", encode_message(p.client.share_keys(directory), {"round": p.round})))[
                0
            ] == 200
        for p in parties[:maskers]:
            status, delivery = await p.fetch("shares")
            assert (await p.post("masked", masked(p, delivery)))[0] == 200
        return parties

    async def scenario():
        async with (
            live_server(tmp_path, names, sections=sections, min_nodes=4, clients_per_round=4) as live,
            AsyncExitStack() as stack,
        ):
            svc = live.service
            assert svc.privacy.noise_shares == 4
            before = svc.rounds.global_params.clone()
            await secure_round(live, stack, maskers=3)
            sr = svc.secure_round
            assert sr.server.threshold == 3 and len(sr.server.u3) == 3
            assert svc.tick(time.monotonic() + LATER)  # the masked stage closes with 3 < t
            assert svc.secure_round is None and sr.aborted and "fewer than the t = 4 noise shares" in sr.aborted
            assert "masked" not in sr.replies and sr.server.stage == "masked"  # nobody was asked to unmask
            assert svc.version == 1 and not torch.equal(svc.rounds.global_params, before)  # the noise alone
            assert svc.privacy.rounds_charged == 1
            parties = await secure_round(live, stack, maskers=4)
            sr2 = svc.secure_round
            assert sr2.stage == "unmask"  # the 4th masked input closed the stage
            for p in parties:
                status, body = await p.fetch("masked")
                request = decode_message(body, p.params.vector_size)
                assert (await p.post("unmask", encode_message(p.client.unmask(request), {"round": p.round})))[0] == 200
            assert svc.version == 2 and svc.privacy.rounds_charged == 2
            assert svc.secure_last["included"] == 4
            # the server learnt the sum of the counts (inside the masked vector), no node's own
            assert sr2.examples is not None and abs(sr2.examples - sum(p.examples for p in parties)) <= 1

    asyncio.run(asyncio.wait_for(scenario(), 40))
    records = _records(tmp_path)
    assert "aborted" not in records[0] and set(records[0]) == set(records[1])  # no release tells the abort
    assert records[0]["version"] == 1 and records[0]["rounds_charged"] == 1

    def eps(rounds: int) -> float:
        return rdp_to_epsilon(LEDGER_ORDERS, [rounds * 8.0 * a for a in LEDGER_ORDERS], 1e-5)

    assert records[0]["epsilon"] == pytest.approx(eps(1))
    assert records[1]["version"] == 2 and records[1]["epsilon"] == pytest.approx(eps(2))


@pytest.mark.parametrize(
    ("inflated", "refusal"),
    [
        (5, "the task asks for t = 5 noise shares, but this node's key directory holds 4 nodes"),
        (4, "asked to unmask a sum of 3 masked inputs, fewer than the t = 4"),
    ],
    ids=["beyond-the-directory", "within-it-one-dropout"],
)
def test_nodes_do_not_trust_the_server_for_t(tmp_path, caplog, inflated, refusal):
    """A malicious server inflates t (each share then shrinks) and skips its survivor check
    (test-side fault injection). t = 5 for 4 nodes: every node refuses at the key directory,
    before any noise or masked input leaves it. t = 4 (the threshold is 3) with one node
    failing before it masks: the 3 others were sized for 4 and refuse to unmask 3. Either way
    the sum is never unmasked: the round is released as an empty one (noise alone)."""
    names = [f"client-{i:05d}" for i in range(4)]
    sections = {
        "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0},
        "secure_aggregation": {"enabled": True, "stage_s": 2.0, "clip": 6.0},
    }

    async def scenario():
        server = {"min_nodes": 4, "clients_per_round": 4, "rounds": 1, "poll_s": 1.0, "deadline_s": 10.0}
        async with live_server(tmp_path, names, clock=True, sections=sections, **server) as live:
            svc = live.service
            svc.privacy.noise_shares = inflated
            svc.privacy.cohort = max(svc.privacy.cohort, inflated)  # its own top-up check agrees with it
            svc.privacy.check_survivors = lambda survivors, round_: None
            before = svc.rounds.global_params.clone()
            shards = _shards(tmp_path, 4)
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    load_shard(shards[i]),
                    _node_cfg(sections),
                    torch.device("cpu"),
                    None,
                    poll_s=1.0,
                    name=n,
                )
                for i, n in enumerate(names)
            ]
            if inflated == 4:  # client-00003 fails after its keys: never masks
                nodes[3].privacy.add_share = _fails_once(nodes[3].privacy.add_share)
            runs = [asyncio.ensure_future(n.run()) for n in nodes]
            with caplog.at_level(logging.INFO):
                for _ in range(300):
                    if (svc.secure_last or {}).get("aborted"):
                        break
                    await asyncio.sleep(0.05)
                for n in nodes:
                    n.stop.set()
                assert await asyncio.wait_for(asyncio.gather(*runs), 20) == [0] * 4
            return svc, before

    svc, before = asyncio.run(scenario())
    assert svc.secure_last["aborted"] and svc.counters.rounds_abandoned == 0 and svc.version == 1  # as empty
    sent = svc.secure_last["sent"]
    assert sent["unmask"] == [] and len(sent["masked"]) == (0 if inflated == 5 else 3)
    assert caplog.text.count(refusal) == (4 if inflated == 5 else 3)


def _fails_once(add_share):
    """A node's add_share that raises the first time (the node leaves that round's protocol)."""
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("injected: this node fails before it masks")
        return add_share(*args, **kwargs)

    return wrapped


def test_privacy_ledger_counts_every_charged_round_across_a_restart(tmp_path):
    """Two rounds, then a third opens and the server dies before any checkpoint of it: the
    restarted server has charged all three (the ledger is written when a round opens) and goes
    on from there; --fresh starts a new ledger with a warning."""
    cfg = small_config(tmp_path, CENTRAL, clients_per_round=2, deadline_s=1.0)
    svc = open_service(cfg, registered=2)
    now = 0.0
    for _ in range(2):
        for n in ("a", "b"):
            svc.seen(n, now)
        svc.tick(now)
        for n in sorted(svc.rounds.selected):
            svc.submit(n, good_update(svc, n), now)
        svc.tick(now)
    for n in ("a", "b"):
        svc.seen(n, now)
    assert svc.tick(now) and svc.rounds.open and svc.privacy.rounds_charged == 3
    del svc  # "killed" with round 3 open
    again = open_service(cfg, registered=2)
    assert again.version == 2 and again.privacy.rounds_charged == 3
    assert again.status(now)["privacy"]["epsilon"] == pytest.approx(epsilon(1.0, 1.0, 3, 1e-5))
    fresh = open_service(cfg, resume=False, registered=2)
    assert fresh.privacy.rounds_charged == 0


def test_server_records_withhold_or_noise_the_round_figures(tmp_path):
    """privacy.release on the server: the default record has no count or loss; "noised" has
    the noisy count and loss, and every round is charged at z_eff = (z^-2 + 2 sigma^-2)^-1/2."""
    for release, z_eff in (("withhold", 1.0), ("noised", (1 + 2 / 16) ** -0.5)):
        out = tmp_path / release
        privacy = {**CENTRAL["privacy"], "release": release, "release_noise_multiplier": 4.0}
        svc = open_service(small_config(out, {"privacy": privacy}, clients_per_round=2, deadline_s=1.0), registered=2)
        for _ in range(2):
            for n in ("a", "b"):
                svc.seen(n, 0.0)
            svc.tick(0.0)
            for n in sorted(svc.rounds.selected):
                svc.submit(n, good_update(svc, n), 0.0)
            svc.tick(0.0)
        records = _records(out)
        assert [r["version"] for r in records] == [1, 2] and all(r["release"] == release for r in records)
        assert all(not {"num_results", "num_examples", "train_loss"} & set(r) for r in records)
        assert all(("num_results_noisy" in r) == (release == "noised") for r in records)
        assert records[-1]["epsilon"] == pytest.approx(epsilon(1.0, z_eff, 2, 1e-5))


# --- the noise that reaches a deployed aggregate --------------------------------------------


@pytest.mark.parametrize("mode", ["central", "distributed", "distributed+secagg"])
def test_noise_on_the_deployed_aggregate_is_what_the_accountant_assumes(tmp_path, mode):
    """Five in-process nodes that train with lr = 1e-12 (their updates are about 1e-12), one round, K = 5:
    the new model minus the old is the released noise / K. Central: std z C / K (the server's
    draw); distributed in the clear: five shares sized for the t = 5 selected, the same; with
    secure aggregation five shares sized for t = 3 give z C sqrt(5/3) / K.
    Measured on the 610 coordinates of the model (standard error of a std: 2.9%)."""
    names = [f"client-{i:05d}" for i in range(5)]
    z = 2.0
    sections = {"privacy": {"mode": mode.split("+")[0], "noise_multiplier": z, "clip_norm": 1.0}}
    if mode.endswith("secagg"):
        sections["secure_aggregation"] = {"enabled": True, "stage_s": 5.0, "clip": 11.0}

    async def scenario():
        server = {"min_nodes": 5, "clients_per_round": 5, "rounds": 1, "poll_s": 1.0, "deadline_s": 20.0}
        async with live_server(tmp_path, names, clock=True, sections=sections, **server) as live:
            before = live.service.rounds.global_params.clone()
            shards = _shards(tmp_path)
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    load_shard(shards[i]),
                    _node_cfg(sections, lr=1e-12),
                    torch.device("cpu"),
                    None,
                    poll_s=1.0,
                    name=n,
                )
                for i, n in enumerate(names)
            ]
            assert await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 40) == [0] * 5
            return (live.service.rounds.global_params - before).double()

    released = asyncio.run(scenario())
    expected = z * (math.sqrt(5 / 3) if mode.endswith("secagg") else 1.0) / 5
    measured = float(released.std())
    assert abs(measured / expected - 1) < 0.12, (measured, expected)


# --- local DP: the nodes' reports ------------------------------------------------------------


def test_local_dp_nodes_report_their_own_epsilon_and_the_worst_stops_the_run(tmp_path):
    """Three DP-SGD nodes with different data sizes: each reports the epsilon of its own
    schedule (checked against the accountant on n_k, B, 2 steps a round and its rounds); the server
    shows each and the worst, refuses an update without a report (nothing changes), and stops
    when the worst node's next round would pass target_epsilon."""
    names, sizes = ["n0", "n1", "n2"], [20, 40, 80]
    sections = {  # release = clear: the nodes send reports that reveal roughly their sizes (docs/privacy.md)
        "privacy": {
            "mode": "local",
            "noise_multiplier": 1.0,
            "clip_norm": 1.0,
            "target_epsilon": 12.0,
            "release": "clear",
            "local_steps": 2,  # a few rounds before the smallest node's budget runs out
        }
    }

    async def scenario():
        server = {"min_nodes": 3, "clients_per_round": 3, "rounds": 20, "poll_s": 1.0, "deadline_s": 20.0}
        async with live_server(tmp_path, names, sections=sections, **server) as live:
            svc = live.service
            for n in names:
                svc.seen(n, time.monotonic())
            svc.tick(time.monotonic())
            async with live.session("n0") as http:
                # an example count (or a loss) beside the noisy update: refused, nothing taken
                async with http.post(live.url + "/v1/update", data=good_update(svc, "n0")) as r:
                    assert r.status == 400 and "carries num_examples = 1 and no metrics" in (await r.json())["detail"]
                one = Update(torch.full((svc.spec.numel,), 0.01), 1, svc.version, "n0")
                body = encode_update(one, svc.spec, {"round": svc.rounds.round})
                async with http.post(live.url + "/v1/update", data=body) as r:  # no privacy report: refused
                    assert r.status == 400 and "privacy report" in (await r.json())["detail"]
            assert not svc.rounds.received and not svc.privacy.reports and svc.counters.accepted == 0
            stop = asyncio.Event()
            from shoal.server.app import run_clock

            clock = asyncio.ensure_future(run_clock(live.app, stop))
            gen = torch.Generator().manual_seed(0)
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    Shard(n, torch.randn(k, 60, generator=gen), torch.randint(0, 10, (k,), generator=gen), 10),
                    _node_cfg(sections),
                    torch.device("cpu"),
                    None,
                    poll_s=1.0,
                    name=n,
                )
                for n, k in zip(names, sizes)
            ]
            assert await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 60) == [0, 0, 0]
            stop.set()
            await clock
            return svc.status(time.monotonic())

    status = asyncio.run(scenario())
    p = status["privacy"]
    rounds = p["node_epsilon"]["n0"]["rounds"]
    for n, k in zip(names, sizes):
        acc = LocalDpSgdAccountant({n: dp_sgd_schedule(k, 10, 1, steps=2)}, 1.0, 1e-5)
        for _ in range(rounds):
            acc.record_round([n])
        assert p["node_epsilon"][n] == {
            "epsilon": pytest.approx(acc.epsilon),
            "rounds": rounds,
            "epsilon_next": pytest.approx(acc.next_epsilon()),
            "delta": 1e-5,
        }
    worst = max(names, key=lambda n: p["node_epsilon"][n]["epsilon_next"])
    assert p["epsilon"] == max(r["epsilon"] for r in p["node_epsilon"].values()) <= 12.0
    assert p["node_epsilon"][worst]["epsilon_next"] > 12.0 and status["done"]
    assert p["stopped"] and f"the worst node, {worst}" in p["stopped"]
    assert [r["version"] for r in _records(tmp_path) if "stopped" not in r] == list(range(1, rounds + 1))


# --- the node's own privacy ------------------------------------------------------------------


def test_node_refuses_a_server_with_another_privacy(tmp_path):
    dist = _node_cfg({"privacy": {"mode": "distributed", "noise_multiplier": 1.0}})
    priv = NodePrivacy(dist, "n0", 20)
    task = {
        "round": 1,
        "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0, "noise_shares": 3},
    }
    priv.check_task(task)
    for bad, match in (
        ({**task["privacy"], "mode": "central"}, "privacy.mode = 'central'"),
        ({**task["privacy"], "noise_multiplier": 0.5}, "noise_multiplier = 0.5"),
        ({**task["privacy"], "noise_shares": 0}, "noise_shares"),
        (None, "privacy.mode = 'none'"),
    ):
        with pytest.raises(NodeError, match=match):
            priv.check_task({"round": 1, "privacy": bad})
    # a node without [privacy] does not train for a server that runs DP
    node = Node.from_config(
        "http://127.0.0.1:9",
        "t",
        Shard("n0", torch.randn(20, 60), torch.randint(0, 10, (20,)), 10),
        _node_cfg(),
        torch.device("cpu"),
        name="n0",
    )
    with pytest.raises(NodeError, match="this node's config has no \\[privacy\\]"):
        node._check_privacy(TaskMessage.parse({"status": "work", "version": 0, "seed": 0, **task}))
    # distributed: clipped to C, plus a share of std z C / sqrt(t) drawn from the OS
    upd = priv.protect(Update(torch.full((40_000,), 1.0), 5), task)
    clipped = torch.full((40_000,), 1 / 200)
    assert float((upd.delta - clipped).std()) == pytest.approx(1 / math.sqrt(3), rel=0.03)
    again = priv.protect(Update(torch.full((40_000,), 1.0), 5), task)
    assert not torch.equal(upd.delta, again.delta)


def test_local_dp_node_ledger_budget_and_secret_seed(tmp_path):
    # 4 steps a round at B / n = 0.25: room for 3 rounds under the target
    cfg = _node_cfg({"privacy": {"mode": "local", "noise_multiplier": 1.0, "target_epsilon": 8.0, "local_steps": 4}})
    ledger = tmp_path / "n0.privacy.json"
    priv = NodePrivacy(cfg, "n0", 40, ledger)
    assert priv.training_seed(7) != 7 and priv.training_seed(7) != priv.training_seed(7)
    acc = LocalDpSgdAccountant({"n0": dp_sgd_schedule(40, 10, 1, steps=4)}, 1.0, 1e-5)
    for i in (1, 2):  # the default withholds the report (it reveals roughly n_k); the node counts all the same
        assert priv.spend(i) is None
        acc.record_round(["n0"])
        assert priv.rounds == i and priv.epsilon == pytest.approx(acc.epsilon)
        assert priv.accountant.next_epsilon() == pytest.approx(acc.next_epsilon())
    clear = NodePrivacy(_node_cfg({"privacy": {"mode": "local", "release": "clear"}}), "n9", 40)
    assert clear.spend(1) == {
        "epsilon": pytest.approx(
            LocalDpSgdAccountant({"n9": dp_sgd_schedule(40, 10, 1, steps=10)}, 1.0, 1e-5).next_epsilon()
        ),
        "epsilon_next": pytest.approx(clear.accountant.next_epsilon()),
        "delta": 1e-5,
        "rounds": 1,
    }
    restarted = NodePrivacy(cfg, "n0", 40, ledger)  # goes on from the ledger
    assert restarted.rounds == 2 and restarted.epsilon == pytest.approx(acc.epsilon)
    while restarted.allows_next_round():
        restarted.spend(restarted.rounds + 1)
    assert restarted.rounds == 3 and restarted.epsilon <= 8.0 < restarted.accountant.next_epsilon()
    with pytest.raises(ConfigError, match="cannot be composed"):  # another schedule: refused, not restarted
        NodePrivacy(_node_cfg({"privacy": {"mode": "local"}}, batch_size=20), "n0", 40, ledger)
    with pytest.raises(ConfigError, match="below the epsilon of one round"):
        NodePrivacy(_node_cfg({"privacy": {"mode": "local", "target_epsilon": 0.5}}), "n1", 40)


# --- top-k error feedback in the deployed node -----------------------------------------------


def test_node_settles_top_k_error_feedback_by_each_uploads_outcome(tmp_path):
    """A test server hands out three tasks and answers the uploads 409 (refused), 200
    (accepted) and by hanging up (never delivered; the node is stopping). At every poll the
    node's ledger holds: what it produced = what the server accepted + its residual + what is
    in flight, and nothing is in flight between rounds: the refused and the unsent uploads'
    coordinates went back into the residual."""
    cfg = _node_cfg({"compression": {"encoding": "topk", "topk_fraction": 0.1}})
    gen = torch.Generator().manual_seed(1)
    shard = Shard("n0", torch.randn(30, 60, generator=gen), torch.randint(0, 10, (30,), generator=gen), 10)
    outcomes, applied, checks, tasks = ["refuse", "accept", "hangup"], [], [], []
    node: Node | None = None

    def ledger_ok():
        topk = node.compressor.topk
        produced = sum(
            (node.trainer.fit(g, node.train, s, v, "n0").delta for g, s, v in tasks),
            torch.zeros(node.trainer.spec.numel),
        )
        residual = topk.residuals.get("n0", torch.zeros_like(produced))
        in_flight = torch.zeros_like(produced)
        for idx, values in topk.in_flight.values():
            in_flight.index_add_(0, idx, values)
        total = sum(applied, torch.zeros_like(produced)) + residual + in_flight
        checks.append((len(topk.in_flight), float((total - produced).abs().max())))

    async def get_task(request):
        ledger_ok()
        if len(tasks) == 3:
            return web.json_response({"status": "done", "version": 3})
        v = len(tasks)
        tasks.append((global_params, 100 + v, v))
        return web.json_response({"status": "work", "round": v + 1, "version": v, "seed": 100 + v})

    async def get_model(request):
        v = len(tasks) - 1
        return web.Response(body=encode_model(global_params, spec, v), headers={"ETag": f'"v{v}"'})

    async def post_update(request):
        body = await request.read()
        outcome = outcomes[len(tasks) - 1]
        if outcome == "hangup":
            node.stop.set()
            request.transport.close()
            return web.Response()
        if outcome == "refuse":
            return web.json_response({"error": "late", "detail": "the round closed"}, status=409)
        applied.append(decode_update(body, spec)[0].delta.clone())
        return web.json_response({"status": "accepted", "version": len(tasks)})

    async def scenario():
        nonlocal node
        app = web.Application()
        app.router.add_get("/v1/task", get_task)
        app.router.add_get("/v1/model", get_model)
        app.router.add_post("/v1/update", post_update)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            node = Node.from_config(
                f"http://127.0.0.1:{runner.addresses[0][1]}",
                "token",
                shard,
                cfg,
                torch.device("cpu"),
                None,
                poll_s=1.0,
                name="n0",
            )
            assert await asyncio.wait_for(node.run(), 30) == 0
        finally:
            await runner.cleanup()

    probe = Node.from_config("http://127.0.0.1:9", "t", shard, cfg, torch.device("cpu"), name="n0")
    spec, global_params = probe.trainer.spec, probe.trainer.flat.detach().clone()
    asyncio.run(scenario())
    ledger_ok()  # after the unsent third upload
    assert len(applied) == 1 and len(tasks) == 3
    assert [n for n, _ in checks] == [0] * len(checks) and len(checks) >= 4
    assert max(err for _, err in checks) < 1e-5, checks
    # the refused upload's coordinates were sent again with the accepted one
    k = node.compressor.topk.k(spec.numel)
    assert int((applied[0] != 0).sum()) == k


def test_a_restart_with_another_noise_multiplier_composes_the_rounds_as_they_ran(tmp_path):
    """Ten rounds at z = 1, then the server restarts at z = 4: the ten rounds keep their z = 1
    (the ledger records z, q, C per charged round), so epsilon is not re-priced down; the next
    round composes one z = 4 round onto them, as dp-accounting computes it independently."""
    import dp_accounting
    from dp_accounting import rdp

    def run(z: float, rounds: int, resume: bool):
        privacy = {"privacy": {**CENTRAL["privacy"], "noise_multiplier": z}}
        cfg = small_config(tmp_path, privacy, clients_per_round=2, rounds=20)
        svc = open_service(cfg, resume=resume, registered=2)
        now = 0.0
        for _ in range(rounds):
            for n in ("a", "b"):
                svc.seen(n, now)
            svc.tick(now)
            for n in sorted(svc.rounds.selected):
                svc.submit(n, good_update(svc, n), now)
            svc.tick(now)
        return svc

    def independent(*events) -> float:
        acc = rdp.RdpAccountant()
        for z, k in events:
            acc.compose(dp_accounting.GaussianDpEvent(z), k)
        return acc.get_epsilon(1e-5)

    first = run(1.0, 10, resume=False)
    assert first.privacy.rounds_charged == 10
    eps10 = first.status(0.0)["privacy"]["epsilon"]
    assert eps10 == pytest.approx(independent((1.0, 10)), rel=1e-9)
    del first
    again = run(4.0, 0, resume=True)
    assert again.status(0.0)["privacy"]["epsilon"] == pytest.approx(eps10, rel=1e-9)  # not epsilon(z=4, 10) (far lower)
    assert epsilon(1.0, 4.0, 10, 1e-5) < eps10 / 5
    del again
    later = run(4.0, 1, resume=True)
    assert later.privacy.rounds_charged == 11
    assert later.status(0.0)["privacy"]["epsilon"] == pytest.approx(independent((1.0, 10), (4.0, 1)), rel=1e-6)
    ledger = later.privacy.state_dict()["accountant"]["ledger"]
    assert [(e["z"], e["rounds"]) for e in ledger] == [(1.0, 10), (4.0, 1)]


def test_a_ledger_without_its_noise_record_is_refused_not_repriced(tmp_path):
    cfg = small_config(tmp_path, CENTRAL, clients_per_round=2)
    svc = open_service(cfg, registered=2)
    state = svc.privacy.state_dict()
    state.pop("accountant")
    state["rounds_charged"] = 7  # what an older shoal wrote: a count, no z
    from shoal.server.privacy import ServerPrivacy

    p = ServerPrivacy(cfg, svc.spec.numel, torch.device("cpu"))
    p.load_state_dict(state)
    with pytest.raises(ConfigError, match="cannot be priced soundly"):
        p.bind(2, svc.rounds)


def test_delta_is_checked_against_the_registered_nodes_and_a_nodes_examples(tmp_path):
    """delta >= 1/N promises nothing (one record published in the clear meets it): the server
    refuses it for N registered nodes; a local-DP node refuses it for its own examples."""
    cfg = small_config(tmp_path, {"privacy": {**CENTRAL["privacy"], "delta": 0.2}}, clients_per_round=2)
    with pytest.raises(ConfigError, match=r"privacy.delta = 0.2 is at least 1/N = 0.2 \(N = 5 registered nodes\)"):
        open_service(cfg, registered=5)
    node_cfg = _node_cfg({"privacy": {"mode": "local", "noise_multiplier": 1.0, "delta": 0.05}})
    with pytest.raises(ConfigError, match="N = 20 examples on this node"):
        NodePrivacy(node_cfg, "n0", 20)


def test_a_restart_that_changes_the_mechanism_composes_the_rounds_as_they_ran(tmp_path):
    """Three rounds charged with continuous noise shares, then a restart asking for the discrete
    Gaussian: the three rounds stay charged as they ran (z = 1, q = 0.75) and compose with the new
    ones in RDP; never re-priced at the new mechanism, never refused as "damaged"."""
    from shoal.accounting_rounds import mixed_ledger_epsilon
    from shoal.server.privacy import ServerPrivacy

    sections = {
        "privacy": {"mode": "distributed", "noise_multiplier": 1.0, "clip_norm": 1.0},
        "secure_aggregation": {"enabled": True, "stage_s": 2.0, "clip": 8.0},
    }
    svc = open_service(small_config(tmp_path, sections, clients_per_round=3), registered=4)
    for _ in range(3):
        svc.privacy.round_started(["a", "b", "c"])
    state = json.loads(json.dumps(svc.privacy.state_dict()))
    ddg = {"privacy": {**sections["privacy"], "mechanism": "discrete_gaussian"}}
    cfg = small_config(tmp_path / "again", {**sections, **ddg}, clients_per_round=3)
    restarted = ServerPrivacy(cfg, svc.spec.numel, torch.device("cpu"))
    restarted.load_state_dict(state)
    restarted.bind(4, svc.rounds)
    assert restarted.rounds_charged == 3 and restarted.accountant is not None
    earlier = [e for e in restarted.accountant.ledger if e["mechanism"] == "gaussian"]
    assert [(e["q"], e["z"], e["rounds"]) for e in earlier] == [(0.75, 1.0, 3)]
    assert restarted.epsilon == pytest.approx(mixed_ledger_epsilon(earlier, 1e-5))
    assert restarted.epsilon == pytest.approx(svc.privacy.epsilon, rel=0.02)  # the same rounds, priced in RDP
    restarted.round_started(["a", "b", "c"])
    assert restarted.epsilon > svc.privacy.epsilon
    assert "3 earlier rounds of the other Gaussian mechanism" in restarted.describe()
    # the same config as the ledger's goes on from it
    same = ServerPrivacy(small_config(tmp_path / "same", sections, clients_per_round=3), svc.spec.numel)
    same.load_state_dict(state)
    same.bind(4, svc.rounds)
    assert same.rounds_charged == 3 and same.epsilon == pytest.approx(svc.privacy.epsilon)
