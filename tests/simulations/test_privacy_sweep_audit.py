"""`shoal privacy-sweep` reports the canary audit's empirical epsilon beside the accounted epsilon and the
membership-inference AUC: in its rows, CSV, table and plot (issue 14, item 4)."""

import csv
import math

import pytest
import torch

from shoal.config import load_config
from shoal.simulations.privacy_sweep import run_privacy_sweep

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

SMALL = [
    "simulation.num_clients=6",
    "simulation.clients_per_round=3",
    "simulation.rounds=2",
    "train.epochs=1",
    "train.batch_size=10",
    "train.lr=0.05",
    "privacy.mia_samples=100",
    "privacy.canaries_unseen=300",
    "simulation.progress=false",
    "privacy.sweep_noise_multipliers=[1.0]",
    "privacy.reproducible=true",  # the audit's figures are compared on fixed draws
]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_sweep_rows_csv_table_and_plot_carry_the_empirical_epsilon(tmp_path):
    cfg = load_config(
        None,
        [*SMALL, 'model.name="2nn"', "privacy.canaries=200", 'privacy.sweep_modes=["central", "distributed", "local"]'],
    )
    rows = run_privacy_sweep(cfg, tmp_path)
    assert [r["mode"] for r in rows] == ["none", "central", "distributed", "local"]
    for r in rows:
        assert r["canaries"] == 200 and math.isfinite(r["canary_epsilon"])
        assert r["canary_epsilon_low"] <= r["canary_epsilon"] <= r["canary_epsilon_high"]
        assert 0 <= r["mia_auc"] <= 1
    base = rows[0]
    assert math.isinf(base["epsilon"]) and base["canary_epsilon"] > max(r["canary_epsilon"] for r in rows[1:])
    assert {r["sampling"] for r in rows[1:3]} == {"poisson"}
    saved = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert float(saved[1]["canary_epsilon"]) == pytest.approx(rows[1]["canary_epsilon"])
    assert float(saved[1]["canary_accounted_epsilon"]) == pytest.approx(rows[1]["epsilon"])
    table = (tmp_path / "results.md").read_text()
    assert "empirical epsilon (canaries, 95% interval)" in table and "attack AUC" in table
    assert f"{rows[1]['canary_epsilon']:.3g} [" in table
    assert (tmp_path / "accuracy_vs_epsilon.png").stat().st_size > 1000
    assert (tmp_path / "central_z1" / "canary_audit" / "summary.json").is_file()


def test_a_model_too_small_for_the_canaries_skips_the_audit_and_says_why(tmp_path, caplog):
    cfg = load_config(None, [*SMALL, 'model.name="logreg"', "privacy.canaries=100", 'privacy.sweep_modes=["central"]'])
    rows = run_privacy_sweep(cfg, tmp_path)
    assert all(r["canaries"] == 0 and math.isnan(r["canary_epsilon"]) for r in rows)
    assert "at most 30" in caplog.text  # 610 parameters / 20 per canary
    assert "| - |" in (tmp_path / "results.md").read_text()
