"""Central DP inside a federation run: the epsilon a run reports (its status while it trains, its
metrics lines and summary once it ended) is the accountant's for the noise, the Poisson sampling
rate K / N over the federation's registered nodes and the rounds actually charged."""

from __future__ import annotations

import asyncio
import json

import pytest

from shoal.accounting import epsilon
from tests.server.federation_live import live_federation
from tests.server.test_federation import NODES, run_config

Z, C, DELTA, K = 1.1, 1.0, 1e-5, 2


@pytest.mark.timeout(90)
def test_a_central_dp_run_reports_the_accountants_epsilon(tmp_path):
    cfg = run_config(rounds=3)
    cfg["server"].update(clients_per_round=K, min_nodes=3)
    cfg["privacy"] = {"mode": "central", "noise_multiplier": Z, "clip_norm": C, "delta": DELTA}
    q = K / len(NODES)  # N: the federation's registered nodes

    async def main():
        async with live_federation(tmp_path, NODES) as f:
            for n in NODES:
                f.start_node(n)
            run = await f.submit(cfg)
            seen = None
            while seen is None:
                st = await f.status(run)
                p = st.get("service", {}).get("privacy", {})
                if p.get("rounds_charged"):
                    seen = p  # one snapshot: the charged rounds and the epsilon of them
                elif st["status"] not in ("queued", "running"):
                    raise AssertionError(st)
                await asyncio.sleep(0.02)
            assert seen["sampling"] == "poisson" and seen["sampling_rate"] == pytest.approx(q)
            assert seen["epsilon"] == pytest.approx(epsilon(q, Z, seen["rounds_charged"], DELTA))
            return await f.wait_ended(run, 60), run

    st, run = asyncio.run(main())
    assert st["status"] == "finished", st
    lines = [json.loads(x) for x in (tmp_path / "fed" / run / "metrics.jsonl").read_text().splitlines()]
    charged = [r for r in lines if "epsilon" in r]
    versions = [r for r in charged if not {"failed", "aborted", "stopped"} & set(r)]
    assert len(versions) == 3  # every version is accounted
    assert not any("train_loss" in r or "num_results" in r for r in charged)  # privacy.release = "withhold"
    for r in charged:
        assert r["privacy_mode"] == "central" and r["sampling_rate"] == pytest.approx(q) and r["delta"] == DELTA
        assert r["epsilon"] == pytest.approx(epsilon(q, Z, r["rounds_charged"], DELTA)), r
    assert [r["rounds_charged"] for r in charged] == sorted(r["rounds_charged"] for r in charged)
    summary = json.loads((tmp_path / "fed" / run / "summary.json").read_text())
    last = summary["last_metrics"]
    assert (
        last["epsilon"] == pytest.approx(epsilon(q, Z, last["rounds_charged"], DELTA)) and last["rounds_charged"] >= 3
    )
