"""privacy.release: the per-round figures of a DP run are withheld, or noised and charged.

The attack replayed here is the one of issue 32: from a round's released figures (the example
count, the number of results, the bytes uploaded) and the clients' sizes, list the subsets of
clients that could have been the round's sample; a round with one candidate gives its sample
away, and with the sample known Poisson amplification no longer holds for that reader.
"""

import itertools
import json
import math

import pytest

from shoal.accounting import epsilon
from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.noise import NoiseSource
from shoal.privacy_plan import PrivacyPlan, combined_multiplier
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation

BASE = [
    "simulation.num_clients=8",
    "simulation.clients_per_round=3",
    "simulation.rounds=8",
    'model.name="logreg"',
    'data.partition="dirichlet"',  # unequal client sizes: the sizes tell the clients apart
    "train.epochs=1",
    "train.batch_size=10",
    "output.plots=false",
    "simulation.progress=false",
    'privacy.mode="central"',
    "privacy.delta=1e-3",
]


def candidates(record: dict, sizes: list[int]) -> int:
    """How many subsets of the clients are consistent with what the record says of the round's
    sample: the attacker's search (2^N when the record says nothing about it)."""
    n_ex, n_res = record.get("num_examples"), record.get("num_results")
    per_upload = None
    if record.get("bytes_up") and n_res:
        per_upload = record["bytes_up"] / n_res
    hits = 0
    for k in range(len(sizes) + 1):
        for subset in itertools.combinations(range(len(sizes)), k):
            if n_res is not None and k != n_res:
                continue
            if n_ex is not None and sum(sizes[i] for i in subset) != n_ex:
                continue
            if per_upload is not None and record["bytes_up"] != per_upload * k:
                continue
            hits += 1
    return hits


def run(tmp_path, *sets):
    cfg = load_config(None, [*BASE, *sets])
    sim = InProcessSimulation.from_config(cfg)
    sizes = [sim.shards.size(i) for i in range(len(sim.client_ids))]
    run_simulation(cfg, tmp_path)
    return sizes, read_jsonl(tmp_path / "metrics.jsonl"), json.loads((tmp_path / "summary.json").read_text())


def test_clear_release_gives_the_sample_away_and_says_it_is_not_covered(tmp_path):
    sizes, records, _ = run(tmp_path, 'privacy.release="clear"')
    assert len(set(sizes)) > 4  # the attack needs sizes that differ
    found = [candidates(r, sizes) for r in records]
    assert sum(c == 1 for c in found) >= len(records) // 2, found  # the attack is real
    assert all(r["release"] == "clear" for r in records)


def test_default_release_withholds_everything_the_attack_reads(tmp_path):
    sizes, records, summary = run(tmp_path)
    leaky = {"train_loss", "num_examples", "num_results", "bytes_up", "bytes_down", "rejected", "num_late"}
    for r in records:
        assert r["release"] == "withhold" and not leaky & set(r), r
        assert not any(k.startswith("fed_") for k in r)
        assert candidates(r, sizes) == 2 ** len(sizes)  # every sample is as consistent as any other
        assert "test_accuracy" in r and "epsilon" in r  # the model on held-out data and the guarantee stay
    assert "bytes_up_total" not in summary and summary["epsilon"] == records[-1]["epsilon"]


def test_noised_release_charges_its_figures_in_epsilon(tmp_path):
    z, zr = 1.0, 4.0
    sizes, records, summary = run(
        tmp_path, f"privacy.noise_multiplier={z}", 'privacy.release="noised"', f"privacy.release_noise_multiplier={zr}"
    )
    z_eff = combined_multiplier(z, zr)
    assert z_eff == pytest.approx((1 + 2 / 16) ** -0.5)
    assert summary["epsilon"] == pytest.approx(epsilon(3 / 8, z_eff, 8, 1e-3))
    assert summary["epsilon"] > epsilon(3 / 8, z, 8, 1e-3)  # the figures cost something
    for r in records:
        assert {"num_results_noisy", "train_loss_noisy"} <= set(r) and "num_results" not in r
        assert r["num_results_noisy"] != round(r["num_results_noisy"])  # noised, not a count


def test_noised_figures_carry_the_noise_they_are_charged_for():
    plan = PrivacyPlan(mode="central", noise_multiplier=1.0, release="noised", release_noise_multiplier=3.0)
    rng = NoiseSource.seeded(7)
    draws = [plan.noisy_round(5, [0.5, 1.0, 9.0, -1.0, 2.0], rng) for _ in range(4000)]
    counts = [d["num_results_noisy"] - 5 for d in draws]
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    assert abs(mean) < 0.2 and std == pytest.approx(3.0, rel=0.05)
    # the loss sum: each loss clipped to [0, 5] (9 -> 5, -1 -> 0), noise std 3 * 5
    sums = [d["train_loss_noisy"] * d["num_results_noisy"] for d in draws if d["train_loss_noisy"] is not None]
    m = sum(sums) / len(sums)
    assert m == pytest.approx(0.5 + 1.0 + 5.0 + 2.0, abs=0.8)
    assert math.sqrt(sum((s - m) ** 2 for s in sums) / len(sums)) == pytest.approx(15.0, rel=0.05)
    assert PrivacyPlan(mode="central", release="withhold").noisy_round(5, [1.0]) == {}
    # a loss summed on a worker, or never sent (distributed DP under secure aggregation): the count only,
    # whatever the losses; a non-finite loss of one client is clipped like any other (NaN to L), so
    # whether the loss is released never depends on the clients' values
    assert plan.noisy_round(5, None, rng)["train_loss_noisy"] is None
    secure = PrivacyPlan(mode="distributed", noise_multiplier=1.0, release="noised", secure=True)
    assert secure.noisy_round(5, [1.0, 2.0], rng)["train_loss_noisy"] is None
    for bad in (float("nan"), float("inf")):
        assert plan.noisy_round(50, [1.0, bad], rng)["train_loss_noisy"] is not None


def test_noised_release_is_refused_for_local_dp():
    with pytest.raises(ConfigError, match="privacy.release = 'noised' with privacy.mode = 'local'"):
        load_config(None, ['privacy.mode="local"', 'privacy.release="noised"'])


def test_clients_do_not_evaluate_under_dp_unless_the_release_is_clear(monkeypatch):
    """fed_* figures of a DP run are never written (withhold / noised): the simulator does not
    compute them either; with release = "clear" (or without DP) it does."""

    def evaluated(self, params):
        return {"fed_accuracy": 0.5}

    monkeypatch.setattr(InProcessSimulation, "federated_evaluate", evaluated)
    for sets, expected in ([[], False], [['privacy.release="clear"'], True], [['privacy.mode="none"'], True]):
        sim = InProcessSimulation.from_config(load_config(None, [*BASE, *sets]))
        sim.client_test = []  # as if the task's clients had test data
        assert ("fed_accuracy" in sim.evaluate()) is expected, sets
