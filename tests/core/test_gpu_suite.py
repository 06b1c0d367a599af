"""bench/gpu_suite.sh on a machine without CUDA: one line saying so, exit 0 (it runs whole on a GPU);
its summary (bench/gpu_summary.py) on logs as the suite leaves them."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.config import TrainConfig

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


def load_bench(name: str):
    """A bench/ script as a module (bench/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_summary_sets_each_figure_beside_the_previous_one_with_the_share_of_the_cards_peak(tmp_path, capsys):
    """Logs as the suite leaves them: a section that finished, one cut by its time limit in the middle of
    a RESULT line, one that failed; the card found is in the peak table, then one that is not."""
    summary, throughput = load_bench("gpu_summary"), load_bench("sim_throughput")
    cfg = TrainConfig(batch_size=10, precision="fp32")
    # the CNN at K = 1000 in half the previous 5.82 s, at 10% of the H200's 67 TFLOP/s fp32 peak
    # (timed beside its CUDA graph replays, the same round took 4.365 s eagerly)
    throughput.print_result("cnn", 1000, 600, cfg, torch.device("cpu"), 2.91, 38.8, 0.1 * 67e12 * 2.91, True, 4.365)
    throughput.print_result("cnn", 100, 600, cfg, torch.device("cpu"), 0.3, 10.0, 1e12, True)  # not the largest K
    throughput.print_result("cnn", 1000, 600, cfg, torch.device("cpu"), 1.5, 75.0, 1e12, True, None, "matmul")
    (tmp_path / "batched_fp32.log").write_text("device cuda\n" + capsys.readouterr().out + "  target: ...\n")
    (tmp_path / "batched_bf16.log").write_text('RESULT {"bench": "sim_throughput", "card": "NVI')
    dp = {"bench": "dp_sgd", "card": "NVIDIA H200", "model": "cnn", "batch": 10, "plain_ms_per_step": 1.0}
    dp |= {"seeded_ms_per_step": 7.16, "csprng_ms_per_step": 87.13, "plain_flop_per_step": 0.067e9}
    dp |= {"dp_flop_per_step": None}  # the FLOP counter could not follow the DP trainer
    (tmp_path / "dp_sgd.log").write_text("RESULT " + json.dumps(dp) + "\n")
    (tmp_path / "node_cuda.log").write_text("Traceback ...\n")
    niid = {"bench": "niid_round", "split": "dirichlet", "algorithm": "fedavg", "seed": 0}
    (tmp_path / "niid_round.log").write_text(
        "".join(
            f"RESULT {json.dumps(niid | {'cuda_graphs': g, 's_per_round': t})}\n"
            for g, t in ((True, 0.5), (False, 4.0))
        )
    )
    (tmp_path / "sections.tsv").write_text(
        "batched_fp32\tok\t150\nbatched_bf16\ttimed out\t60\nniid_round\tok\t90\ndp_sgd\tok\t80\n"
        "node_cuda\tfailed (1)\t3\n"
    )

    def rows(card: str) -> dict[tuple[str, str], list[str]]:
        """(section, figure) -> the row's cells after the figure's name."""
        out, section = {}, ""
        for line in summary.summary(tmp_path, card)[1:]:  # the header first
            section = line[:13].strip() or section  # name, status and seconds fill the first 30 characters
            cells = line[30:].split()
            out[(section, "peak" if cells[0].startswith("(") else cells[0])] = cells[1:]
        return out

    h200 = rows("NVIDIA H200")
    cnn = h200[("batched_fp32", "cnn_1000_s_per_round")]
    assert cnn == ["2.91", "s", "5.82", "s", "NVIDIA", "H200,", "2026-11-28", "0.50", "lower"]
    assert h200[("batched_fp32", "cnn_1000_x_one_by_one")][-2:] == ["2.00", "higher"]
    assert h200[("batched_fp32", "cnn_1000_of_peak")][:2] == ["10.00%", "11.00%"]
    assert h200[("batched_fp32", "cnn_1000_x_eager")][:2] == ["1.5", "x"]  # no previous figure
    assert ("batched_fp32", "cnn_100_s_per_round") not in h200  # the largest K only
    assert h200[("batched_fp32", "cnn_matmul_1000_s_per_round")][:2] == ["1.5", "s"]  # apart from grouped
    assert "67" in h200[("batched_fp32", "peak")] and "fp32" in h200[("batched_fp32", "peak")]
    # the section cut short: the previous figures with nothing new beside them
    assert h200[("batched_bf16", "cnn_1000_s_per_round")][:3] == ["-", "4.01", "s"]
    assert h200[("dp_sgd", "cnn_plain_of_peak")][0] == "0.10%"  # 0.067 GFLOP in 1 ms of 67 TFLOP/s
    assert h200[("dp_sgd", "cnn_seeded_of_peak")][0] == "n/a"
    assert h200[("dp_sgd", "cnn_csprng_ms_per_step")][-2:] == ["1.00", "lower"]
    assert h200[("node_cuda", "cpu_over_cuda")][:3] == ["-", "3.24", "x"]
    assert h200[("niid_round", "fedavg_dirichlet_s_per_round")][:2] == ["0.5", "s"]
    assert h200[("niid_round", "fedavg_dirichlet_x_eager")][:2] == ["8", "x"]

    unknown = rows("Some Future GPU 9000")
    assert unknown[("batched_fp32", "cnn_1000_of_peak")][0] == "n/a"
    assert unknown[("batched_fp32", "cnn_1000_s_per_round")][-2:] == ["0.50", "lower"]
    assert "unknown" in unknown[("batched_fp32", "peak")]
    assert "unknown" in unknown[("dp_sgd", "peak")]
