"""Primitives of secure aggregation: Shamir, PRG, key agreement, AEAD, encoding, graph."""

import itertools

import numpy as np
import pytest

from shoal.aggregation.secagg import crypto as C
from shoal.aggregation.secagg.encoding import FixedPoint, SecAggConfigError, decode_weighted, encode_weighted
from shoal.aggregation.secagg.graph import auto_degree, neighbours, threshold


def test_shamir_any_t_shares_rebuild_the_secrets_and_fewer_do_not():
    rand = C.Randomness(7)
    secrets = [C.generate_private(rand), rand.bytes(32)]
    xs = np.arange(1, 8)
    shares = C.shamir_share(C.secret_to_field(secrets), xs, 4, rand)
    assert shares.shape == (7, 2 * C.CHUNKS) and shares.max() < C.PRIME
    for subset in itertools.combinations(range(7), 4):
        rebuilt = C.shamir_reconstruct([int(xs[i]) for i in subset], shares[list(subset)])
        assert C.field_to_secrets(rebuilt) == secrets
    three = C.shamir_reconstruct([1, 2, 3], shares[:3])
    assert not np.array_equal(three, C.secret_to_field(secrets))


def test_shamir_rejects_bad_threshold_and_points():
    with pytest.raises(ValueError, match="threshold"):
        C.shamir_share(np.zeros(4, np.int64), np.arange(1, 4), 5, C.Randomness(0))
    with pytest.raises(ValueError, match="distinct"):
        C.shamir_share(np.zeros(4, np.int64), np.array([1, 1, 2]), 2, C.Randomness(0))


def test_prg_uses_the_whole_key_and_is_deterministic():
    key = bytes(range(32))
    a = C.prg(key, 1000)
    assert a.dtype == np.uint32 and np.array_equal(a, C.prg(key, 1000))
    assert np.array_equal(a[:10], C.prg(key, 10))  # a prefix: one keystream
    flipped = bytearray(key)
    flipped[31] ^= 1  # the last byte matters: no folding of the key into a 32-bit seed
    assert np.mean(a == C.prg(bytes(flipped), 1000)) < 0.01


def test_key_agreement_is_symmetric_and_bound_to_session_and_use():
    rand = C.Randomness(1)
    a_raw, b_raw = C.generate_private(rand), C.generate_private(rand)
    a, b = C.private_key(a_raw), C.private_key(b_raw)
    k_ab = C.agree(a, C.public_key(b_raw), b"use", b"session")
    assert k_ab == C.agree(b, C.public_key(a_raw), b"use", b"session")
    assert k_ab != C.agree(a, C.public_key(b_raw), b"use", b"other session")
    assert k_ab != C.agree(a, C.public_key(b_raw), b"other use", b"session")


def test_aead_detects_tampering_and_wrong_context():
    rand = C.Randomness(2)
    key = rand.bytes(32)
    blob = C.encrypt(key, b"shares", b"ctx", rand)
    assert C.decrypt(key, blob, b"ctx") == b"shares"
    assert C.decrypt(key, blob, b"other ctx") is None
    bad = bytearray(blob)
    bad[-1] ^= 1
    assert C.decrypt(key, bytes(bad), b"ctx") is None


def test_fixed_point_headroom_is_checked():
    FixedPoint(1.0, 16, 65537)
    with pytest.raises(SecAggConfigError, match="bits = 24 with 500 clients needs a 33-bit modulus"):
        FixedPoint(1.0, 24, 500)


def test_stochastic_rounding_is_unbiased_and_within_one_quantum():
    fp = FixedPoint(1.0, 4, 10)  # coarse: quantum 2/15
    x = np.full(200_000, 0.05)
    rng = np.random.default_rng(0)
    enc = fp.encode(x, rng)
    decoded = fp.decode_sum(enc, 1)
    assert np.abs(decoded - x).max() < fp.quantum
    assert abs(decoded.mean() - 0.05) < 0.002  # round-to-nearest would give 0.0667


def test_weighted_encoding_round_trip():
    values, weights = FixedPoint(2.0, 20, 3), FixedPoint(1.0, 20, 3)
    rng = np.random.default_rng(1)
    xs = [rng.uniform(-2, 2, 50) for _ in range(3)]
    ws = [0.25, 1.0, 0.5]
    total = sum(encode_weighted(x, w, values, weights, rng).astype(np.uint64) for x, w in zip(xs, ws))
    s, wsum = decode_weighted((total % 2**32).astype(np.uint32), 3, values, weights)
    assert abs(wsum - 1.75) <= weights.error_bound(3)
    assert np.abs(s - sum(w * x for w, x in zip(ws, xs))).max() <= values.error_bound(3)


@pytest.mark.parametrize("n,k", [(10, 4), (11, 3), (12, 3), (50, 8), (500, auto_degree(500))])
def test_secagg_plus_graph_is_symmetric_and_regular(n, k):
    ids = [f"c{i:03d}" for i in range(n)]
    g = neighbours(ids, "secagg+", k, seed=3)
    assert all(u in g[v] for u in g for v in g[u])
    assert all(u not in g[u] for u in g)
    degrees = {len(v) for v in g.values()}
    assert degrees == {k + (k % 2 and n % 2)}
    assert g != neighbours(ids, "secagg+", k, seed=4) or n <= k + 1


def test_degree_grows_like_log_n_and_threshold_is_a_majority():
    assert auto_degree(100) < auto_degree(500) < auto_degree(10_000) < 50
    assert threshold(27, 0.5) == 14 and threshold(10, 0.0) == 1 and threshold(3, 0.99) == 3
