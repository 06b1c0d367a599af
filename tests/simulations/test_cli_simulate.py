"""The `shoal simulate` job as a user runs it: a real subprocess, real files."""

import json
import sys

import pytest

from tests.conftest import REPO
from tests.spawn import run_python

SHOAL = [sys.executable, "-m", "shoal.cli"]


def run(args, **kw):
    return run_python(args, cwd=kw.pop("cwd", REPO), timeout=300, **kw)


def test_help_lists_the_jobs():
    r = run(["--help"])
    assert r.returncode == 0
    assert "simulate" in r.stdout


def test_default_simulation_writes_metrics_summary_and_plots(tmp_path):
    r = run(["simulate", "--out", str(tmp_path), "--set", "simulation.rounds=5"])
    assert r.returncode == 0, r.stderr
    assert "final test accuracy" in r.stdout
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3, 4, 5]
    for rec in lines:
        assert {"round", "test_accuracy", "test_loss", "elapsed_s"} <= set(rec)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rounds"] == 5
    assert summary["final_test_accuracy"] == lines[-1]["test_accuracy"]
    assert summary["config"]["data"]["dataset"] == "synthetic"
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    assert (tmp_path / "loss.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--set", "train.lrr=0.1"], "unknown key 'train.lrr'"),
        (
            ["--set", "data.dataset=mnist", "--set", "data.partition=iid", "--set", "data.dir=/nonexistent/mnist"],
            "/nonexistent/mnist",
        ),
        (["--set", "model.name=cnn"], "needs 28x28 images"),
        (["--config", "/nonexistent.toml"], "not found"),
    ],
    ids=["bad-key", "missing-dataset-dir", "model-dataset-mismatch", "missing-config"],
)
def test_user_errors_exit_nonzero_with_one_line(tmp_path, args, needle):
    r = run(["simulate", "--out", str(tmp_path), "-q"] + args)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert needle in err[0]
