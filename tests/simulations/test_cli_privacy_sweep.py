"""`shoal privacy-sweep` end to end in a real subprocess on a small synthetic task."""

import csv
import math
import os

import pytest

from tests.spawn import run_python

CONFIG = """
[simulation]
rounds = 2
num_clients = 6
clients_per_round = 3
progress = false
[train]
epochs = 1
batch_size = 10
lr = 0.05
[model]
name = "logreg"
[privacy]
sweep_modes = ["central", "local"]
sweep_noise_multipliers = [0.5, 4.0]
mia_samples = 200
"""


@pytest.mark.slow
def test_privacy_sweep_writes_table_csv_and_plot(tmp_path):
    cfg = tmp_path / "sweep.toml"
    cfg.write_text(CONFIG)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_python(["privacy-sweep", "--config", str(cfg), "--out", str(out), "-q"], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["mode"], float(r["noise_multiplier"])) for r in rows] == [
        ("none", 0.0),
        ("central", 0.5),
        ("central", 4.0),
        ("local", 0.5),
        ("local", 4.0),
    ]
    assert math.isinf(float(rows[0]["epsilon"]))
    for mode in ("central", "local"):
        lo, hi = (float(r["epsilon"]) for r in rows if r["mode"] == mode)
        assert 0 < hi < lo  # more noise, smaller epsilon
    for r in rows:
        assert 0 <= float(r["mia_auc"]) <= 1 and 0 <= float(r["test_accuracy"]) <= 1
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 1000
    assert "| central | 4 |" in (out / "results.md").read_text()
    assert "| mode |" in proc.stdout
    assert (out / "local_z4" / "metrics.jsonl").is_file()


def test_sweep_of_a_regression_task_reports_r2_and_goes_on_past_a_failed_setting(tmp_path):
    """The CSV regression example has no accuracy: the sweep reports its R²; a noise level whose
    run ends with no accepted update is recorded as failed, and the next setting still runs."""
    from pathlib import Path

    from shoal.config import load_config
    from shoal.simulations.privacy_sweep import run_privacy_sweep

    example = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "regression_csv.py"
    cfg = load_config(
        None,
        [
            f"task.app='{example}:task'",
            "task.args.rows=60",
            "simulation.rounds=2",
            "simulation.num_clients=6",
            "simulation.clients_per_round=3",
            "simulation.progress=false",
            'privacy.sweep_modes=["local"]',
            "privacy.sweep_noise_multipliers=[1e30, 1.0]",  # 1e30: every update non-finite, the round fails
            "privacy.canaries=0",
            "privacy.mia_samples=100",
        ],
    )
    rows = run_privacy_sweep(cfg, tmp_path)
    assert [(r["mode"], r["status"][:6]) for r in rows] == [("none", "ok"), ("local", "failed"), ("local", "ok")]
    assert "no results" in rows[1]["status"]
    assert rows[0]["metric"] == "test_r2" and rows[2]["metric"] == "test_r2"
    assert math.isfinite(rows[0]["utility"]) and math.isnan(rows[1]["utility"])
    table = (tmp_path / "results.md").read_text()
    assert "| test_r2 |" in table and "failed: round 1 closed with no results" in table
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 0
    with (tmp_path / "results.csv").open() as f:
        assert [r["status"][:6] for r in csv.DictReader(f)] == ["ok", "failed", "ok"]
