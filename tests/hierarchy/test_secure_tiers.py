"""Secure aggregation across tiers (aggregation/secagg/tiers.py): the root takes an edge's masked
sum as its nodes' masked inputs, each node once; a lost edge is its nodes' drop-out; and an
edge's view of a round (everything it received, both ways) is independent of its nodes' inputs."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from shoal.aggregation.secagg import (
    EncryptedShares,
    KeyDirectory,
    MaskedInput,
    MaskedSum,
    PublicKeys,
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    SecAggServer,
    ShareDelivery,
    UnmaskRequest,
)
from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg.tiers import (
    EdgeMaskedSum,
    EdgeView,
    RootKey,
    open_at_root,
    run_through_edges,
    seal_for_root,
)
from shoal.aggregation.secagg.wire import decode_message, encode_message
from shoal.errors import Malformed

NINE = [f"n{i}" for i in range(9)]
EDGE_OF = {n: f"e{i // 3}" for i, n in enumerate(NINE)}  # e0: n0-n2, e1: n3-n5, e2: n6-n8


def params(size: int, session: bytes = b"tiers") -> SecAggParams:
    return SecAggParams(session=session, vector_size=size)


def plain_sum(inputs: dict[str, np.ndarray], who) -> np.ndarray:
    total = np.zeros_like(next(iter(inputs.values())))
    for c in who:
        total += inputs[c]
    return total


def random_inputs(seed: int, size: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {c: g.integers(0, 2**24, size, dtype=np.uint32) for c in NINE}


# --- the root's state machine: a masked sum for several nodes ----------------------------------------


def to_masked_stage(size: int = 8):
    p = params(size)
    server = SecAggServer(p, NINE)
    clients = {c: SecAggClient(c, p, C.Randomness(f"seed/{c}".encode())) for c in NINE}
    for c in NINE:
        server.receive_keys(clients[c].advertise_keys())
    for c, d in server.close_advertise().items():
        server.receive_shares(clients[c].share_keys(d))
    deliveries = server.close_share()
    return server, clients, deliveries


def snapshot(server: SecAggServer):
    return server.stage, list(server.u3), server._total.copy()


def test_a_masked_sum_counts_its_nodes_once_and_a_bad_one_is_refused_whole() -> None:
    size = 8
    server, clients, deliveries = to_masked_stage(size)
    inputs = random_inputs(1, size)
    masked = {c: clients[c].masked_input(deliveries[c], inputs[c]) for c in NINE}
    e0 = EdgeMaskedSum("e0", size, ["n0", "n1", "n2"])
    for c in ("n0", "n1", "n2"):
        e0.add(masked[c])
    server.receive_masked_sum(e0.sealed())
    server.receive_masked(masked["n3"])  # a node beside the edges still sends its own
    before = snapshot(server)
    y = masked["n4"].vector + masked["n5"].vector
    for bad, why in (
        (MaskedSum("e1", ("n4", "n0"), y), r"n0.*already in the sum"),  # n0 is in e0's sum
        (MaskedSum("e1", ("n4", "n3"), y), r"n3.*already in the sum"),  # n3 sent its own
        (MaskedSum("e1", ("n4", "n4"), y), "distinct"),
        (MaskedSum("e1", (), y), "distinct"),
        (MaskedSum("e1", ("n4", "stranger"), y), r"stranger.*not in the round"),
        (MaskedSum("e1", ("n4", "n5"), y[:-1]), "shape"),
        (MaskedSum("e1", ("n4", "n5"), y.astype(np.int64)), "uint32"),
    ):
        with pytest.raises(SecAggProtocolError, match=why):
            server.receive_masked_sum(bad)
        after = snapshot(server)
        assert after[:2] == before[:2] and np.array_equal(after[2], before[2])  # nothing changed
    with pytest.raises(SecAggProtocolError, match="already sent"):
        server.receive_masked(masked["n1"])  # and a node inside a sum cannot add itself again
    server.receive_masked_sum(MaskedSum("e1", ("n4", "n5"), y))
    # n6-n8's edge never delivers: they are drop-outs, recovered through the others' shares
    requests = server.close_masked()
    assert sorted(requests) == NINE[:6] and requests["n0"].dropped == ["n6", "n7", "n8"]
    for c, r in requests.items():
        server.receive_unmask(clients[c].unmask(r))
    result = server.finish()
    assert result.included == NINE[:6] and result.dropped == ["n6", "n7", "n8"]
    assert np.array_equal(result.total, plain_sum(inputs, NINE[:6]))


def test_an_edge_sum_refuses_strangers_repeats_and_wrong_shapes() -> None:
    e = EdgeMaskedSum("e0", 4, ["a", "b"])
    e.add(MaskedInput("a", np.arange(4, dtype=np.uint32)))
    for bad, why in (
        (MaskedInput("c", np.zeros(4, np.uint32)), "no part"),
        (MaskedInput("a", np.zeros(4, np.uint32)), "already"),
        (MaskedInput("b", np.zeros(3, np.uint32)), "shape"),
    ):
        with pytest.raises(SecAggProtocolError, match=why):
            e.add(bad)
    assert e.senders == ["a"] and not e.complete
    e.add(MaskedInput("b", np.full(4, 2**32 - 1, np.uint32)))  # wraps mod 2^32
    part = e.sealed()
    assert part is not None and part.senders == ("a", "b") and e.complete
    assert np.array_equal(part.vector, (np.arange(4, dtype=np.uint32) - np.uint32(1)))


def test_the_sealed_unmasking_opens_only_at_the_root_for_its_sender_and_session() -> None:
    root, other = RootKey.new(C.Randomness(b"root")), RootKey.new(C.Randomness(b"edge"))
    blob = seal_for_root(b"shares", root.public, b"s1", "n0", C.Randomness(b"x"))
    assert open_at_root(blob, root, b"s1", "n0") == b"shares"
    assert open_at_root(blob, other, b"s1", "n0") is None  # an edge's own key
    assert open_at_root(blob, root, b"s1", "n1") is None  # relabelled to another node
    assert open_at_root(blob, root, b"s2", "n0") is None  # replayed into another round
    assert open_at_root(blob[:-1] + bytes([blob[-1] ^ 1]), root, b"s1", "n0") is None
    assert open_at_root(blob[:20], root, b"s1", "n0") is None


# --- whole rounds through edges ------------------------------------------------------------------------


def test_through_edges_the_root_gets_the_plain_sum_with_drop_outs_and_lost_edges() -> None:
    size = 64
    inputs = random_inputs(2, size)
    result, cost = run_through_edges(params(size), inputs, EDGE_OF, seed=3)
    assert result.included == NINE and np.array_equal(result.total, plain_sum(inputs, NINE))
    # the root takes 3 masked sums (and the names inside) instead of 9 masked inputs
    assert cost.links["client_edge_up"] - cost.links["edge_root_up"] == (9 - 3) * 4 * size - 3 * len("n0 n1 n2 ")
    for stage, included in (
        ("advertise", NINE[:6]),  # e2 never got its nodes' keys through: not in the round
        ("share", NINE[:6]),
        ("masked", NINE[:6]),  # its nodes masked, the sum never came: drop-outs, masks removed
        ("unmask", NINE),  # the sum came, the unmasking answers did not: the others' shares do
    ):
        result, _ = run_through_edges(params(size), inputs, EDGE_OF, {"n1": "masked"}, {"e2": stage}, seed=4)
        want = [c for c in included if c != "n1"]
        assert result.included == want, stage
        assert np.array_equal(result.total, plain_sum(inputs, want)), stage
    # two of three edges lost before the masked sums: 3 survivors, below the threshold of 5
    with pytest.raises(SecAggAborted):
        run_through_edges(params(size), inputs, EDGE_OF, lost_at={"e1": "masked", "e2": "masked"}, seed=5)


def view_of(edge: str, inputs: dict[str, np.ndarray], seed: int, lost_at=None) -> tuple[EdgeView, dict]:
    views: dict[str, EdgeView] = {}
    size = len(next(iter(inputs.values())))
    result, _ = run_through_edges(
        params(size, f"view/{seed}".encode()), inputs, EDGE_OF, lost_at=lost_at, seed=seed, views=views
    )
    return views[edge], {"result": result}


def masked_values(view: EdgeView) -> np.ndarray:
    """Every masked word the edge holds: its nodes' masked inputs and the sum it sent up."""
    vectors = [m.vector for stage, m in view.up if stage == "masked"]
    assert view.masked_sum is not None
    return np.concatenate([*vectors, view.masked_sum.vector])


ALPHA = 1e-3  # per statistical check below; 6 checks: at most a 0.6% chance a correct protocol fails them


def test_an_edge_view_is_uniform_and_independent_of_its_nodes_inputs() -> None:
    """Two very different input sets (all zero; the encoding's largest value in every entry) through
    the same tree: the words an edge holds (3 masked inputs and their sum, 4 x 4096 per round, 2 rounds
    per input set) are uniform mod 2^32 (chi-square on the top and the low 8 bits, KS on the whole
    word) and their distribution is the same under both input sets (chi-square homogeneity on the
    top and the low 8 bits). The same homogeneity check rejects the unmasked inputs at p < 1e-12, so
    it has power; each check errs at most ALPHA under the null."""
    size = 4096
    zeros = {c: np.zeros(size, np.uint32) for c in NINE}
    big = {c: np.full(size, 2**24 - 1, np.uint32) for c in NINE}
    pooled = {}
    for name, inputs in (("zeros", zeros), ("big", big)):
        words = []
        for seed in (11, 12):
            view, out = view_of("e0", inputs, seed)
            assert np.array_equal(out["result"].total, plain_sum(inputs, NINE))  # the root is still exact
            words.append(masked_values(view))
        pooled[name] = np.concatenate(words)
    for name, v in pooled.items():
        for shift in (24, 0):  # the top 8 bits, the low 8 bits
            counts = np.bincount(((v >> shift) & 0xFF).astype(np.int64), minlength=256)
            assert stats.chisquare(counts).pvalue > ALPHA, (name, shift)
    assert stats.kstest(pooled["big"] / 2.0**32, "uniform").pvalue > ALPHA

    def homogeneity(a: np.ndarray, b: np.ndarray, shift: int) -> float:
        table = np.stack([np.bincount(((x >> shift) & 0xFF).astype(np.int64), minlength=256) for x in (a, b)])
        return stats.chi2_contingency(table[:, table.sum(0) > 0]).pvalue

    for shift in (24, 0):
        assert homogeneity(pooled["zeros"], pooled["big"], shift) > ALPHA
    # power: the same test on what the edge would hold without masks
    plain_zero = np.concatenate([zeros[c] for c in NINE[:3]] + [plain_sum(zeros, NINE[:3])])
    plain_big = np.concatenate([big[c] for c in NINE[:3]] + [plain_sum(big, NINE[:3])])
    jitter = np.random.default_rng(0).integers(0, 2**16, plain_big.size, dtype=np.uint32)  # not a constant table
    assert homogeneity(plain_zero + jitter, plain_big + jitter, 24) < 1e-12


def test_an_edge_holds_no_unmasking_material_even_when_another_edge_is_lost() -> None:
    """e1 is lost after its nodes masked, so the root asks e0's nodes for e1's nodes' mask keys and
    for their own self masks: with those in the clear e0 could unmask its own group's sum. They pass
    through e0 sealed to the root: what e0 holds is public keys, ciphertexts under pair keys only the
    nodes agree, survivor lists, masked words and sealed blobs; no node's secret appears in it."""
    size = 32
    inputs = random_inputs(7, size)
    views: dict[str, EdgeView] = {}
    clients: dict[str, SecAggClient] = {}
    original = SecAggClient.__init__

    def keep(self, cid, *args, **kwargs):  # the test (not the edge) looks into the nodes' secrets
        original(self, cid, *args, **kwargs)
        clients[cid] = self

    SecAggClient.__init__ = keep  # type: ignore[method-assign]
    try:
        result, _ = run_through_edges(
            params(size, b"lost"), inputs, EDGE_OF, lost_at={"e1": "masked"}, seed=8, views=views
        )
    finally:
        SecAggClient.__init__ = original  # type: ignore[method-assign]
    assert result.included == [*NINE[:3], *NINE[6:]] and result.dropped == NINE[3:6]
    assert np.array_equal(result.total, plain_sum(inputs, result.included))
    view = views["e0"]
    kinds = {type(m) for _, m in view.up + view.down}
    assert kinds <= {PublicKeys, KeyDirectory, EncryptedShares, ShareDelivery, MaskedInput, UnmaskRequest, bytes}
    # the unmasking answers: sealed blobs that are no message, and do not open under another key
    sealed = [m for stage, m in view.up if stage == "unmask"]
    assert len(sealed) == 3 and all(isinstance(b, bytes) for b in sealed)
    edge_key = RootKey.new(C.Randomness(b"the edge's own"))
    for node, blob in zip(NINE[:3], sealed, strict=True):
        with pytest.raises(Malformed):
            decode_message(blob, size)
        assert open_at_root(blob, edge_key, b"lost", node) is None
    # the requests asked e0's nodes for what would unmask e0's group: mask keys of e1's nodes
    asked = [m for stage, m in view.down if stage == "masked"]
    assert all(set(r.dropped) == set(NINE[3:6]) for r in asked)
    # no node's secret (self-mask seed, mask key, encryption key) is anywhere in the edge's view
    secrets = [s for c in clients.values() for s in (c._seed, c._mask_sk, c._enc_sk)]
    blob = b"".join(
        m if isinstance(m, bytes) else encode_message(m) for _, m in view.up + view.down if not isinstance(m, MaskedSum)
    )
    assert len(secrets) == 27 and not any(s in blob for s in secrets)
    # every share ciphertext opens under its pair's key (the nodes'), none under a key the edge can agree
    mine = C.private_key(C.generate_private(C.Randomness(b"edge agreement")))
    info = b"shoal secagg v1 share encryption"
    for _, m in view.up:
        if isinstance(m, EncryptedShares):
            for to, ct in m.ciphertexts.items():
                ad = b"|".join([b"lost", m.sender.encode(), to.encode()])
                assert C.decrypt(clients[m.sender]._share_key(to), ct, ad) is not None
                for pk in (p for _, d in view.down if isinstance(d, KeyDirectory) for p in d.peers.values()):
                    assert C.decrypt(C.agree(mine, pk.enc_key, info, b"lost"), ct, ad) is None


def test_an_edge_relay_adds_only_its_nodes_masked_inputs_and_sends_when_due() -> None:
    """server/edge/secure.py's EdgeRelay, without I/O: it takes a masked input only from a node of
    its round, once, as that node; its sum goes up when every node it relayed into the round sent
    one (or was refused by the root), or at its deadline; a root answer that is no secure round it
    can relay is refused with nothing changed."""
    from shoal.aggregation.secagg.wire import params_to_json
    from shoal.errors import SpecMismatch, UpdateRejected
    from shoal.server.edge.secure import EdgeRelay

    size = 6
    info = {**params_to_json(params(size)), "root_key": "a2V5", "stage_s": 4.0}
    relay = EdgeRelay(stage_s=30.0, margin_s=1.0)
    for bad in ([1], {**info, "malicious": True}, {k: v for k, v in info.items() if k != "root_key"}):
        with pytest.raises(Malformed):
            relay.start(1, 0, ["a", "b", "c"], bad, now=0.0)
        assert relay.key is None and not relay.secure
    relay.start(1, 0, ["a", "b", "c"], info, now=0.0)
    assert relay.secure and relay.wants_task("a")
    for n in ("a", "b", "c"):
        relay.answered(n, "keys", 200, 0.1)
    relay.answered("c", "shares", 409, 0.2)  # the root excluded c
    assert not relay.wants_task("a") and relay.stage_s == 4.0

    def body(sender: str, n: int = size) -> bytes:
        return encode_message(MaskedInput(sender, np.full(n, 7, np.uint32)), {"round": 1})

    relay.delivered(1.0)
    relay.add("a", body("a"))
    for node, b, err in (
        ("a", body("a"), UpdateRejected),  # twice
        ("b", body("a"), Malformed),  # posing as another node
        ("b", body("b", size - 1), SpecMismatch),  # wrong size
        ("z", body("z"), UpdateRejected),  # not in this round here
    ):
        with pytest.raises(err):
            relay.add(node, b)
    assert relay.sum is not None and relay.sum.senders == ["a"]
    assert not relay.due(2.0)  # b has not sent yet (c is out)
    assert relay.due(1.0 + 4.0 - 1.0)  # the root's masked stage closes soon: send what is there
    relay.add("b", body("b"))
    assert relay.due(2.0)
    sent, nodes = relay.take_sum("edge-x")
    msg = decode_message(sent, size)
    assert nodes == 2 and isinstance(msg, MaskedSum) and msg.senders == ("a", "b") and msg.origin == "edge-x"
    assert np.array_equal(msg.vector, np.full(size, 14, np.uint32)) and not relay.due(3.0)
    with pytest.raises(UpdateRejected):
        relay.add("c", body("c"))  # after the sum went up
