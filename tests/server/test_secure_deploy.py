"""End to end: `shoal server` + 6 `shoal client` processes with secure aggregation;
one node SIGKILLs itself right after its masked input is accepted."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest

from shoal.aggregation.secagg.encoding import FixedPoint
from shoal.server.checkpoint import latest_checkpoint, load_checkpoint
from shoal.shards import load_shard
from shoal.simulations.inprocess import InProcessSimulation

from .test_deploy import _wait, deployment

N = 6
SECURE = """
[secure_aggregation]
enabled = true
stage_s = 4.0
"""

# `shoal client` that SIGKILLs itself right after its masked input is accepted (test-side fault injection)
KILL_AFTER_MASKED = Path(__file__).with_name("kill_after_masked.py")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_secure_round_survives_a_node_killed_after_its_masked_input(tmp_path, monkeypatch):
    """The round completes without the killed node's unmasking shares; as Bonawitz et al.
    specify, a node lost after its masked input is still in the sum (its self mask is
    rebuilt from the others' shares). The new model is the plain weighted FedAvg mean
    of the nodes' updates (computed by the simulator with the same seeds) within the
    fixed-point bound, and differs from the mean without the killed node."""
    with deployment(tmp_path, n=N, rounds=1) as d:
        plain_cfg = d.cfg
        with d.config.open("a") as f:
            f.write(SECURE)
        server = d.server("--insecure")
        clients = [d.client(i) for i in range(N - 1)]
        victim = d.client(N - 1, entry=KILL_AFTER_MASKED)
        assert _wait(victim, d, 90) == -signal.SIGKILL, d.dump()
        assert _wait(server, d, 90) == 0, d.dump()
        for c in clients:
            assert _wait(c, d, 30) == 0, d.dump()
        server_log = (tmp_path / "server.log").read_text()
        assert "stage 'unmask' closed without 1 nodes (dropouts: client-00005)" in server_log, server_log
        assert "secure sum of 6 nodes unmasked" in server_log, server_log
    tensors, state = load_checkpoint(latest_checkpoint(tmp_path / "ck"))
    assert state["version"] == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_results"] for r in records] == [N]

    # the same round in the plain simulator: every node selected, the same seeds
    sim = InProcessSimulation.from_config(plain_cfg)
    start = sim.global_params.clone()
    sim.run_round()
    expected = (sim.global_params - start).double().numpy()
    got = (tensors["params"] - start).double().numpy()
    examples = np.array([load_shard(p).x.shape[0] for p in d.shards], dtype=np.float64)
    w = examples / examples.max()
    quantum = FixedPoint(1.0, 16, N).quantum
    bound = N * quantum / w.sum() * (1 + np.abs(expected).max())  # sum and weight each off by < N quanta
    err = np.abs(got - expected).max()
    assert err <= bound, (err, bound)

    # without the killed node the mean is another one: it really is in the sum
    five = InProcessSimulation.from_config(plain_cfg)
    trained = dict(
        (t.client_id, u.delta.double().numpy())
        for t, u in five.train_clients(five.rounds.start_round(five.client_ids), five.global_params)
    )  # batched: not in task order
    deltas = [trained[p.stem] for p in d.shards]
    assert np.allclose(sum(wk * x for wk, x in zip(w, deltas)) / w.sum(), expected, atol=1e-6)
    without = sum(wk * x for wk, x in zip(w[:-1], deltas[:-1])) / w[:-1].sum()
    assert np.abs(got - without).max() > 10 * bound
