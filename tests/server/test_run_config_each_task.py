"""A run's config travels with each of its tasks; a node checks every task against its operator's
limits and the config it joined with, and refuses the run for good with the reason in its status."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.server.federation_live import live_federation
from tests.server.test_federation import NODES, run_config


@pytest.mark.timeout(90)
def test_each_task_carries_the_run_config_and_is_checked(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="shoal.client")

    async def main():
        async with live_federation(tmp_path, NODES) as f:
            for n in NODES:
                f.start_node(n)
            cfg = run_config(rounds=10_000)
            cfg["server"]["min_nodes"] = 2
            run = await f.submit(cfg)
            while (await f.status(run)).get("version", 0) < 1:
                await asyncio.sleep(0.02)

            # n0's operator lowers its epochs limit: n0 refuses its next task of the run, for good
            f.daemons["n0"].cfg.limits.max_epochs = 0
            while (st := await f.status(run))["nodes"]["n0"]["answer"] != "refused":
                await asyncio.sleep(0.05)
            assert "train.epochs = 1 is over node n0's limit of 0" in st["nodes"]["n0"]["reason"], st
            assert "temporary" not in st["nodes"]["n0"]
            version = st["version"]
            while (await f.status(run))["version"] < version + 2:  # the run goes on with n1 and n2
                await asyncio.sleep(0.05)

            # the config the server sends with a task is not the one n1 and n2 joined: both refuse
            row = f.fed.db.get(run)
            assert row is not None
            changed = {**row.config, "train": {**row.config["train"], "lr": 0.5}}
            f.fed.db.db.execute("UPDATE runs SET config = ? WHERE id = ?", (json.dumps(changed), run))
            st = await f.status(run)
            while not all(a["answer"] == "refused" for a in st["nodes"].values()):
                await asyncio.sleep(0.05)
                st = await f.status(run)
            for n in ("n1", "n2"):
                assert f"the config of {run} changed since node {n} joined it (train.lr)" in st["nodes"][n]["reason"]
            offers = f.fed.offers("n1")
            assert all(o["run"] != run for o in offers)  # a permanent refusal: not offered again
            assert not any(d.stop.is_set() for d in f.daemons.values())  # the daemons stay up
            async with f.session() as s, s.post(f"{f.url}/v1/runs/{run}/stop") as r:
                assert r.status == 200

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("shoal.client")]
    # every line of the run's work names the run: training, uploads, refusals
    assert any(line.startswith("run-1: round 1: update accepted") for line in lines), lines[:40]
    assert any("refused by this node's policy" in line and "run-1" in line for line in lines), lines
    per_round = [line for line in lines if "round " in line or "version " in line]
    assert per_round and all("run-1" in line for line in per_round), [x for x in per_round if "run-1" not in x]
