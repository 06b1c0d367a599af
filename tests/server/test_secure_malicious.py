"""The malicious-server variant of secure aggregation in `shoal server` rounds, over real
HTTP: nodes with identity keys and a keys file run the signed protocol with its consistency
round; a key advertisement not signed by the node's identity key is refused; a node set to
that variant refuses a server that does not run it."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from types import SimpleNamespace

import pytest
import torch

from shoal.aggregation.secagg import SecAggClient, SecAggParams
from shoal.aggregation.secagg import identity as ID
from shoal.aggregation.secagg.wire import encode_message, params_from_json
from shoal.client.node import Node
from shoal.client.secure_node import _identity
from shoal.config import config_from_dict
from shoal.errors import Malformed
from shoal.shard_split import write_shards
from shoal.shards import load_shard

from .live import live_server, small_config

NAMES = [f"client-{i:05d}" for i in range(4)]


def _keys(tmp_path, names):
    roster = {n: base64.b64encode(ID.write_identity(tmp_path / f"{n}.key")).decode() for n in names}
    (tmp_path / "keys.json").write_text(json.dumps(roster))
    return {
        "enabled": True,
        "malicious_server": True,
        "threshold": 0.7,
        "keys_file": str(tmp_path / "keys.json"),
        "stage_s": 5.0,
    }


def test_signed_rounds_with_a_consistency_check_complete_over_http(tmp_path):
    sa = _keys(tmp_path, NAMES)

    async def scenario():
        server = {"min_nodes": 4, "rounds": 1, "deadline_s": 20.0, "poll_s": 1.0}
        async with live_server(tmp_path, NAMES, clock=True, sections={"secure_aggregation": sa}, **server) as live:
            cfg = small_config(tmp_path)
            shards = write_shards(cfg, tmp_path / "shards")
            nodes = []
            for i, name in enumerate(NAMES):
                ncfg = config_from_dict(
                    {
                        "model": {"name": "logreg"},
                        "train": {"batch_size": 10, "lr": 0.05},
                        "secure_aggregation": {**sa, "identity_key": str(tmp_path / f"{name}.key")},
                    }
                )
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
            await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 60)
            return live.service, nodes

    svc, nodes = asyncio.run(scenario())
    assert svc.version == 1 and [n.rounds_done for n in nodes] == [1, 1, 1, 1]
    assert svc.secure_last["sent"]["consistency"] == NAMES and svc.secure_last["included"] == 4


def test_a_key_advertisement_not_signed_by_the_nodes_identity_is_refused(tmp_path):
    sa = _keys(tmp_path, NAMES)

    async def scenario():
        async with live_server(tmp_path, NAMES, sections={"secure_aggregation": sa}, min_nodes=4) as live:
            svc = live.service
            for n in NAMES:
                svc.seen(n, time.monotonic())
            assert svc.tick(time.monotonic()) and svc.secure_round is not None
            async with live.session(NAMES[0]) as http:
                async with http.get(live.url + "/v1/task", params={"wait": "0"}) as r:
                    task = await r.json()
                params = params_from_json(task["secure_aggregation"])
                assert params.malicious
                impostor = ID.new_identity()  # holds the node's token, not its identity key
                roster = {NAMES[0]: ID.identity_public(impostor)}
                keys = SecAggClient(NAMES[0], params, None, impostor, roster).advertise_keys()
                body = encode_message(keys, {"round": task["round"], "num_examples": 5, "train_loss": 0.1})
                async with http.post(live.url + "/v1/secagg/keys", data=body) as r:
                    info = await r.json()
                    assert r.status == 400 and "not signed by its identity key" in info["detail"]
            assert svc.secure_round.status()["sent"]["keys"] == []

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_node_set_to_the_malicious_variant_refuses_a_server_that_does_not_run_it(tmp_path):
    sa = config_from_dict({"secure_aggregation": _keys(tmp_path, NAMES[:1])}).secure_aggregation
    node = SimpleNamespace(secure_cfg=sa, name=NAMES[0])
    with pytest.raises(Malformed, match="does not run that variant"):
        _identity(node, SecAggParams(b"s", 4, "full", threshold_fraction=0.7))
    sa.identity_key = str(tmp_path / f"{NAMES[0]}.key")
    identity, roster = _identity(node, SecAggParams(b"s", 4, "full", threshold_fraction=0.7, malicious=True))
    assert roster[NAMES[0]] == ID.identity_public(identity)


def test_the_server_refuses_to_start_without_a_readable_keys_file(tmp_path):
    from shoal.errors import ConfigError
    from shoal.server.app import make_app
    from shoal.server.store import open_service

    for keys_file, why in (("", "needs keys_file"), (str(tmp_path / "missing.json"), "cannot be read")):
        sa = {"enabled": True, "malicious_server": True, "threshold": 0.7, "keys_file": keys_file}
        with pytest.raises(ConfigError, match=why):
            make_app(open_service(small_config(tmp_path, {"secure_aggregation": sa})), None)
