"""SCAFFOLD, FedNova, FedDyn, Ditto, FedPer and FedRep in the simulator: the invariants the
papers rely on hold after real rounds, client state survives on disk as in memory, the
personalised figures reach metrics.jsonl, and unsound combinations are refused."""

from __future__ import annotations

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation

SMALL = [
    "simulation.num_clients=6",
    "simulation.clients_per_round=3",
    "simulation.rounds=3",
    "simulation.device='cpu'",
    "simulation.progress=false",
    "output.plots=false",
    "train.lr=0.05",
]

TASK = '''
import torch
from collections import OrderedDict
from torch import nn
from shoal.task import SimulationData, Task


class TwoClasses(Task):
    """Each client sees two of four classes of 2-d blobs; a small body and a personal head."""

    personal = ("head",)

    def model(self):
        return nn.Sequential(OrderedDict(body=nn.Linear(2, 8), act=nn.ReLU(), head=nn.Linear(8, 4)))

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        centres = torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]])

        def draw(i, n):
            y = torch.tensor([(i + k % 2) % 4 for k in range(n)])
            return centres[y] + torch.randn(n, 2, generator=g), y

        train = [draw(i, 20 + 2 * i) for i in range(num_clients)]
        tests = [draw(i, 10) for i in range(num_clients)]
        return SimulationData(train=train, test=draw(0, 20), client_test=tests)
'''


def config(*extra: str):
    return load_config(None, [*SMALL, *extra])


@pytest.fixture
def task_app(tmp_path):
    path = tmp_path / "two_classes.py"
    path.write_text(TASK)
    return f"task.app='{path}:TwoClasses'"


def run(sim: InProcessSimulation) -> torch.Tensor:
    for _ in range(sim.cfg.simulation.rounds):
        sim.run_round()
    return sim.global_params.clone()


def test_scaffold_keeps_c_the_mean_of_the_clients_control_variates():
    sim = InProcessSimulation.from_config(config("algorithm.name='scaffold'"))
    scaffold = run(sim)
    assert sim.control is not None
    cs = [sim.states.get(c).get("scaffold/c", torch.zeros_like(sim.control.c)) for c in sim.client_ids]
    assert sim.participants and len(sim.states) == len(sim.participants)
    assert torch.allclose(torch.stack(cs).mean(0), sim.control.c, atol=1e-6)  # c = (1/N) sum_i c_i
    assert sim.control.c.abs().max() > 0
    assert (scaffold - run(InProcessSimulation.from_config(config()))).abs().max() > 1e-4  # not FedAvg


@pytest.mark.parametrize("name", ["scaffold", "fednova", "feddyn"])
@pytest.mark.parametrize("path", ["chain", "vmap"])
def test_the_batched_trainer_gives_the_one_by_one_model(tmp_path, name, path):
    """SCAFFOLD's drift, FedDyn's correction and proximal term, FedNova's step weight: the batched
    many-clients trainer (the hand-written Linear chain, and vmap for other models) adds them as
    LocalTrainer does, so a batched round gives the one-by-one round's model and state."""
    extra = [f"algorithm.name='{name}'", "train.momentum=0.5", "train.epochs=2"]
    if path == "vmap":  # Tanh is not a layer of the hand-written chain: the vmap path trains it
        (tmp_path / "tanh.py").write_text(TASK.replace("nn.ReLU()", "nn.Tanh()"))
        extra.append(f"task.app='{tmp_path / 'tanh.py'}:TwoClasses'")
    one = InProcessSimulation.from_config(config(*extra, "simulation.batch_clients=1"))
    many = InProcessSimulation.from_config(config(*extra, "simulation.batch_clients=3"))
    assert one.batched is None and many.batched is not None
    assert (many.batched.chain is not None) == (path == "chain")
    gap = float((run(one) - run(many)).abs().max())
    assert gap < 1e-5, gap
    if name == "scaffold":
        assert float((one.control.c - many.control.c).abs().max()) < 1e-5 and float(many.control.c.abs().max()) > 0
    if name == "feddyn":
        for c in one.participants:
            assert float((one.states.get(c)["feddyn/grad"] - many.states.get(c)["feddyn/grad"]).abs().max()) < 1e-5


@pytest.mark.parametrize("name", ["scaffold", "ditto"])
def test_client_state_on_disk_gives_the_in_memory_run(tmp_path, name):
    memory = run(InProcessSimulation.from_config(config(f"algorithm.name='{name}'")))
    sim = InProcessSimulation.from_config(config(f"algorithm.name='{name}'", f"algorithm.state_dir='{tmp_path / 's'}'"))
    assert torch.equal(run(sim), memory)
    assert len(list((tmp_path / "s").glob("*.safetensors"))) == len(sim.participants)


@pytest.mark.parametrize("name", ["fednova", "feddyn"])
def test_fednova_and_feddyn_train_and_differ_from_fedavg(name):
    extra = ["train.epochs=2", "train.momentum=0.5"] if name == "fednova" else []
    fedavg = run(InProcessSimulation.from_config(config(*extra)))
    other = run(InProcessSimulation.from_config(config(f"algorithm.name='{name}'", *extra)))
    assert torch.isfinite(other).all() and (other - fedavg).abs().max() > 1e-4


SECURE = ["secure_aggregation.enabled=true", "secure_aggregation.bits=28", "secure_aggregation.clip=1.0"]


@pytest.mark.parametrize("name", ["scaffold", "fednova", "feddyn"])
def test_secure_aggregation_gives_the_plain_model_and_server_state(name, caplog):
    """Under secure aggregation the server sees only sums: SCAFFOLD's control-variate deltas are
    masked beside the update, FedNova's clients mask Delta/a_k, FedDyn needs only the mean and the
    count. With a fine fixed-point grid (28 bits, clip 1) the model, SCAFFOLD's c and FedDyn's h
    equal the plain run's within the encoding's rounding."""
    extra = [f"algorithm.name='{name}'", "train.momentum=0.5", "train.epochs=2", "simulation.batch_clients=1"]
    plain = InProcessSimulation.from_config(config(*extra))
    secure = InProcessSimulation.from_config(config(*extra, *SECURE))
    runner = secure.secure_aggregation
    assert runner is not None and runner.payload.vector_size == secure.spec.numel * (2 if name == "scaffold" else 1) + 1
    start = plain.global_params.clone()
    gap = float((run(plain) - run(secure)).abs().max())
    assert gap < 1e-5, gap
    assert float((plain.global_params - start).abs().max()) > 1e-3  # it trained
    assert "are clipped" not in caplog.text
    if name == "scaffold":
        assert float(secure.control.c.abs().max()) > 1e-3
        assert float((plain.control.c - secure.control.c).abs().max()) < 1e-5
    if name == "feddyn":
        h = (plain.rounds.strategy.h, secure.rounds.strategy.h)
        assert float(h[0].abs().max()) > 1e-4 and float((h[0] - h[1]).abs().max()) < 1e-5


@pytest.mark.parametrize("name", ["fedper", "fedrep", "ditto"])
def test_personalised_metrics_reach_metrics_jsonl(tmp_path, task_app, name):
    cfg = config(task_app, f"algorithm.name='{name}'", "algorithm.personal_eval_steps=2", "simulation.rounds=2")
    run_simulation(cfg, tmp_path / "run", progress=False)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    last = records[-1]
    assert 0 <= last["fed_personal_accuracy"] <= 1 and "fed_accuracy" in last
    if name != "ditto":  # the head never leaves: the server's head is still the initial one
        sim = InProcessSimulation.from_config(cfg)
        head = [e for e in sim.spec.entries if e.name.startswith("head.")]
        start = sim.global_params.clone()
        run(sim)
        for e in head:
            assert torch.equal(sim.global_params[e.offset : e.offset + e.numel], start[e.offset : e.offset + e.numel])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["algorithm.name='fednova'", "privacy.mode='central'"], "noise no longer matches"),
        (["algorithm.name='scaffold'", "privacy.mode='central'"], "second release"),
        (["algorithm.name='ditto'", "simulation.mode='async'"], "stale results"),
        (["algorithm.name='feddyn'", "robust.rule='median'"], "mean of updates"),
        (["algorithm.personal_eval_steps=3", "privacy.mode='central'"], "outside the epsilon"),
    ],
)
def test_unsound_combinations_are_refused_with_the_reason(extra, match):
    with pytest.raises(ConfigError, match=match):
        config(*extra)


def test_kept_momentum_changes_the_run_and_trains_one_by_one():
    plain = run(InProcessSimulation.from_config(config("train.momentum=0.5")))
    sim = InProcessSimulation.from_config(config("train.momentum=0.5", "algorithm.keep_optimizer_state=true"))
    kept = run(sim)
    assert sim.batched is None and all("optimizer/momentum" in sim.states.get(c) for c in sim.participants)
    assert (kept - plain).abs().max() > 1e-5


def test_top_k_residuals_on_disk_give_the_in_memory_run(tmp_path):
    topk = ["compression.encoding='topk'", "compression.topk_fraction=0.2"]
    memory = InProcessSimulation.from_config(config(*topk))
    a = run(memory)
    sim = InProcessSimulation.from_config(config(*topk, f"algorithm.state_dir='{tmp_path}'"))
    assert torch.equal(run(sim), a)
    files = list((tmp_path / "residuals").glob("*.safetensors"))
    assert len(files) == len(sim.participants) > 0
    tk, disk = memory.wire.compressor.topk, sim.wire.compressor.topk
    assert tk is not None and disk is not None
    assert all(torch.equal(tk.residuals[c], disk.residuals[c]) for c in memory.participants)
