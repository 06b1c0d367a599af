"""Secure aggregation against a malicious server (Bonawitz et al. 2017, the active variant):
the test plays a server that swaps a node's advertised key, or shows different survivor lists
to different nodes to get both secrets of one node; the honest nodes abort without revealing
anything. With an honest server the signed protocol sums exactly as the plain one does."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shoal.aggregation.secagg import (
    ConsistencyRequest,
    KeyDirectory,
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    SecAggServer,
    UnmaskRequest,
)
from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg import identity as ID
from shoal.aggregation.secagg.memory import STAGES, run_in_memory
from shoal.aggregation.secagg.wire import decode_message, encode_message
from shoal.errors import ConfigError

N, SIZE = 6, 12


def ids(n=N):
    return [f"c{i:02d}" for i in range(n)]


def params(**kw):
    return SecAggParams(b"malicious", SIZE, "full", threshold_fraction=2 / 3, malicious=True, **kw)


def parties(n=N):
    p = params()
    keys = {c: ID.new_identity(C.Randomness(f"id{c}".encode()).bytes(32)) for c in ids(n)}
    roster = {c: ID.identity_public(k) for c, k in keys.items()}
    clients = {c: SecAggClient(c, p, C.Randomness(f"r{c}".encode()), keys[c], roster) for c in ids(n)}
    return p, clients, SecAggServer(p, ids(n))


def inputs(n=N):
    rng = np.random.default_rng(0)
    return {c: rng.integers(0, 2**16, SIZE, dtype=np.uint32) for c in ids(n)}


def exact(x, who):
    return (sum(x[c].astype(np.uint64) for c in who) % 2**32).astype(np.uint32)


@pytest.mark.parametrize("drops", [{}, {"c05": "masked"}, {"c05": "unmask"}, {"c04": "share"}])
def test_an_honest_server_with_signatures_sums_exactly(drops):
    x = inputs()
    result, cost = run_in_memory(params(), x, drops, seed=3)
    assert np.array_equal(result.total, exact(x, result.included))
    assert set(result.included) == {c for c in ids() if drops.get(c) not in ("advertise", "share", "masked")}


def test_stages_match_the_honest_mode_when_nobody_cheats():
    """Same inputs, same seed: the malicious-server variant gives the plain variant's sum."""
    x = inputs()
    plain, _ = run_in_memory(SecAggParams(b"malicious", SIZE, "full", threshold_fraction=2 / 3), x, seed=1)
    signed, _ = run_in_memory(params(), x, seed=1)
    assert np.array_equal(plain.total, signed.total) and plain.included == signed.included


def _through_masked(p, clients, server, x, tamper_directory=None):
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    directories = server.close_advertise()
    if tamper_directory:
        directories = tamper_directory(directories)
    shares = {}
    for c, d in directories.items():
        shares[c] = clients[c].share_keys(d)
    for msg in shares.values():
        server.receive_shares(msg)
    for c, d in server.close_share().items():
        server.receive_masked(clients[c].masked_input(d, x[c]))
    return server.close_masked()


def test_a_swapped_key_makes_every_honest_node_abort_before_sharing_anything():
    """The server puts its own mask key in place of c01's (to learn c01's pairwise masks):
    the key no longer carries c01's signature, and every node that sees it aborts in the
    share stage, before a single share is encrypted."""
    p, clients, server = parties()
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    directories = server.close_advertise()
    mine = C.public_key(C.generate_private(C.Randomness(b"server")))
    swapped = {
        u: KeyDirectory(
            d.recipient, d.threshold, {**d.peers, "c01": dataclasses.replace(d.peers["c01"], mask_key=mine)}
        )
        for u, d in directories.items()
    }
    for c in ids():
        if c == "c01":
            continue
        with pytest.raises(SecAggAborted, match="not signed by 'c01'"):
            clients[c].share_keys(swapped[c])
        assert clients[c].stage == "aborted"  # no share left it, and none will
    # re-signing needs c01's identity key; a node of the server's own (not in the keys file) is refused
    enc, mask = (C.public_key(C.generate_private(C.Randomness(s))) for s in (b"e", b"m"))
    own = ID.new_identity()
    sig = ID.sign(own, ID.keys_message(p.session, "zz", enc, mask))
    sybil = {
        **directories["c01"].peers,
        "zz": dataclasses.replace(directories["c01"].peers["c02"], index=99, enc_key=enc, mask_key=mask, signature=sig),
    }
    with pytest.raises(SecAggAborted, match="not in the keys file"):
        clients["c01"].share_keys(KeyDirectory("c01", directories["c01"].threshold + 1, sybil))


def test_equivocating_survivor_lists_make_the_honest_nodes_abort_without_revealing():
    """c05 sent its masked input. The server tells group A = {c00, c01, c02} that c05
    survived (to get b_c05's shares) and group B = {c03, c04} that c05 dropped (to get
    s_sk_c05's shares): with both it could strip c05's masks and read its input. The
    consistency round shows it: each group's signatures are over another list, and every
    node aborts before sending a share."""
    p, clients, server = parties()
    x = inputs()
    requests = _through_masked(p, clients, server, x)
    assert sorted(requests) == ids()
    a, b = ["c00", "c01", "c02"], ["c03", "c04"]
    signatures = {}
    for c in a:
        signatures[c] = clients[c].consistency_check(ConsistencyRequest(c, ids())).signature
    for c in b:
        signatures[c] = clients[c].consistency_check(ConsistencyRequest(c, ids()[:5])).signature
    revealed = []
    for c in a + b:
        survivors = ids() if c in a else ids()[:5]
        dropped = [] if c in a else ["c05"]
        with pytest.raises(SecAggAborted, match="did not sign the survivor list"):
            revealed.append(clients[c].unmask(UnmaskRequest(c, survivors, dropped, dict(signatures))))
        assert clients[c].stage == "aborted"
        # once caught, the node answers nothing more, not even a request that would pass alone
        own_group = {v: signatures[v] for v in (a if c in a else b)}
        with pytest.raises(SecAggProtocolError):
            revealed.append(clients[c].unmask(UnmaskRequest(c, survivors, dropped, own_group)))
    assert revealed == []


def test_unmask_requests_must_match_the_signed_list_and_carry_t_signatures():
    p, clients, server = parties()
    x = inputs()
    requests = _through_masked(p, clients, server, x)
    for c, r in requests.items():
        server.receive_consistency(clients[c].consistency_check(r))
    honest = server.close_consistency()
    clients["c00"]
    r = honest["c00"]
    cases = [
        ("equivocates", "c00", UnmaskRequest("c00", r.survivors[:-1], [r.survivors[-1]], r.signatures)),
        (
            "threshold",
            "c01",
            UnmaskRequest("c01", r.survivors, r.dropped, {v: r.signatures[v] for v in ["c00", "c01", "c02"]}),
        ),  # t = 5 of 6
        (
            "did not sign",
            "c02",
            UnmaskRequest("c02", r.survivors, r.dropped, {**r.signatures, "c03": r.signatures["c04"]}),
        ),
    ]
    for why, c, bad in cases:
        with pytest.raises(SecAggAborted, match=why):
            clients[c].unmask(bad)
    for c in ("c03", "c04", "c05"):  # the others answer the honest requests; 3 < t: nothing to rebuild
        server.receive_unmask(clients[c].unmask(honest[c]))
    with pytest.raises(SecAggAborted, match="answered the unmasking"):
        server.finish()


def test_the_server_refuses_unsigned_keys_and_params_refuse_weak_settings():
    p, clients, server = parties()
    keys = clients["c00"].advertise_keys()
    with pytest.raises(SecAggProtocolError, match="signed"):
        server.receive_keys(dataclasses.replace(keys, signature=b""))
    with pytest.raises(ValueError, match="2/3"):
        SecAggParams(b"s", 4, "full", threshold_fraction=0.5, malicious=True)
    with pytest.raises(ValueError, match="full graph"):
        SecAggParams(b"s", 4, "secagg+", threshold_fraction=0.7, malicious=True)
    with pytest.raises(ValueError, match="identity key"):
        SecAggClient("c00", params())  # no identity, no roster


def test_signed_messages_survive_the_wire():
    p, clients, server = parties()
    inputs()
    for c in clients.values():
        msg = c.advertise_keys()
        assert decode_message(encode_message(msg), SIZE) == msg
        server.receive_keys(msg)
    d = server.close_advertise()["c00"]
    assert decode_message(encode_message(d), SIZE) == d
    cr = ConsistencyRequest("c00", ids())
    assert decode_message(encode_message(cr), SIZE) == cr
    sig = clients["c00"].__class__  # noqa: F841 - keeps the import list honest
    ur = UnmaskRequest("c00", ids()[:5], ["c05"], {"c00": bytes(64)})
    assert decode_message(encode_message(ur), SIZE) == ur


def test_keys_file_and_identity_files(tmp_path):
    public = ID.write_identity(tmp_path / "n0.key")
    assert (tmp_path / "n0.key").stat().st_mode & 0o777 == 0o600
    private = ID.read_identity(tmp_path / "n0.key")
    assert ID.identity_public(private) == public
    with pytest.raises(ConfigError, match="exists"):
        ID.write_identity(tmp_path / "n0.key")
    import base64
    import json

    (tmp_path / "keys.json").write_text(json.dumps({"n0": base64.b64encode(public).decode()}))
    assert ID.read_roster(tmp_path / "keys.json") == {"n0": public}
    (tmp_path / "bad.json").write_text(json.dumps({"n0": "abc"}))
    with pytest.raises(ConfigError, match="not base64 of 32 bytes"):
        ID.read_roster(tmp_path / "bad.json")


def test_stage_names_are_unchanged_for_dropout_injection():
    assert STAGES == ("advertise", "share", "masked", "unmask")


def test_the_simulator_runs_the_signed_variant_and_matches_the_plain_one():
    import torch

    from shoal.config import load_config
    from shoal.simulations.inprocess import InProcessSimulation

    base = [
        "simulation.rounds=1",
        "simulation.num_clients=12",
        "simulation.clients_per_round=6",
        "secure_aggregation.enabled=true",
        "secure_aggregation.threshold=0.7",
    ]
    plain = InProcessSimulation.from_config(load_config(None, base))
    signed = InProcessSimulation.from_config(load_config(None, [*base, "secure_aggregation.malicious_server=true"]))
    assert plain.run_round().version == signed.run_round().version == 1
    assert torch.equal(plain.global_params, signed.global_params)  # same seeds: the same masks cancel to the same sum
