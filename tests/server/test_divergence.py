"""A node whose training diverges (lr = 50) says so in one line, does not upload, reports the
failure to the server (POST /v1/failed) and never trains the same task again; the server counts
it, hands that node no second copy of the task, and ends the run after server.max_failed_rounds
rounds in a row without an accepted update."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
import torch

from shoal.client.node import Node, read_local_data
from shoal.config import config_from_dict
from shoal.errors import Malformed, UpdateRejected
from shoal.server.service import ServerService

from .live import live_server, small_config
from .task_files import write_node_data

LINEAR_TASK = '''
import torch
from torch import nn
from shoal.task import LocalData, Task


class Linear(Task):
    """Least squares with a linear model: lr = 50 on batches of 4 overflows within one epoch."""

    def model(self):
        return nn.Linear(4, 1)

    def loss(self, model, x, y):
        return nn.functional.mse_loss(model(x).squeeze(-1), y)

    def local_data(self, path):
        d = torch.load(path)
        return LocalData(train=(d["x"], d["y"]))
'''


def _report(round_: int, version: int = 0, reason: str = "diverged") -> bytes:
    return json.dumps({"round": round_, "version": version, "reason": reason}).encode()


def test_the_service_counts_a_failure_and_hands_the_task_out_no_more(tmp_path):
    svc = ServerService.from_config(small_config(tmp_path, clients_per_round=2, min_nodes=2, deadline_s=60.0))
    for n in ("a", "b"):
        svc.seen(n, 0.0)
    assert svc.tick(0.0) and sorted(svc.rounds.selected) == ["a", "b"]
    task = svc.poll("b", 0.1)
    assert task["status"] == "work"
    for body, error in [
        (b"not json", Malformed),
        (_report(task["round"], reason="bored"), Malformed),
        (json.dumps({"round": task["round"]}).encode(), Malformed),
        (_report(task["round"] + 5), UpdateRejected),
    ]:
        with pytest.raises(error):
            svc.report_failure("b", body, 0.2)
    assert svc.counters.rejected.get("diverged") is None  # nothing counted for refused reports
    with pytest.raises(UpdateRejected, match="holds no task"):
        svc.report_failure("c", _report(task["round"]), 0.2)
    assert svc.report_failure("b", _report(task["round"]), 0.3)["status"] == "noted"
    assert svc.counters.rejected["diverged"] == 1
    assert svc.poll("b", 0.4) is None  # no second copy of the task
    with pytest.raises(UpdateRejected):
        svc.report_failure("b", _report(task["round"]), 0.5)  # reported once
    assert svc.counters.rejected["diverged"] == 1


def _nodes(live, tmp_path, task_app: str, lrs: dict[str, float]) -> list[Node]:
    nodes = []
    for i, (name, lr) in enumerate(lrs.items()):
        cfg = config_from_dict({"task": {"app": task_app}, "train": {"batch_size": 4, "lr": lr}})
        from shoal.assembly import task_from_config

        task = task_from_config(cfg)
        data = read_local_data(task, write_node_data(tmp_path / f"{name}.pt", i))
        nodes.append(
            Node.from_config(live.url, live.tokens[name], data, cfg, torch.device("cpu"), None, 1.0, name, task)
        )
    return nodes


def test_a_diverging_node_trains_each_task_once_and_the_run_goes_on(tmp_path, caplog):
    (tmp_path / "lintask.py").write_text(LINEAR_TASK)
    app = f"{tmp_path / 'lintask.py'}:Linear"
    server = {"rounds": 2, "min_nodes": 2, "clients_per_round": 2, "deadline_s": 30.0, "poll_s": 1.0}

    async def scenario():
        async with live_server(
            tmp_path, ["good", "bad"], clock=True, sections={"task": {"app": app}}, **server
        ) as live:
            nodes = _nodes(live, tmp_path, app, {"good": 0.05, "bad": 50.0})
            with caplog.at_level(logging.INFO):
                await asyncio.wait_for(asyncio.gather(*(n.run() for n in nodes)), 40)
            return live.service, nodes

    svc, (good, bad) = asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training diverged")]
    assert len(lines) == 2 and all(
        re.fullmatch(r"training diverged in round \d+: loss (inf|nan); not uploading", x) for x in lines
    ), lines
    assert len(set(lines)) == 2  # one line per task: each task trained once
    assert svc.version == 2 and svc.counters.accepted == 2  # the good node's updates only
    assert svc.counters.rejected.get("diverged") == 2 and bad.rounds_done == 0 and good.rounds_done == 2
    assert len(bad.failed_tasks) == 2


def test_a_run_of_only_diverging_nodes_ends_after_max_failed_rounds(tmp_path, caplog):
    (tmp_path / "lintask.py").write_text(LINEAR_TASK)
    app = f"{tmp_path / 'lintask.py'}:Linear"
    server = {"rounds": 50, "min_nodes": 1, "deadline_s": 30.0, "poll_s": 1.0, "max_failed_rounds": 2}

    async def scenario():
        async with live_server(tmp_path, ["bad"], clock=True, sections={"task": {"app": app}}, **server) as live:
            (bad,) = _nodes(live, tmp_path, app, {"bad": 50.0})
            with caplog.at_level(logging.INFO):
                await asyncio.wait_for(bad.run(), 30)
            return live.service, bad

    svc, bad = asyncio.run(scenario())
    assert svc.version == 0 and svc.stop_reason is not None and "max_failed_rounds" in svc.stop_reason
    assert "diverged" in svc.stop_reason  # the reason names what was refused
    assert bad.rounds_done == 0 and len(bad.failed_tasks) <= 2  # trained at most that many times
