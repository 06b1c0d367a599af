"""The task API: loading a user's task, what it may give, and one clear error for each mistake."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import shoal
from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig, load_config
from shoal.params import ParamSpec
from shoal.simulations.inprocess import InProcessSimulation
from shoal.task import TaskError, check_loss, load_task
from tests.spawn import run_python

TASK_FILE = """
import torch
from torch import nn
import shoal

class Tiny(shoal.Task):
    num_classes = 3
    def __init__(self, width=8, clients_with_tests=False):
        self.width, self.clients_with_tests = width, clients_with_tests
    def model(self):
        return nn.Sequential(nn.Linear(4, self.width), nn.ReLU(), nn.Linear(self.width, 3))
    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(4, 3, generator=g)
        def draw(n):
            x = torch.randn(n, 4, generator=g)
            return x, (x @ w).argmax(1)
        train = [draw(40) for _ in range(num_clients)]
        tests = [draw(10) for _ in range(num_clients)] if self.clients_with_tests else None
        return shoal.SimulationData(train=train, test=draw(200), client_test=tests)

task = Tiny()
"""


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "user_task.py"
    path.write_text(TASK_FILE)
    return path


def small(task: str, *extra: str):
    return load_config(
        None,
        [
            f'task.app="{task}"',
            "simulation.rounds=3",
            "simulation.num_clients=6",
            "simulation.clients_per_round=3",
            "output.plots=false",
            *extra,
        ],
    )


# --- loading ----------------------------------------------------------------------------------


def test_a_task_loads_as_instance_class_with_args_or_module_path(task_file):
    assert isinstance(load_task(f"{task_file}:task"), shoal.Task)
    wide = load_task(f"{task_file}:Tiny", {"width": 16})
    assert wide.width == 16
    builtin = load_task("shoal.tasks:BuiltinTask", {"model": "2nn", "dataset": "synthetic"})
    assert builtin.model_name == "2nn"


@pytest.mark.parametrize(
    "spec, args, needle",
    [
        ("no_colon", None, "expected path/to/file.py:name"),
        ("{dir}/missing.py:task", None, "not found"),
        ("{file}:nothing", None, "has no attribute 'nothing'"),
        ("{file}:Tiny", {"depth": 3}, "[task.args] do not fit Tiny"),
        ("{file}:task", {"width": 3}, "is an instance"),
        ("{file}:torch", None, "torch is a module, not a Task"),
        ("no.such.module:task", None, "cannot import module 'no.such.module'"),
    ],
)
def test_loading_mistakes_are_one_clear_line(task_file, spec, args, needle):
    with pytest.raises(TaskError) as e:
        load_task(spec.format(dir=task_file.parent, file=task_file), args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_task_file_that_fails_to_import_names_the_error(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(TaskError, match="importing .*broken.py failed: RuntimeError: no GPU here"):
        load_task(f"{bad}:task")


@pytest.mark.parametrize(
    "body, needle",
    [
        ("def model(self): return 3", "model() returned a int"),
        ("def simulation_data(self, n, seed): return [1, 2]", "simulation_data() returned a list"),
        (
            "def simulation_data(self, n, seed): "
            "return shoal.SimulationData(train=[(torch.zeros(3, 4), torch.zeros(2))])",
            "has 3 inputs but 2 targets",
        ),
        ("def simulation_data(self, n, seed): return shoal.SimulationData(train=['a'])", "train[0] is a str"),
        ("def loss(self, model, x, y): return (model(x) - 1).pow(2).mean(1)", "expected a scalar tensor"),
        ("def loss(self, model, x, y): return torch.tensor(1.0)", "has no gradient"),
        ("def loss(self, model, x, y): return model(x.view(-1, 5)).sum()", "loss(model, x, y) failed: RuntimeError"),
    ],
)
def test_a_broken_task_part_is_named(tmp_path, body, needle):
    path = tmp_path / "t.py"
    path.write_text(
        TASK_FILE.replace(
            "task = Tiny()",
            textwrap.dedent(f"""
        class Broken(Tiny):
            {body}
        task = Broken()
    """),
        )
    )
    with pytest.raises(TaskError, match=f"task {path}:task: .*") as e:
        InProcessSimulation.from_config(small(f"{path}:task"))
    assert needle in str(e.value)


@pytest.mark.slow
def test_the_cli_prints_one_line_and_exits_2_for_a_broken_task(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("def broken(:\n")
    proc = run_python(["simulate", "--task", f"{path}:task", "-q"], timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: task {path}:task: importing {path} failed: SyntaxError")
    assert "Traceback" not in proc.stderr


# --- what a task may give ----------------------------------------------------------------------


class TensorsAsDataset(Dataset):
    """A plain Dataset (not a TensorDataset), so training goes through the DataLoader path."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def test_dataloader_path_gives_the_update_of_the_tensor_path():
    torch.manual_seed(0)
    x, y = torch.randn(53, 6), torch.randint(0, 3, (53,))
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3, prox_mu=0.1)
    trainer = LocalTrainer(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)), cfg)
    g = trainer.flat.clone()
    a = trainer.fit(g, (x, y), seed=7)
    b = trainer.fit(g, TensorsAsDataset(x, y), seed=7)
    assert torch.allclose(a.delta, b.delta, atol=1e-6) and a.delta.abs().max() > 0
    assert a.metrics == pytest.approx(b.metrics)
    assert trainer.evaluate_data(g, (x, y)) == pytest.approx(trainer.evaluate_data(g, TensorsAsDataset(x, y)))


class Adapter(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(32, 32)
        self.base.requires_grad_(False)
        self.down, self.up = nn.Linear(32, 2, bias=False), nn.Linear(2, 32, bias=False)
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        h = self.base(x)
        return self.head(h + self.up(self.down(h)))


def test_frozen_parameters_never_travel_and_never_change():
    model = Adapter()
    trainer = LocalTrainer(model, TrainConfig(lr=0.5, batch_size=4))
    names = [e.name for e in trainer.spec.entries]
    assert names == ["down.weight", "up.weight", "head.weight", "head.bias"]
    base = model.base.weight.detach().clone()
    update = trainer.fit(trainer.flat.clone(), (torch.randn(16, 32), torch.randint(0, 3, (16,))), seed=1)
    assert update.delta.numel() == 2 * 32 * 2 + 32 * 3 + 3
    assert torch.equal(model.base.weight, base)


def test_tied_weights_are_exchanged_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    spec = ParamSpec.of(nn.Sequential(emb, head))
    assert [e.name for e in spec.entries] == ["0.weight"]


def test_fedbn_keeps_batchnorm_statistics_per_client(tmp_path):
    path = tmp_path / "bn.py"
    path.write_text(
        TASK_FILE.replace(
            "task = Tiny()",
            textwrap.dedent("""
        class BN(Tiny):
            exchange_buffers = False
            def model(self):
                return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
        task = BN()
    """),
        )
    )
    sim = InProcessSimulation.from_config(small(f"{path}:task", "simulation.clients_per_round=6"))
    assert not any("running" in e.name for e in sim.spec.entries)
    sim.run_round()
    means = {c: s["1.running_mean"] for c, s in sim.local_states.items()}
    assert len(means) == 6
    assert not torch.allclose(means["client-00000"], means["client-00001"])
    before = {c: m.clone() for c, m in means.items()}
    sim.run_round()  # each client starts its second round from its own statistics
    assert all(not torch.equal(before[c], sim.local_states[c]["1.running_mean"]) for c in before)


def test_a_task_optimizer_trains_and_a_bad_one_is_refused(task_file):
    task = load_task(f"{task_file}:task")
    task.optimizer, task.optimizer_args = "adamw", {"weight_decay": 0.01}
    sim = InProcessSimulation.from_config(small(f"{task_file}:task"), task=task)
    assert sim.batched is None  # adamw is not the batched path's SGD
    start = sim.evaluate()["test_loss"]
    for _ in range(3):
        sim.run_round()
    assert sim.evaluate()["test_loss"] < start
    task.optimizer = "lbfgs"
    with pytest.raises(TaskError, match="optimizer = 'lbfgs' is not one of sgd, adam, adamw"):
        InProcessSimulation.from_config(small(f"{task_file}:task"), task=task)


def test_user_metrics_are_example_weighted_and_summarized(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        TASK_FILE.replace(
            "task = Tiny()",
            textwrap.dedent("""
        class Metrics(Tiny):
            def metrics(self, model, x, y):
                return {"mean_target": y.float().mean()}
            def summarize(self, means):
                return {**means, "square": means["mean_target"] ** 2}
        task = Metrics(clients_with_tests=True)
    """),
        )
    )
    sim = InProcessSimulation.from_config(small(f"{path}:task"))
    ev = sim.evaluate()
    test_y = sim.data.test[1].double()
    assert ev["test_mean_target"] == pytest.approx(float(test_y.mean()))
    assert ev["test_square"] == pytest.approx(float(test_y.mean()) ** 2)
    all_y = torch.cat([t[1] for t in sim.data.client_test]).double()
    assert ev["fed_mean_target"] == pytest.approx(float(all_y.mean()))
    # derived once from the pooled mean, not averaged over clients' own squares
    assert ev["fed_square"] == pytest.approx(float(all_y.mean()) ** 2)
    assert ev["fed_num_examples"] == len(all_y)


def test_check_loss_leaves_no_trace():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    data = (torch.randn(5, 4), torch.randint(0, 3, (5,)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    check_loss(shoal.Task(), model, data, torch.device("cpu"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())
    assert all(p.grad is None for p in model.parameters())


def test_check_loss_after_binding_keeps_the_trainer_training():
    trainer = LocalTrainer(nn.Linear(4, 3), TrainConfig(lr=0.5, batch_size=4))
    data = (torch.randn(8, 4), torch.randint(0, 3, (8,)))
    check_loss(shoal.Task(), trainer.model, data, torch.device("cpu"))
    assert trainer.fit(trainer.flat.clone(), data, seed=0).delta.abs().max() > 0


# --- partitioning helpers ---------------------------------------------------------------------


def test_partition_dataset_splits_tensors_and_datasets_the_same_way():
    x, y = torch.randn(300, 2), torch.arange(300) % 5
    pairs = shoal.partition_dataset((x, y), 6, "dirichlet", seed=3, alpha=0.3)
    subsets = shoal.partition_dataset(TensorsAsDataset(x, y), 6, "dirichlet", seed=3, alpha=0.3, labels=y)
    assert isinstance(pairs, shoal.Partitioned) and len(pairs) == len(subsets) == 6
    for (_px, py), sub in zip(pairs, subsets):
        assert torch.equal(py, torch.stack([sub[i][1] for i in range(len(sub))]))
    assert sum(len(p[1]) for p in pairs) == 300
    natural = shoal.partition_dataset((x, y), 0, "natural", key=lambda i: int(y[i]))
    assert [int(p[1].unique()) for p in natural] == [0, 1, 2, 3, 4]
