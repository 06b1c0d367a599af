"""shoal inside Flower: the ArrayRecord mapping, the engine's Ray settings, and one real
Flower simulation (Ray) compared with the in-process engine on the same config and seed.

Ray's start-up costs seconds, so the suite runs exactly one Flower simulation (a module
fixture) and two tests read it. Ray is held to 2 CPUs, one per client actor.
"""

import json
import math

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError, SpecMismatch
from shoal.metrics import read_jsonl
from shoal.models import build_model
from shoal.params import ParamSpec, flatten
from shoal.simulations.experiment import run_simulation
from shoal.simulations.flower_apps import from_arrays, to_arrays
from shoal.simulations.flower_engine import backend_config
from shoal.simulations.inprocess import InProcessSimulation

SMALL = [
    "simulation.num_clients=10", "simulation.clients_per_round=5", "simulation.rounds=3",
    "simulation.device='cpu'", "simulation.progress=false", "output.plots=false",
    "simulation.ray_num_cpus=2", "simulation.flower_client_cpus=1",
]


def test_arrays_round_trip_bit_exact_and_named_like_the_state_dict():
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    spec = ParamSpec.of(model)
    flat = flatten(model, spec)
    record = to_arrays(flat, spec)
    assert list(record.keys()) == list(model.state_dict().keys())
    assert torch.equal(from_arrays(record, spec), flat)


def test_arrays_of_another_model_are_refused_by_name():
    a = build_model("logreg", (60,), 10)
    b = build_model("2nn", (60,), 10)
    with pytest.raises(SpecMismatch, match="missing"):
        from_arrays(to_arrays(flatten(b), ParamSpec.of(b)), ParamSpec.of(a))


def test_engine_choice_and_ray_settings_come_from_the_config():
    cfg = load_config(None, ["simulation.engine='flower'", "simulation.flower_client_cpus=0.5",
                             "simulation.flower_client_gpus=0.25", "simulation.ray_num_cpus=2"])
    bc = backend_config(cfg)
    assert bc["client_resources"] == {"num_cpus": 0.5, "num_gpus": 0.25}
    assert bc["init_args"] == {"num_cpus": 2, "include_dashboard": False}
    cluster = load_config(None, ["simulation.engine='flower'", "simulation.ray_address='ray://head:10001'"])
    assert backend_config(cluster)["init_args"] == {"address": "ray://head:10001"}


def test_a_client_larger_than_the_ray_runtime_is_a_config_error():
    cfg = load_config(None, ["simulation.engine='flower'", "simulation.flower_client_cpus=4", "simulation.ray_num_cpus=2"])
    with pytest.raises(ConfigError, match="flower_client_cpus"):
        backend_config(cfg)
    with pytest.raises(ConfigError, match="simulation.engine"):
        load_config(None, ["simulation.engine='ray'"])


@pytest.fixture(scope="module")
def flower_and_inprocess(tmp_path_factory):
    """The same 10-client, 5-per-round, 3-round experiment on both engines."""
    from shoal.simulations.flower_engine import run_flower

    cfg = load_config(None, SMALL)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as Ray gives each 1-CPU actor; more threads only contend on 2 cores
    try:
        flower_out = tmp_path_factory.mktemp("flower")
        flower = run_flower(load_config(None, SMALL + ["simulation.engine='flower'"]), flower_out, progress=False)
        sim = InProcessSimulation(cfg)
        initial = sim.evaluate()
        for _ in range(cfg.simulation.rounds):
            sim.run_round()
        inproc_out = tmp_path_factory.mktemp("inprocess")
        run_simulation(cfg, inproc_out, progress=False)
    finally:
        torch.set_num_threads(threads)
    return flower, flower_out, sim, initial, inproc_out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flower_engine_reproduces_the_inprocess_global_model(flower_and_inprocess):
    flower, flower_out, sim, _, inproc_out = flower_and_inprocess
    diff = (flower.global_params - sim.global_params.cpu()).abs().max().item()
    assert diff <= 1e-5, diff
    ours, theirs = read_jsonl(flower_out / "metrics.jsonl"), read_jsonl(inproc_out / "metrics.jsonl")
    assert [r["round"] for r in ours] == [1, 2, 3]
    for a, b in zip(ours, theirs, strict=True):
        assert set(a) == set(b)
        for key in ("version", "num_results", "num_examples"):
            assert a[key] == b[key], key
        for key in ("test_accuracy", "test_loss", "train_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), key
    summary = json.loads((flower_out / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["rounds"] == 3 and summary["num_clients"] == 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shoal_strategy_in_a_flower_serverapp_improves_accuracy(flower_and_inprocess):
    """ServerApp(ShoalStrategy) against shoal ClientApps in Flower's simulation."""
    flower, _, _, initial, _ = flower_and_inprocess
    assert flower.summary["final_test_accuracy"] > initial["accuracy"] + 0.1, (flower.summary, initial)
