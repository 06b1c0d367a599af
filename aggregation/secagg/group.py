"""A securely computed weighted mean over a group, in memory: the simulator's rounds
and gossip groups both call :func:`secure_weighted_mean`.

For gossip (no server) one member of the group plays the server's role of
:class:`SecAggServer` besides its own client role; it sees only masked vectors and
shares, so like every member it learns only the group's weighted mean
(:func:`secure_group_average`). Peers that talk over a network drive the same
:class:`SecAggClient` / :class:`SecAggServer` objects message by message.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .encoding import FixedPoint, encode_weighted, weighted_mean
from .memory import SecAggCost, run_in_memory
from .protocol import SecAggParams


@dataclass
class SecureMean:
    mean: np.ndarray  # float64: sum_k w_k clip(x_k) / sum_k w_k over the included
    included: list[str]  # whose inputs are in it (the others dropped out)
    total_weight: float  # sum_k w_k of the included, in units of max weight
    cost: SecAggCost


def secure_weighted_mean(
    inputs: dict[str, np.ndarray],
    weights: dict[str, float],
    params: SecAggParams,
    values: FixedPoint,
    weight_code: FixedPoint,
    drop_at: dict[str, str] | None = None,
    seed: int | None = None,
) -> SecureMean:
    """Encode ``[w_k clip(x_k), w_k]`` (weights in [0, 1]), securely sum, decode, divide.

    ``params.vector_size`` must be the input length + 1 (the weight entry). Raises
    SecAggAborted when too few members survive or the summed weight is not positive.
    """
    noise = np.random.default_rng(seed)  # stochastic rounding
    encoded = {k: encode_weighted(x, weights[k], values, weight_code, noise) for k, x in inputs.items()}
    result, cost = run_in_memory(params, encoded, drop_at, seed=seed)
    mean, wsum = weighted_mean(result.total, len(result.included), values, weight_code)
    return SecureMean(mean, result.included, wsum, cost)


def secure_group_average(
    vectors: dict[str, np.ndarray],
    weights: dict[str, float] | None = None,
    *,
    session: bytes,
    clip: float = 1.0,
    bits: int = 16,
    threshold: float = 0.5,
    drop_at: dict[str, str] | None = None,
    seed: int | None = None,
) -> SecureMean:
    """The weighted average of a gossip group's vectors (e.g. model parameters or
    deltas), no member seeing another's vector: the complete-graph protocol among the
    members, one of them relaying as the server. ``weights`` default to equal;
    ``session`` must be fresh for every exchange (it salts all keys)."""
    if len(vectors) < 2:
        raise ValueError("a secure group average needs at least 2 members")
    sizes = {np.shape(v) for v in vectors.values()}
    if len(sizes) != 1 or len(next(iter(sizes))) != 1:
        raise ValueError(f"members' vectors must be flat and of one length, got shapes {sorted(sizes)}")
    weights = weights or {k: 1.0 for k in vectors}
    top = max(weights.values())
    if not top > 0 or min(weights.values()) < 0:
        raise ValueError("weights must be >= 0 with at least one > 0")
    n = len(vectors)
    params = SecAggParams(session, next(iter(sizes))[0] + 1, "full", threshold_fraction=threshold)
    return secure_weighted_mean(
        vectors,
        {k: w / top for k, w in weights.items()},
        params,
        FixedPoint(clip, bits, n),
        FixedPoint(1.0, bits, n),
        drop_at,
        seed,
    )
