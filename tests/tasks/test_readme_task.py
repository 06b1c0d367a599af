"""The task file of the README, written to a folder outside the repository, runs every job.

The code block is read from README.md itself, so the README cannot drift from what works.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def readme_task() -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(r"```python\n(# my_task\.py.*?)```", text, re.S)
    assert match, "README.md has no '# my_task.py' python block"
    return match.group(1)


@pytest.fixture
def task_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_task.py").write_text(readme_task())
    return tmp_path


def shoal(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_readme_task_simulates_and_learns(task_dir):
    proc = shoal("simulate", "--task", "my_task.py:task", "-q", "--set", "simulation.rounds=8",
                 "--out", "run", cwd=task_dir)
    assert "final test accuracy" in proc.stdout
    records = [json.loads(line) for line in (task_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["test_accuracy"] > 0.7 > records[0]["test_accuracy"] - 0.3
    assert records[-1]["test_loss"] < records[0]["test_loss"]
    assert (task_dir / "run" / "accuracy.png").is_file()


@pytest.mark.slow
def test_readme_task_privacy_sweep(task_dir):
    proc = shoal("privacy-sweep", "--task", "my_task.py:task", "--set", "simulation.rounds=3",
                 "--set", 'privacy.sweep_modes=["central"]', "--set", "privacy.sweep_noise_multipliers=[1.0]",
                 "--set", "privacy.mia_samples=200", "--out", "sweep", cwd=task_dir)
    rows = (task_dir / "sweep" / "results.csv").read_text().splitlines()
    assert rows[0].startswith("mode,noise_multiplier,epsilon")
    assert [r.split(",")[0] for r in rows[1:]] == ["none", "central"]
    assert "attack AUC" in proc.stdout
