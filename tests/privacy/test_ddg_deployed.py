"""The distributed discrete Gaussian in a deployment: `shoal server` + 5 `shoal client` processes
on 127.0.0.1. Each node derives the mechanism from its own config, encodes its update with integer
noise and masks it; the server unmasks and decodes the sum and accounts with the paper's bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.accounting_rounds import DdgRoundAccountant
from shoal.aggregation.discrete_gaussian import plan
from shoal.config import load_config
from shoal.server.privacy import secure_noise_shares
from shoal.simulations.inprocess import InProcessSimulation

from ..server.test_deploy import _wait, deployment

N = 5


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_nodes_encode_the_discrete_gaussian_and_the_server_decodes_and_accounts_it(tmp_path):
    with deployment(tmp_path, n=N, rounds=2, deadline=8.0) as d:
        with d.config.open("a") as f:
            f.write(
                '\n[privacy]\nmode = "distributed"\nmechanism = "discrete_gaussian"\nnoise_multiplier = 1.0\n'
                # q = 1: no node's presence decides an abort without dropouts; the operator declares none
                "clip_norm = 1.0\nabort_bound = 0.0\n\n[secure_aggregation]\nenabled = true\nstage_s = 4.0\n"
            )
        server = d.server("--insecure", "--set", f"server.clients_per_round={N}")
        clients = [d.client(i) for i in range(N)]
        assert _wait(server, d, 120) == 0, d.dump()
        for c in clients:
            assert _wait(c, d, 30) == 0, d.dump()
        cfg = load_config(d.config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in records] == [1, 2]  # counts are withheld from the records (privacy.release)
    t = secure_noise_shares(cfg, N)
    p = plan(InProcessSimulation.from_config(cfg).spec.numel, 1.0, 1.0, t, N, cfg.privacy.bits)
    acc = DdgRoundAccountant(1.0, {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}, cfg.privacy.delta)
    assert [r["epsilon"] for r in records] == [pytest.approx(acc.epsilon_after(k)) for k in (1, 2)]
    server_log = Path(tmp_path / "server.log").read_text()
    assert "distributed discrete Gaussian" in server_log and server_log.count(f"secure sum of {N} nodes unmasked") == 2
    for i in range(N):
        log = (tmp_path / f"client-{i:05d}.log").read_text()
        assert log.count(f"discrete-Gaussian encoding, integer noise of variance {p.variance}") == 2, log
        assert "noise share N(0" not in log  # no continuous share on top
