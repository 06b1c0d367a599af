"""bench/gpu_suite.sh on a machine without CUDA: one line saying so, exit 0 (it runs whole on a GPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the suite measures for minutes")
def test_gpu_suite_says_no_cuda_and_exits_0():
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_suite.sh")],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    line = f"gpu_suite: no CUDA device visible to {sys.executable} (torch.cuda.is_available() is False)"
    assert done.stdout.strip().splitlines() == [line + ": nothing to measure"]


def test_gpu_suite_refuses_an_unknown_option():
    suite = str(REPO / "bench" / "gpu_suite.sh")
    done = subprocess.run(["bash", suite, "--fast"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "usage: bash bench/gpu_suite.sh" in done.stdout
