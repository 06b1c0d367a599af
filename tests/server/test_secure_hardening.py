"""Secure server rounds against hostile or broken nodes, over real HTTP: unusable keys are a
4xx and the round goes on; a node whose update is NaN never masks it and the round completes
without it; the server's clock survives an exception."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack

import torch

from shoal.aggregation.secagg import PublicKeys
from shoal.aggregation.secagg.wire import decode_message, encode_message
from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.shard_split import write_shards
from shoal.shards import load_shard

from .hostile import good_update
from .live import live_server, small_config
from .test_secure_rounds import NODES, SECURE, _parties, _through_shares

ZERO = bytes(32)


def test_colluding_nodes_with_all_zero_keys_get_400_and_the_round_goes_on(tmp_path):
    """Two selected nodes advertise all-zero (small-order) keys: refused at once; the honest
    nodes' round runs to a new version (before: accepted, and the unmasking's ValueError
    killed the server's clock). Their refused messages changed nothing: sent with their real
    keys afterwards, they take part as usual."""

    async def scenario():
        async with (
            live_server(tmp_path, NODES + ["idle"], sections=SECURE, min_nodes=4) as live,
            AsyncExitStack() as stack,
        ):
            svc = live.service
            parties = await _parties(live, stack)
            for p in parties[:2]:
                for bad in (PublicKeys(p.name, ZERO, p.public.mask_key), PublicKeys(p.name, p.public.enc_key, ZERO)):
                    body = encode_message(bad, {"round": p.round, "num_examples": 5, "train_loss": 0.1})
                    status, info = await p.post("keys", body)
                    assert (status, info["error"]) == (400, "malformed") and "small order" in info["detail"]
            assert svc.secure_round.status()["sent"]["keys"] == []
            # nothing of theirs was taken: with their real keys the round runs to a new version
            max_weight = await _through_shares(parties)
            for p in parties:
                status, delivery = await p.fetch("shares")
                assert status == 200
                assert (await p.post("masked", p.masked(delivery, max_weight)))[0] == 200
            for p in parties:
                status, body = await p.fetch("masked")
                request = decode_message(body, p.params.vector_size)
                assert (await p.post("unmask", encode_message(p.client.unmask(request), {"round": p.round})))[0] == 200
            assert svc.version == 1 and bool(torch.isfinite(svc.rounds.global_params).all())

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_nan_node_refuses_to_mask_and_the_round_completes_without_it(tmp_path, caplog):
    """Four real client nodes; one trains with a learning rate that blows its update up to
    NaN/Inf. It says so in one line, reports the failure and does not join the secure
    aggregation nor train again; the round's key stage closes without waiting for it and the
    round completes with the other three (min_inputs = 3); the model stays finite."""
    names = [f"client-{i:05d}" for i in range(4)]

    async def scenario():
        server = {"min_nodes": 4, "rounds": 1, "deadline_s": 30.0, "poll_s": 1.0}
        sections = {"secure_aggregation": SECURE["secure_aggregation"]}
        async with live_server(tmp_path, names, clock=True, sections=sections, **server) as live:
            cfg = small_config(tmp_path)
            shards = write_shards(cfg, tmp_path / "shards")
            nodes = []
            for i, name in enumerate(names):
                lr = 1e38 if i == 3 else 0.05
                ncfg = config_from_dict({"model": {"name": "logreg"}, "train": {"batch_size": 10, "lr": lr}})
                nodes.append(
                    Node.from_config(
                        live.url,
                        live.tokens[name],
                        load_shard(shards[i]),
                        ncfg,
                        torch.device("cpu"),
                        None,
                        poll_s=1.0,
                        name=name,
                    )
                )
            with caplog.at_level(logging.INFO):
                await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 40)
            return live.service, nodes

    svc, nodes = asyncio.run(scenario())
    assert svc.version == 1 and bool(torch.isfinite(svc.rounds.global_params).all())
    assert svc.last_record["elapsed_s"] < 30.0  # its failure report closed the key stage, not the deadline
    assert [n.rounds_done for n in nodes] == [1, 1, 1, 0]
    assert svc.secure_last["included"] == 3 and svc.secure_last["sent"]["keys"] == names[:3]
    diverged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training diverged")]
    assert len(diverged) == 1, diverged  # trained once, not again and again
    assert diverged[0].startswith("training diverged in round 1: ") and diverged[0].endswith("; not uploading")


def test_the_clock_survives_an_exception_and_the_server_keeps_answering(tmp_path, caplog):
    """A real fault inside the clock's tick: the checkpoint directory cannot be made (its
    parent is a file), so closing a round raises. The clock logs it and goes on; requests
    are still answered."""
    (tmp_path / "file").write_text("not a directory")

    async def scenario():
        server = {"clients_per_round": 1, "min_nodes": 1, "checkpoint_dir": str(tmp_path / "file" / "ck")}
        async with live_server(tmp_path, ["n0"], clock=True, **server) as live:
            svc = live.service
            async with live.session("n0") as http:
                async with http.get(live.url + "/v1/task", params={"wait": "2"}) as resp:
                    assert (await resp.json())["status"] == "work"
                with caplog.at_level(logging.ERROR, logger="shoal.server.http_common"):
                    async with http.post(live.url + "/v1/update", data=good_update(svc, "n0")) as resp:
                        assert resp.status == 200  # accepted; the failure is the clock's, not the request's
                    await asyncio.sleep(0.5)
                assert any("clock failed" in r.getMessage() for r in caplog.records)
                async with http.get(live.url + "/v1/task", params={"wait": "0"}) as resp:
                    assert resp.status == 200
            ticker = [t for t in asyncio.all_tasks() if "run_clock" in repr(t.get_coro())]
            assert ticker and not ticker[0].done()

    asyncio.run(asyncio.wait_for(scenario(), 30))
