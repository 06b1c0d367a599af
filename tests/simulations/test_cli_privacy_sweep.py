"""`shoal privacy-sweep` end to end in a real subprocess on a small synthetic task."""

import csv
import math
import os
import subprocess
import sys

import pytest

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
    proc = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "privacy-sweep", "--config", str(cfg), "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
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
