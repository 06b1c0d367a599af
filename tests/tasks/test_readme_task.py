"""The task file of the README, written to a folder outside the repository, runs every job.

The code block is read from README.md itself, so the README cannot drift from what works.
A user's task file on the Flower engine is tests/flower/test_flower.py's (the same model and
records as in-process), so it is not run a second time here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.spawn import run_python

from .deploy import run_peers, run_server_and_clients

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
    proc = run_python(list(args), cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_readme_task_simulates_and_learns(task_dir):
    proc = shoal(
        "simulate", "--task", "my_task.py:task", "-q", "--set", "simulation.rounds=8", "--out", "run", cwd=task_dir
    )
    assert "final test accuracy" in proc.stdout
    records = [json.loads(line) for line in (task_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["test_accuracy"] > 0.7 > records[0]["test_accuracy"] - 0.3
    assert records[-1]["test_loss"] < records[0]["test_loss"]
    assert (task_dir / "run" / "accuracy.png").is_file()


@pytest.mark.slow
def test_readme_task_privacy_sweep(task_dir):
    proc = shoal(
        "privacy-sweep",
        "--task",
        "my_task.py:task",
        "--set",
        "simulation.rounds=3",
        "--set",
        'privacy.sweep_modes=["central"]',
        "--set",
        "privacy.sweep_noise_multipliers=[1.0]",
        "--set",
        "privacy.mia_samples=200",
        "--out",
        "sweep",
        cwd=task_dir,
    )
    rows = (task_dir / "sweep" / "results.csv").read_text().splitlines()
    assert rows[0].startswith("mode,noise_multiplier,status,epsilon")
    assert [r.split(",")[:3] for r in rows[1:]] == [["none", "0.0", "ok"], ["central", "1.0", "ok"]]
    assert "attack AUC" in proc.stdout


# --- deployed: the same file, one CSV per node --------------------------------------------


def write_node_csvs(folder: Path, n: int) -> list[Path]:
    """Node CSVs as the README describes them: a header, 8 feature columns, then the label,
    drawn from the rule the task's simulation uses (seed 0), with a shift per node."""
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 3, generator=g)
    paths = []
    for i in range(n):
        x = torch.randn(150, 8, generator=g) + 0.3 * i
        y = (x @ w).argmax(1)
        lines = [",".join([f"f{j}" for j in range(8)] + ["label"])]
        lines += [",".join(f"{v:.5f}" for v in row) + f",{int(label)}" for row, label in zip(x.tolist(), y)]
        path = folder / f"node{i}.csv"
        path.write_text("\n".join(lines) + "\n")
        paths.append(path)
    return paths


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_task_server_and_three_tls_clients(task_dir):
    csvs = write_node_csvs(task_dir, 3)
    records = run_server_and_clients(task_dir, "my_task.py:task", [c.name for c in csvs], "[train]\nlr = 0.1\n")
    fed = [r for r in records if r.get("evaluation") == "federated"]
    assert [r["version"] for r in fed][-1] == 3 and all(r["fed_nodes"] == 3 for r in fed)
    assert fed[-1]["fed_accuracy"] > fed[0]["fed_accuracy"] - 0.05 and fed[-1]["fed_num_examples"] == 3 * 30
    assert not any("test_accuracy" in r for r in records)  # the task gives the server no data


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_task_three_tls_peers(task_dir):
    csvs = write_node_csvs(task_dir, 3)
    runs = run_peers(task_dir, "my_task.py:task", [c.name for c in csvs], "[train]\nlr = 0.1\n")
    for recs in runs:
        assert recs and "local_test_accuracy" in recs[-1]
        assert recs[-1]["local_test_accuracy"] >= recs[0]["local_test_accuracy"] - 0.05
    assert sum(recs[-1].get("merges", 0) for recs in runs) > 0
