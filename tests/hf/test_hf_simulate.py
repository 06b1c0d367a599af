"""The federated LoRA example through `shoal simulate` and `shoal privacy-sweep`: only adapter
tensors are on the wire, the model learns, DP on the adapter runs (central) or is refused with
its reason (local). That the Ray engine gives the in-process model is tested on the Ray suite's
shared cluster (tests/ray/test_ray_engine.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from shoal.config import load_config  # noqa: E402 - after the skips
from shoal.errors import ConfigError  # noqa: E402
from shoal.metrics import read_jsonl  # noqa: E402
from shoal.simulations.experiment import run_simulation  # noqa: E402
from shoal.simulations.inprocess import InProcessSimulation  # noqa: E402
from shoal.simulations.privacy_sweep import run_privacy_sweep  # noqa: E402

from .tiny import ADAPTER_NUMEL, OVERRIDES, base_numel, needs_corpus  # noqa: E402

pytestmark = [needs_corpus, pytest.mark.slow]

BASE = [
    *OVERRIDES,
    "simulation.num_clients=3",
    "simulation.clients_per_round=3",
    "simulation.rounds=2",
    "simulation.eval_every=1",
    "simulation.device='cpu'",
    "simulation.progress=false",
    "output.plots=false",
    "train.batch_size=16",
    "train.lr=0.01",
]


def config(*extra: str):
    return load_config(None, [*BASE, *extra])


@pytest.mark.timeout(300)
def test_simulate_sends_adapters_only_and_the_model_learns(tmp_path):
    summary = run_simulation(config(), tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["round"] for r in records] == [1, 2] and all(r["num_results"] == 3 for r in records)
    per_update = records[0]["bytes_up"] / records[0]["num_results"]
    # one float32 per adapter parameter plus a JSON header under 1 KiB; the base (a hundred
    # thousand parameters) would be 14 times more
    assert 0 < per_update - 4 * ADAPTER_NUMEL < 1024, per_update
    assert 4 * base_numel() > 10 * per_update
    assert records[-1]["test_perplexity"] < records[0]["test_perplexity"]  # held-out role
    assert {"test_loss", "test_accuracy", "fed_perplexity"} <= set(records[-1])
    assert summary["final_metrics"]["test_perplexity"] == pytest.approx(records[-1]["test_perplexity"])


@pytest.mark.timeout(300)
def test_central_dp_on_the_adapter_is_swept_and_local_dp_sgd_is_refused_with_its_reason(tmp_path):
    cfg = config(
        "privacy.sweep_modes=['central']",
        "privacy.sweep_noise_multipliers=[0.5]",
        "privacy.mia_samples=8",
        "privacy.canaries=0",
        "privacy.clip_norm=0.5",
        "simulation.rounds=1",
    )
    rows = run_privacy_sweep(cfg, tmp_path / "sweep")
    assert [(r["mode"], r["status"]) for r in rows] == [("none", "ok"), ("central", "ok")], rows
    assert rows[1]["epsilon"] > 0 and rows[1]["epsilon"] != float("inf")
    assert rows[0]["metric"] == "test_accuracy" and 0 < rows[1]["utility"] < 1
    assert all(0 <= r["mia_auc"] <= 1 for r in rows)  # the membership audit scored dict examples
    # DP-SGD (Opacus) brings its own optimizer and Poisson-samples examples of tensor data: this
    # task has its own optimizer and dict Datasets, and the run is refused before any training
    with pytest.raises(ConfigError, match="privacy.mode = 'local': DP-SGD brings its own optimizer"):
        InProcessSimulation.from_config(config("privacy.mode='local'", "simulation.rounds=1"))
