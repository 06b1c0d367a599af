"""`shoal report DIR...`: two runs (a sync and an async simulation) in one PNG and one HTML file."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from shoal.config import load_config
from shoal.metrics import read_jsonl
from shoal.report import load_run, panels
from shoal.simulations.experiment import run_simulation
from tests.spawn import run_python

SMALL = [
    "simulation.num_clients=8",
    "simulation.clients_per_round=4",
    "simulation.rounds=3",
    "simulation.progress=false",
    "output.plots=false",
]


def _shoal(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return run_python(list(args), env=env, timeout=120)


@pytest.mark.slow
def test_report_draws_runs_together_and_escapes_their_names(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sync_dir, async_dir = tmp_path / "fedavg", tmp_path / "<b>async</b>"
        run_simulation(load_config(None, SMALL), sync_dir)
        run_simulation(load_config(None, [*SMALL, 'simulation.mode="async"', "asynchronous.buffer_size=2"]), async_dir)
    finally:
        torch.set_num_threads(threads)

    runs = [load_run(sync_dir), load_run(async_dir)]
    assert [r.x for r in runs] == ["version", "version"]
    ps = panels(runs)
    assert [p.title for p in ps] == ["test accuracy", "test loss", "bytes moved (total)"]  # no DP: no epsilon
    records = read_jsonl(sync_dir / "metrics.jsonl")
    assert ps[0].curves["fedavg"] == [(r["version"], r["test_accuracy"]) for r in records]
    assert ps[2].curves["fedavg"][-1][1] == records[-1]["bytes_up_total"] + records[-1]["bytes_down_total"]

    done = _shoal("report", str(sync_dir), str(async_dir), "--out", str(tmp_path / "out" / "cmp"))
    assert done.returncode == 0, done.stderr
    png, page = tmp_path / "out" / "cmp.png", tmp_path / "out" / "cmp.html"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert "data:image/png;base64," in text and "&lt;b&gt;async&lt;/b&gt;" in text and "<b>async" not in text
    assert f"{records[-1]['test_accuracy']:.4g}" in text

    missing = _shoal("report", str(tmp_path / "nothing-here"))
    assert missing.returncode == 2 and "no metrics.jsonl" in missing.stderr
