"""The algorithms with client state run deployed: `shoal server` holds their server half
(SCAFFOLD's control variate, FedNova's normalised mean, FedDyn's h), each node runs the
simulator's client step and keeps its state in its own folder, and the server's model after
three rounds is the in-process simulator's for the same config."""

from __future__ import annotations

import asyncio

import pytest
import torch

from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.errors import ConfigError, Malformed
from shoal.server.service import ServerService
from shoal.server.store import ServerStore, open_service
from shoal.shard_split import write_shards
from shoal.shards import load_shard
from shoal.simulations.inprocess import InProcessSimulation
from shoal.update import Update
from shoal.wire import decode_model, encode_update

from .live import live_server, small_config

TRAIN = {"batch_size": 10, "lr": 0.05, "momentum": 0.5}
SERVER = {"rounds": 3, "min_nodes": 5, "clients_per_round": 5, "deadline_s": 30.0, "poll_s": 1.0}


def _deployed(tmp_path, algorithm: dict, **more: dict) -> tuple[ServerService, list[Node]]:
    sections = {"algorithm": algorithm, "train": TRAIN, **more}
    cfg = small_config(tmp_path, sections, **SERVER)
    shards = [load_shard(p) for p in write_shards(cfg, tmp_path / "shards")]

    async def scenario():
        async with live_server(
            tmp_path, [s.client_id for s in shards], clock=True, sections=sections, **SERVER
        ) as live:
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[s.client_id],
                    s,
                    cfg,
                    torch.device("cpu"),
                    None,
                    1.0,
                    state_dir=tmp_path / f"{s.client_id}.state",
                )
                for s in shards
            ]
            await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 60)
            return live.service, nodes

    return asyncio.run(scenario())


@pytest.mark.parametrize("name", ["scaffold", "fednova", "feddyn", "ditto"])
def test_a_deployed_algorithm_gives_the_simulators_model(tmp_path, name):
    svc, nodes = _deployed(tmp_path, {"name": name})
    assert svc.version == 3 and all(n.rounds_done == 3 for n in nodes)
    sim = InProcessSimulation.from_config(
        small_config(
            tmp_path, {"algorithm": {"name": name}, "train": {"batch_size": 10, "lr": 0.05, "momentum": 0.5}}, **SERVER
        )
    )
    for _ in range(3):
        sim.run_round()
    gap = float((svc.rounds.global_params - sim.global_params).abs().max())
    assert gap < 1e-5, gap
    assert float((svc.rounds.global_params - svc.trainer.flat.detach()).abs().max()) > 1e-3  # it trained
    if name == "scaffold":  # the server's c is the simulator's, and each node's c_i is on its disk
        c = svc.sync.strategy.control.c
        assert float((c - sim.control.c).abs().max()) < 1e-5 and float(c.abs().max()) > 0
        for n in nodes:
            kept = n.states.get(n.name)["scaffold/c"]
            assert float((kept - sim.states.get(n.name)["scaffold/c"]).abs().max()) < 1e-5
            assert (tmp_path / f"{n.name}.state").is_dir()
        _, header = decode_model(svc.model_body(), svc.spec)
        assert torch.equal(header["aux_tensors"]["scaffold/c"], c)  # the broadcast is the current c
    if name == "ditto":  # the personal model is the node's own state, kept between rounds
        assert all("ditto/v" in n.states.get(n.name) for n in nodes)


@pytest.mark.parametrize("name", ["scaffold", "fednova"])
def test_under_secure_aggregation_the_server_sees_sums_and_gets_the_simulators_model(tmp_path, name):
    """SCAFFOLD's nodes mask their control-variate delta beside the update, FedNova's mask Delta/a_k
    (aggregation/secagg/payload.py): the server's model and c equal the in-process simulator's with
    the same secure aggregation, and each SCAFFOLD node kept its c_i once its masked input was in."""
    secure = {"enabled": True, "bits": 28, "clip": 1.0}
    svc, nodes = _deployed(tmp_path, {"name": name}, secure_aggregation=secure)
    assert svc.version == 3 and all(n.rounds_done == 3 for n in nodes)
    assert svc.secure_last["included"] == 5
    sections = {"algorithm": {"name": name}, "train": TRAIN, "secure_aggregation": secure}
    sim = InProcessSimulation.from_config(small_config(tmp_path, sections, **SERVER))
    for _ in range(3):
        sim.run_round()
    gap = float((svc.rounds.global_params - sim.global_params).abs().max())
    assert gap < 1e-5, gap
    if name == "scaffold":
        c = svc.sync.strategy.control.c
        assert float((c - sim.control.c).abs().max()) < 1e-5 and float(c.abs().max()) > 1e-3
        for n in nodes:
            kept = n.states.get(n.name)["scaffold/c"]
            assert float((kept - sim.states.get(n.name)["scaffold/c"]).abs().max()) < 1e-5


def test_scaffold_and_fednova_refuse_an_update_without_what_their_server_step_needs(tmp_path):
    for name, update, match in [
        ("scaffold", Update(torch.zeros(0), 5), "takes \\['scaffold/dc'\\]"),
        ("fedavg", Update(torch.zeros(0), 5, to_server={"scaffold/dc": torch.zeros(0)}), "takes \\[\\]"),
        ("fednova", Update(torch.zeros(0), 5), "fednova_a"),
    ]:
        cfg = small_config(tmp_path / name, {"algorithm": {"name": name}}, min_nodes=1, clients_per_round=1)
        svc = ServerService.from_config(cfg)
        svc.seen("a", 0.0)
        assert svc.tick(0.0)
        n = svc.spec.numel
        update.delta = torch.full((n,), 0.01)
        update.to_server = {k: torch.zeros(n) for k in update.to_server}
        body = bytearray(encode_update(update, svc.spec, {"round": svc.rounds.round}))
        with pytest.raises(Malformed, match=match):
            svc.submit("a", body, 0.1)
        assert svc.counters.accepted == 0 and svc.sync.received == set()


def test_an_algorithm_with_client_state_refuses_an_async_server(tmp_path):
    cfg = config_from_dict({"algorithm": {"name": "scaffold"}, "server": {"mode": "async", "db": str(tmp_path / "db")}})
    with pytest.raises(ConfigError, match="server.mode = 'async'"):
        ServerService.from_config(cfg)


def test_scaffolds_control_variate_is_checkpointed_and_resumed(tmp_path):
    """c moves with the model in the round's finalize and is part of the checkpoint: a
    restarted server broadcasts the same c it had."""
    cfg = small_config(tmp_path, {"algorithm": {"name": "scaffold"}}, min_nodes=2, clients_per_round=2)
    svc = open_service(cfg, registered=4, started_at=0.0)
    for node in ("a", "b"):
        svc.seen(node, 0.0)
    assert svc.tick(0.0)
    n = svc.spec.numel
    for i, node in enumerate(("a", "b")):
        work = svc.poll(node, 0.1)
        up = Update(torch.full((n,), 0.01), 5, work["version"], to_server={"scaffold/dc": torch.full((n,), i + 1.0)})
        svc.submit(node, bytearray(encode_update(up, svc.spec, {"round": work["round"]})), 0.2)
    assert svc.tick(1000.0) and svc.version == 1
    c = svc.sync.strategy.control.c
    torch.testing.assert_close(c, torch.full((n,), 3.0 / 4))  # (1/N) sum dc with N = 4 registered
    again = ServerService.from_config(cfg, registered=4, restored=ServerStore(cfg).restore(resume=True))
    assert again.version == 1
    _, header = decode_model(again.model_body(), again.spec)
    torch.testing.assert_close(header["aux_tensors"]["scaffold/c"], c)
