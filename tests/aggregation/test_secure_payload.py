"""What SCAFFOLD and FedNova clients mask (aggregation/secagg/payload.py): the integer sum of the
encodings, decoded, gives each algorithm's server step the same result as the clear updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.aggregation.fednova import FedNovaStrategy
from shoal.aggregation.mean import WeightedMean
from shoal.aggregation.scaffold import ScaffoldStrategy
from shoal.aggregation.secagg.encoding import FixedPoint, example_weight
from shoal.aggregation.secagg.payload import SecurePayload, step_weight
from shoal.aggregation.server_opt import FedAvgOpt
from shoal.aggregation.strategy import Strategy
from shoal.update import Update

N = 40
VALUES, WEIGHTS = FixedPoint(1.0, 28, 4), FixedPoint(1.0, 28, 4)


def _clients(algorithm: str) -> list[Update]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i, n in enumerate((12, 30, 7)):
        u = Update(torch.randn(N, generator=g) * 0.05, n, 0, f"c{i}")
        if algorithm == "scaffold":
            u.to_server = {"scaffold/dc": torch.randn(N, generator=g) * 0.3}
        if algorithm == "fednova":
            u.metrics = {"fednova_a": float(5 + 7 * i)}
        out.append(u)
    return out


def _secure_updates(algorithm: str, clients: list[Update]) -> list[Update]:
    """Encode, sum mod 2^32 (what unmasking yields), decode, one update per client."""
    payload = SecurePayload(algorithm, N)
    rng = np.random.default_rng(0)
    top = max(u.num_examples for u in clients)
    total = np.zeros(payload.vector_size, dtype=np.uint32)
    for u in clients:
        total += payload.encode(u, example_weight(u.num_examples, top), VALUES, WEIGHTS, rng)
    sums = payload.decode(total, len(clients), VALUES, WEIGHTS)
    members = {u.sender: (u.num_examples, {**u.metrics, **payload.clear_meta(u)}) for u in clients}
    return payload.updates(sums, members, 0)


def _strategy(algorithm: str) -> Strategy:
    inner = Strategy(WeightedMean(N), FedAvgOpt(1.0))
    if algorithm == "scaffold":
        return ScaffoldStrategy(inner, N, num_clients=10)
    return FedNovaStrategy(WeightedMean(N), FedAvgOpt(1.0)) if algorithm == "fednova" else inner


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold", "fednova"])
def test_the_decoded_sums_give_the_server_step_of_the_clear_updates(algorithm):
    clients = _clients(algorithm)
    results = []
    for updates in (clients, _secure_updates(algorithm, clients)):
        s = _strategy(algorithm)
        s.begin(torch.zeros(N))
        for u in updates:
            s.accumulate(u)
        results.append((s.finalize(), s.broadcast().get("scaffold/c") if algorithm == "scaffold" else None))
    (clear, c_clear), (masked, c_masked) = results
    assert float((clear - masked).abs().max()) < 1e-6
    if algorithm == "scaffold":
        assert c_clear is not None and c_masked is not None
        assert float(c_clear.abs().max()) > 1e-2 and float((c_clear - c_masked).abs().max()) < 1e-6


def test_layouts_and_what_travels_in_the_clear():
    assert SecurePayload("fedavg", N).vector_size == N + 1
    assert SecurePayload("feddyn", N).vector_size == N + 1
    assert SecurePayload("scaffold", N).vector_size == 2 * N + 1  # Delta c is masked, never in the clear
    assert SecurePayload("scaffold", N).clear_meta(_clients("scaffold")[0]) == {}
    assert SecurePayload("fednova", N).clear_meta(_clients("fednova")[1]) == {"fednova_a": 12.0}


@pytest.mark.parametrize("a", [None, float("nan"), float("inf"), 0.5, -3.0, True, "7", [2.0]])
def test_a_hostile_step_weight_is_refused(a):
    with pytest.raises(ValueError, match="fednova_a >= 1"):
        step_weight(a, "n1")


def test_a_scaffold_update_without_a_finite_control_delta_is_not_encoded(caplog):
    payload, rng = SecurePayload("scaffold", N), np.random.default_rng(0)
    u = _clients("scaffold")[0]
    for bad in ({}, {"scaffold/dc": torch.zeros(N - 1)}, {"scaffold/dc": torch.full((N,), float("nan"))}):
        with pytest.raises(ValueError, match="control-variate delta"):
            payload.encode(Update(u.delta, 5, to_server=bad), 1.0, VALUES, WEIGHTS, rng)
    big = Update(u.delta, 5, to_server={"scaffold/dc": torch.full((N,), 3.0)})
    payload.encode(big, 1.0, VALUES, WEIGHTS, rng)
    assert f"{N} of {N} entries of SCAFFOLD's control-variate delta exceed secure_aggregation.clip" in caplog.text
