"""Secure averaging within a gossip group: each member learns only the group mean."""

import numpy as np
import pytest

from shoal.aggregation.secagg import SecAggAborted
from shoal.aggregation.secagg.group import secure_group_average


def vectors(n, size=300, seed=0):
    rng = np.random.default_rng(seed)
    return {f"peer-{i}": rng.uniform(-0.5, 0.5, size) for i in range(n)}


def test_group_average_equals_the_plain_weighted_mean():
    vs = vectors(5)
    ws = {k: float(i + 1) for i, k in enumerate(vs)}
    out = secure_group_average(vs, ws, session=b"gossip-1", bits=20, seed=1)
    plain = sum(ws[k] * v for k, v in vs.items()) / sum(ws.values())
    assert sorted(out.included) == sorted(vs)
    assert np.abs(out.mean - plain).max() < 1e-4
    assert np.abs(out.mean - plain).max() > 0  # it went through fixed point
    unweighted = secure_group_average(vs, session=b"gossip-2", bits=20, seed=1)
    assert np.abs(unweighted.mean - np.mean(list(vs.values()), axis=0)).max() < 1e-4


def test_a_peer_lost_before_masking_is_left_out_and_too_few_abort():
    vs = vectors(5)
    out = secure_group_average(vs, session=b"g", bits=20, drop_at={"peer-2": "masked"}, seed=2)
    rest = [v for k, v in vs.items() if k != "peer-2"]
    assert "peer-2" not in out.included
    assert np.abs(out.mean - np.mean(rest, axis=0)).max() < 1e-4
    with pytest.raises(SecAggAborted, match="threshold"):
        secure_group_average(vs, session=b"g", drop_at={k: "share" for k in list(vs)[:3]}, seed=2)


def test_group_inputs_are_checked():
    with pytest.raises(ValueError, match="at least 2"):
        secure_group_average(vectors(1), session=b"g")
    with pytest.raises(ValueError, match="one length"):
        secure_group_average({"a": np.zeros(3), "b": np.zeros(4)}, session=b"g")
