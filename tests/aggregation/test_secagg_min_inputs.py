"""secure_aggregation.min_inputs: a sum of fewer masked inputs is never unmasked, by the
server's state machine nor by a client asked to help (whatever the server's parameters say)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from shoal.aggregation.secagg import SecAggAborted, SecAggClient, SecAggParams, SecAggRefused, SecAggServer
from shoal.aggregation.secagg.memory import run_in_memory
from shoal.aggregation.secagg.wire import params_from_json, params_to_json
from shoal.client.secure_node import _own_minimum
from shoal.config import config_from_dict
from shoal.errors import ConfigError, Malformed

SIZE = 6
IDS = ["a", "b", "c"]


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {u: rng.integers(0, 2**32, SIZE, dtype=np.uint32) for u in IDS}


def test_the_server_aborts_a_sum_below_min_inputs_though_the_threshold_allows_it():
    # 3 clients, t = 2: one dropout before its masked input leaves a sum of 2
    plain = SecAggParams(b"s", SIZE, "full", threshold_fraction=0.5)
    result, _ = run_in_memory(plain, _inputs(), {"c": "masked"}, seed=1)
    assert result.included == ["a", "b"]  # min_inputs = 1: the threshold alone decides
    guarded = SecAggParams(b"s", SIZE, "full", threshold_fraction=0.5, min_inputs=3)
    with pytest.raises(SecAggAborted, match="a sum of 2 masked inputs is not unmasked.*min_inputs = 3"):
        run_in_memory(guarded, _inputs(), {"c": "masked"}, seed=1)
    result, _ = run_in_memory(guarded, _inputs(), seed=1)  # all three: unmasked
    assert result.included == IDS


def test_a_client_refuses_to_unmask_a_small_sum_a_server_asks_for():
    """The server runs with min_inputs = 1 (or lies about it); the clients hold 3 and refuse."""
    server = SecAggServer(SecAggParams(b"s", SIZE, "full", min_inputs=1), IDS)
    clients = {u: SecAggClient(u, SecAggParams(b"s", SIZE, "full", min_inputs=3)) for u in IDS}
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    for u, d in server.close_advertise().items():
        server.receive_shares(clients[u].share_keys(d))
    deliveries = server.close_share()
    for u in ("a", "b"):  # c drops before its masked input
        server.receive_masked(clients[u].masked_input(deliveries[u], _inputs()[u]))
    requests = server.close_masked()
    with pytest.raises(SecAggRefused, match="a sum of 2 masked inputs, fewer than secure_aggregation.min_inputs = 3"):
        clients["a"].unmask(requests["a"])


def test_min_inputs_travels_with_the_round_and_a_node_keeps_its_own():
    params = SecAggParams(b"s", SIZE, "full", min_inputs=2)
    assert params_from_json(params_to_json(params)).min_inputs == 2
    with pytest.raises(Malformed, match="min_inputs"):
        params_from_json({**params_to_json(params), "min_inputs": 0})
    node = SimpleNamespace(secure_cfg=config_from_dict({}).secure_aggregation)  # the default: 3
    assert _own_minimum(node, params, selected=5).min_inputs == 3  # the larger of the two
    with pytest.raises(Malformed, match="selects 2 nodes, fewer than this node's secure_aggregation.min_inputs = 3"):
        _own_minimum(node, params, selected=2)


def test_a_config_that_selects_fewer_than_min_inputs_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="server.clients_per_round = 2 with secure aggregation.*min_inputs = 3"):
        config_from_dict({"secure_aggregation": {"enabled": True}, "server": {"clients_per_round": 2}}).validate()
    for low in (0, 1, 2):  # no config, of a server, a node or a simulation, lets a sum of 1 or 2 be unmasked
        with pytest.raises(ConfigError, match=f"min_inputs = {low} must be >= 3"):
            config_from_dict({"secure_aggregation": {"min_inputs": low}}).validate()
    ok = {"secure_aggregation": {"enabled": True, "min_inputs": 3}, "simulation": {"clients_per_round": 3}}
    assert config_from_dict(ok).validate().secure_aggregation.min_inputs == 3
