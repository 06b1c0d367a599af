"""The secure aggregation protocol: correct sums under dropouts, clean aborts, and
what the server can and cannot see."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from shoal.aggregation.secagg import (
    SecAggAborted,
    SecAggClient,
    SecAggParams,
    SecAggProtocolError,
    SecAggRefused,
    SecAggServer,
    UnmaskRequest,
)
from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg.encoding import FixedPoint
from shoal.aggregation.secagg.graph import threshold
from shoal.aggregation.secagg.memory import STAGES, run_in_memory


def ids(n):
    return [f"c{i:02d}" for i in range(n)]


@st.composite
def rounds(draw):
    n = draw(st.integers(2, 12))
    graph = draw(st.sampled_from(["full", "secagg+"]))
    degree = draw(st.integers(1, n - 1))
    fraction = draw(st.sampled_from([0.0, 0.3, 0.5, 0.7]))
    size = draw(st.integers(1, 40))
    # a client drops with probability 0.4, at a uniformly drawn stage
    drops = draw(st.lists(st.sampled_from([None] * 6 + list(STAGES)), min_size=n, max_size=n))
    seed = draw(st.integers(0, 2**31))
    return n, graph, degree, fraction, size, drops, seed


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rounds())
def test_unmasked_sum_is_the_plain_sum_of_the_included_or_the_round_aborts(case):
    n, graph, degree, fraction, size, drops, seed = case
    rng = np.random.default_rng(seed)
    fp = FixedPoint(clip=1.0, bits=16, max_summands=n)
    xs = {c: rng.uniform(-1, 1, size) for c in ids(n)}
    encoded = {c: fp.encode(x, rng) for c, x in xs.items()}
    drop_at = {c: s for c, s in zip(ids(n), drops) if s is not None}
    params = SecAggParams(b"round-1", size, graph, degree, fraction, graph_seed=seed)
    alive = {s: [c for c in ids(n) if c not in drop_at or STAGES.index(drop_at[c]) > STAGES.index(s)] for s in STAGES}
    t = threshold(n, fraction)
    try:
        result, _ = run_in_memory(params, encoded, drop_at, seed=seed)
    except SecAggAborted:
        if graph == "full" or degree >= n - 1:
            # the complete graph aborts exactly when some stage has fewer than t clients
            assert min(len(alive[s]) for s in STAGES) < t
        else:
            assert drop_at, "no dropout must never abort"
        return
    if graph == "full" or degree >= n - 1:
        assert min(len(alive[s]) for s in STAGES) >= t
        assert set(result.included) == set(alive["unmask"]) | {c for c, s in drop_at.items() if s == "unmask"}
    assert set(result.included) <= set(alive["masked"])
    assert set(result.dropped).isdisjoint(result.included)
    exact = sum(encoded[c].astype(np.uint64) for c in result.included) % 2**32
    assert np.array_equal(result.total, exact.astype(np.uint32))
    plain = sum(xs[c] for c in result.included)
    assert np.abs(fp.decode_sum(result.total, len(result.included)) - plain).max() <= fp.error_bound(n)


def test_no_dropout_never_aborts_and_secagg_plus_masks_with_few_neighbours():
    n, size = 60, 100
    rng = np.random.default_rng(0)
    encoded = {c: rng.integers(0, 2**16, size, dtype=np.uint32) for c in ids(n)}
    params = SecAggParams(b"r", size, "secagg+", degree=8)
    result, cost = run_in_memory(params, encoded, seed=1)
    assert sorted(result.included) == ids(n)
    assert np.array_equal(result.total, (sum(v.astype(np.uint64) for v in encoded.values()) % 2**32).astype(np.uint32))
    full_result, full_cost = run_in_memory(SecAggParams(b"r", size, "full"), encoded, seed=1)
    assert np.array_equal(full_result.total, result.total)
    # each client's share traffic is O(degree), not O(n)
    assert max(cost.sent.values()) < max(full_cost.sent.values()) / 3


def test_below_threshold_aborts_with_a_clear_error_and_returns_nothing():
    n = 10
    encoded = {c: np.ones(5, np.uint32) for c in ids(n)}
    params = SecAggParams(b"r", 5, "full", threshold_fraction=0.5)  # t = 6
    drop_at = {c: "masked" for c in ids(n)[:5]}  # 5 survivors < 6
    with pytest.raises(SecAggAborted, match="5 clients sent masked input, the threshold is 6"):
        run_in_memory(params, encoded, drop_at, seed=0)
    drop_at = {c: "unmask" for c in ids(n)[:5]}  # inputs in, but too few answer the unmasking
    with pytest.raises(SecAggAborted, match="answered the unmasking"):
        run_in_memory(params, encoded, drop_at, seed=0)


def drive_to_unmask(n=6, size=20_000, graph="full", inputs=None, drop_masked=()):
    """Run stages 0-2 by hand, keeping what the server saw."""
    params = SecAggParams(b"view", size, graph)
    clients = {c: SecAggClient(c, params, C.Randomness(f"v{c}".encode())) for c in ids(n)}
    server = SecAggServer(params, ids(n))
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    for c, d in server.close_advertise().items():
        server.receive_shares(clients[c].share_keys(d))
    inputs = inputs or {c: np.zeros(size, np.uint32) for c in ids(n)}
    seen = {}
    for c, d in server.close_share().items():
        if c in drop_masked:
            continue
        seen[c] = clients[c].masked_input(d, inputs[c])
        server.receive_masked(seen[c])
    return params, clients, server, seen, server.close_masked()


def top_bits_chi2_pvalue(v: np.ndarray, bits: int = 8) -> float:
    counts = np.bincount((v >> (32 - bits)).astype(np.int64), minlength=2**bits)
    return stats.chisquare(counts).pvalue


def test_masked_vectors_look_uniform_and_hide_the_input_even_with_the_self_mask_known():
    size = 20_000
    structured = np.full(size, 7, np.uint32)  # a very non-uniform input
    inputs = {c: structured for c in ids(6)}
    params, clients, server, seen, requests = drive_to_unmask(inputs=inputs, drop_masked=("c05",))
    assert top_bits_chi2_pvalue(structured) < 1e-6  # the test can fail
    for y in seen.values():
        assert top_bits_chi2_pvalue(y.vector) > 1e-4
    replies = {c: clients[c].unmask(r) for c, r in requests.items()}
    for r in replies.values():
        server.receive_unmask(r)
    # The server legitimately learns b_u of each survivor; strip that self mask off c00:
    b_c00 = clients["c00"]._seed  # what the server will rebuild from shares
    stripped = seen["c00"].vector - C.prg(b_c00, size)
    assert not np.array_equal(stripped, structured)
    assert top_bits_chi2_pvalue(stripped) > 1e-4  # still hidden by the pairwise masks
    # ... which it could only remove with a survivor's mask key; no share of one is revealed.
    assert all(set(r.mask_key) == {"c05"} for r in replies.values())
    assert all("c05" not in r.self_mask for r in replies.values())
    result = server.finish()
    assert np.array_equal(result.total, (structured * 5).astype(np.uint32))
    assert result.dropped == ["c05"]


def test_a_client_refuses_to_reveal_both_shares_of_one_peer():
    params, clients, server, seen, requests = drive_to_unmask(n=5, size=10, drop_masked=("c04",))
    c0 = clients["c00"]
    survivors = requests["c00"].survivors
    with pytest.raises(SecAggRefused, match=r"both the self-mask and the mask-key share of \['c01'\]"):
        c0.unmask(UnmaskRequest("c00", survivors, ["c01", "c04"]))
    c0.unmask(requests["c00"])  # the honest request is answered
    # a second request flipping a survivor to "dropped" is refused too
    with pytest.raises(SecAggRefused, match="c02"):
        c0.unmask(UnmaskRequest("c00", ["c00", "c01"], ["c02"]))


def test_tampered_share_is_refused_and_protocol_errors_leave_state_unchanged():
    params, clients, server, seen, requests = drive_to_unmask(n=4, size=10)
    c1 = clients["c01"]
    blob = bytearray(c1._received["c02"])
    blob[20] ^= 1
    c1._received["c02"] = bytes(blob)
    with pytest.raises(SecAggRefused, match="from c02 does not decrypt"):
        c1.unmask(requests["c01"])
    with pytest.raises(SecAggProtocolError, match="stage 'unmask', not 'masked'"):
        server.close_masked()
    reply = clients["c00"].unmask(requests["c00"])
    server.receive_unmask(reply)
    with pytest.raises(SecAggProtocolError, match="already sent"):
        server.receive_unmask(reply)
    for c in ("c02", "c03"):
        server.receive_unmask(clients[c].unmask(requests[c]))
    assert np.array_equal(server.finish().total, np.zeros(10, np.uint32))


def test_server_rejects_a_malformed_masked_input():
    params = SecAggParams(b"r", 8)
    server = SecAggServer(params, ids(3))
    clients = {c: SecAggClient(c, params, C.Randomness(c.encode())) for c in ids(3)}  # distinct keys
    for c in clients.values():
        server.receive_keys(c.advertise_keys())
    for c, d in server.close_advertise().items():
        server.receive_shares(clients[c].share_keys(d))
    deliveries = server.close_share()
    good = clients["c00"].masked_input(deliveries["c00"], np.zeros(8, np.uint32))
    from shoal.aggregation.secagg import MaskedInput

    with pytest.raises(SecAggProtocolError, match="uint32 of shape"):
        server.receive_masked(MaskedInput("c00", good.vector.astype(np.int64)))
    with pytest.raises(SecAggProtocolError, match="may not send"):
        server.receive_masked(MaskedInput("stranger", good.vector))
    server.receive_masked(good)
    assert server.u3 == ["c00"]
