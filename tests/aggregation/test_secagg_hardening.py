"""Secure aggregation against hostile parties: unusable or copied keys, misaddressed messages,
a threshold a server lowered, crypto errors that must become the protocol's abort, non-finite
inputs that must never be masked, and a SecAgg+ graph nobody knew before the keys were in."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shoal.aggregation.secagg import (
    KeyDirectory,
    PublicKeys,
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    SecAggRefused,
    SecAggServer,
    ShareDelivery,
)
from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg.encoding import FixedPoint, encode_weighted
from shoal.aggregation.secagg.memory import run_in_memory
from shoal.config import load_config
from shoal.errors import ConfigError

P = 2**255 - 19
SMALL_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    (P - 1).to_bytes(32, "little"),
    P.to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
    bytes.fromhex("5f9c95bca3508c24b1d0b1559c83ef5b04445cc4581c8e86d8224eddd09f1157"),
    bytes.fromhex("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f"),
]


def ids(n):
    return [f"c{i:02d}" for i in range(n)]


def setup(n=4, graph="full", degree=0, size=6):
    params = SecAggParams(b"hostile", size, graph, degree)
    clients = {c: SecAggClient(c, params, C.Randomness(f"h{c}".encode())) for c in ids(n)}
    return params, clients, SecAggServer(params, ids(n))


@pytest.mark.parametrize("bad", SMALL_ORDER)
def test_small_order_keys_are_refused_by_the_server_and_change_nothing(bad):
    params, clients, server = setup()
    honest = clients["c00"].advertise_keys()
    for msg in (PublicKeys("c00", bad, honest.mask_key), PublicKeys("c00", honest.enc_key, bad)):
        with pytest.raises(SecAggProtocolError, match="small order"):
            server.receive_keys(msg)
    server.receive_keys(honest)  # the real keys are still taken
    assert list(server._keys) == ["c00"]


def test_a_copied_key_is_refused_even_in_another_encoding():
    params, clients, server = setup()
    a = clients["c00"].advertise_keys()
    server.receive_keys(a)
    b = clients["c01"].advertise_keys()
    high_bit = bytes(a.mask_key[:31]) + bytes([a.mask_key[31] | 0x80])  # the same u-coordinate for X25519
    for msg in (PublicKeys("c01", a.enc_key, b.mask_key), PublicKeys("c01", b.enc_key, high_bit)):
        with pytest.raises(SecAggProtocolError, match="already advertised"):
            server.receive_keys(msg)
    server.receive_keys(b)


def _directories(params, clients, server):
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    return server.close_advertise()


def test_a_client_refuses_messages_addressed_to_another_client():
    params, clients, server = setup()
    dirs = _directories(params, clients, server)
    with pytest.raises(SecAggRefused, match="addressed to 'c01'"):
        clients["c00"].share_keys(dirs["c01"])
    for c, d in dirs.items():
        server.receive_shares(clients[c].share_keys(d))
    deliveries = server.close_share()
    with pytest.raises(SecAggRefused, match="addressed to 'c01'"):
        clients["c00"].masked_input(deliveries["c01"], np.zeros(6, np.uint32))
    for c, d in deliveries.items():
        server.receive_masked(clients[c].masked_input(d, np.zeros(6, np.uint32)))
    requests = server.close_masked()
    with pytest.raises(SecAggRefused, match="addressed to 'c01'"):
        clients["c00"].unmask(requests["c01"])


def test_a_misrouted_secagg_plus_delivery_would_change_the_sum_and_is_refused():
    """In a sparse graph two clients' deliveries differ: the one for c_j given to c_i (and
    relabelled as its own) names senders c_i does not mask with as c_j does."""
    params, clients, server = setup(n=8, graph="secagg+", degree=2)
    dirs = _directories(params, clients, server)
    for c, d in dirs.items():
        server.receive_shares(clients[c].share_keys(d))
    deliveries = server.close_share()
    a, b = (
        "c00",
        next(
            c
            for c in ids(8)
            if c != "c00"
            and set(deliveries[c].ciphertexts) != set(deliveries["c00"].ciphertexts)
            and "c00" in deliveries[c].ciphertexts
        ),
    )
    with pytest.raises(SecAggRefused):
        clients[a].masked_input(deliveries[b], np.zeros(6, np.uint32))
    relabelled = ShareDelivery(a, deliveries[b].ciphertexts)  # senders outside a's neighbourhood
    with pytest.raises(SecAggRefused, match="outside its neighbourhood"):
        clients[a].masked_input(relabelled, np.zeros(6, np.uint32))


@pytest.mark.parametrize("tamper", ["low_threshold", "small_order_peer", "copied_peer_key", "same_points"])
def test_a_client_aborts_on_a_directory_it_cannot_trust(tamper):
    params, clients, server = setup(n=5)
    d = _directories(params, clients, server)["c00"]
    peers = dict(d.peers)
    if tamper == "low_threshold":
        d = KeyDirectory("c00", 1, peers)
    elif tamper == "small_order_peer":
        peers["c01"] = dataclasses.replace(peers["c01"], mask_key=bytes(32))
        d = KeyDirectory("c00", d.threshold, peers)
    elif tamper == "copied_peer_key":
        peers["c02"] = dataclasses.replace(peers["c02"], enc_key=peers["c01"].enc_key)
        d = KeyDirectory("c00", d.threshold, peers)
    else:
        peers["c02"] = dataclasses.replace(peers["c02"], index=peers["c01"].index)
        d = KeyDirectory("c00", d.threshold, peers)
    with pytest.raises(SecAggAborted):
        clients["c00"].share_keys(d)


def test_a_crypto_error_at_unmasking_is_the_protocols_abort_not_a_value_error():
    """Should a small-order key ever get past the checks (here: put in by hand), rebuilding a
    dropped client's masks aborts the round instead of raising ValueError out of the server."""
    params, clients, server = setup(n=4)
    dirs = _directories(params, clients, server)
    for c, d in dirs.items():
        server.receive_shares(clients[c].share_keys(d))
    deliveries = server.close_share()
    for c in ids(3):
        server.receive_masked(clients[c].masked_input(deliveries[c], np.zeros(6, np.uint32)))
    requests = server.close_masked()  # c03 dropped: its masks with c00..c02 are rebuilt at finish
    for c, r in requests.items():
        server.receive_unmask(clients[c].unmask(r))
    server._keys["c00"] = PublicKeys("c00", server._keys["c00"].enc_key, bytes(32))
    with pytest.raises(SecAggAborted, match="cannot be rebuilt"):
        server.finish()


def test_non_finite_input_is_never_encoded_for_masking():
    fp = FixedPoint(1.0, 16, 4)
    x = np.zeros(5)
    encode_weighted(x, 0.5, fp, fp, np.random.default_rng(0))
    for bad in (np.nan, np.inf, -np.inf):
        x[2] = bad
        with pytest.raises(ValueError, match="NaN/Inf"):
            encode_weighted(x, 0.5, fp, fp, np.random.default_rng(0))


def test_secagg_plus_graph_is_drawn_from_the_advertised_keys():
    """Not known before the keys are in; the same keys give the same graph (anyone can
    check it), other keys another one; the sum is right either way."""
    size = 4
    inputs = {c: np.full(size, i, np.uint32) for i, c in enumerate(ids(12))}
    params = SecAggParams(b"graph", size, "secagg+", degree=4, graph_seed=7)
    graphs = []
    for seed in (1, 1, 2):
        result, _ = run_in_memory(params, inputs, seed=seed)
        assert np.array_equal(result.total, np.full(size, sum(range(12)), np.uint32))
        server = SecAggServer(params, ids(12))
        assert server.graph_seed is None  # nothing fixed before the advertisements
        cl = {c: SecAggClient(c, params, C.Randomness(f"{seed}/{c}".encode())) for c in ids(12)}
        for c in cl.values():
            server.receive_keys(c.advertise_keys())
        server.close_advertise()
        graphs.append((server.graph_seed, server.graph))
    assert graphs[0] == graphs[1] and graphs[0][0] != graphs[2][0] and graphs[0][1] != graphs[2][1]


@pytest.mark.parametrize(
    "extra, why",
    [
        (["secure_aggregation.threshold=0.49"], "threshold = 0.49 must be in \\[0.5, 1\\)"),
        (["secure_aggregation.threshold=0.0"], "threshold"),
        (["secure_aggregation.graph='secagg+'", "secure_aggregation.degree=1"], "degree = 1"),
    ],
)
def test_threshold_floor_and_secagg_plus_degree_are_config_errors(extra, why):
    with pytest.raises(ConfigError, match=why):
        load_config(None, ["secure_aggregation.enabled=true", *extra])
    load_config(
        None,
        [
            "secure_aggregation.enabled=true",
            "secure_aggregation.threshold=0.5",
            "secure_aggregation.graph='secagg+'",
            "secure_aggregation.degree=2",
        ],
    )


def test_simulator_leaves_a_nan_client_out_of_the_secure_sum():
    import torch

    from shoal.simulations.inprocess import InProcessSimulation

    cfg = load_config(
        None,
        [
            "simulation.rounds=1",
            "simulation.num_clients=12",
            "simulation.clients_per_round=6",
            "secure_aggregation.enabled=true",
            "attack.kind='nan'",
            "attack.fraction=0.5",
        ],
    )
    sim = InProcessSimulation.from_config(cfg)
    s = sim.run_round()
    assert s.version == 1 and s.rejected.get("non_finite", 0) >= 1
    assert sim.secure_aggregation.last["included"] == 6 - s.rejected["non_finite"]
    assert bool(torch.isfinite(sim.global_params).all())
