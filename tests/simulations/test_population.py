"""Populations far larger than a round: clients loaded one at a time through Task.population().

The lazy path must give the model the same data held whole gives, load only the clients a round
selects, and refuse with one line what it cannot do without every client's data."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from shoal import Population, SimulationData, Task
from shoal.config import load_config
from shoal.errors import ConfigError, ShoalError
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation
from shoal.synthetic import SyntheticPopulation
from shoal.task import TaskError
from shoal.tasks import SyntheticPopulationTask
from tests.conftest import REPO
from tests.spawn import run_python


def cfg(n: int, k: int, *extra: str):
    return load_config(
        None,
        [
            f"simulation.num_clients={n}",
            f"simulation.clients_per_round={k}",
            "simulation.rounds=3",
            "simulation.progress=false",
            "train.batch_size=50",
            *extra,
        ],
    )


class Counting(Population):
    """Tiny per-client data made from the index alone; counts what was loaded."""

    def __init__(self, n: int):
        self.n = n
        self.loaded: list[int] = []
        self.tested: list[int] = []

    def __len__(self) -> int:
        return self.n

    def num_examples(self, i: int) -> int:
        return 3 + i % 5

    def train_data(self, i: int):
        self.loaded.append(i)
        g = torch.Generator().manual_seed(i)
        x = torch.randn(self.num_examples(i), 4, generator=g)
        return x, (x.sum(1) > 0).long()

    def test_data(self, i: int):
        self.tested.append(i)
        return self.train_data(i)


class CountingTask(Task):
    num_classes = 2

    def __init__(self, n: int = 100_000):
        self.pop = Counting(n)

    def model(self) -> nn.Module:
        return nn.Linear(4, 2)

    def population(self, num_clients: int, seed: int) -> Population:
        return self.pop


def test_large_population_loads_only_the_round_cohort():
    """100,000 clients, 100 a round: one round loads client 0 (the build's loss check) and the
    cohort, each once, and federated evaluation reads one fixed sample of a round's size."""
    task = CountingTask(100_000)
    sim = InProcessSimulation.from_config(cfg(100_000, 100), task=task)
    assert len(sim.client_ids) == 100_000 and len(set(sim.client_ids)) == 100_000
    assert task.pop.loaded == [0]
    summary = sim.run_round()
    assert summary.num_results == 100
    cohort = {sim._index[c] for c in sim.participants}
    assert len(cohort) == 100
    assert set(task.pop.loaded) <= cohort | {0}
    assert sorted(task.pop.loaded[1:]) == sorted(cohort)  # once each, gathered for the batched trainer
    ev = sim.evaluate()
    assert "fed_accuracy" in ev and len(task.pop.tested) == 100
    assert ev["fed_num_examples"] == sum(3 + i % 5 for i in sim.fed_eval_clients)
    sim.evaluate()
    assert task.pop.tested[:100] == task.pop.tested[100:]  # the same clients every evaluation


@pytest.mark.parametrize(
    "extra", [[], ["simulation.batch_clients=1"], ["attack.kind='label_flip'", "attack.fraction=0.3"]]
)
def test_lazy_population_gives_the_model_of_the_same_data_held_whole(extra):
    task = SyntheticPopulationTask()
    lazy = InProcessSimulation.from_config(cfg(50, 10, *extra), task=task)
    held = InProcessSimulation.from_config(cfg(50, 10, *extra), data=task.simulation_data(50, 0), task=task)
    assert lazy.client_ids == held.client_ids
    assert lazy.shards.total_examples() == held.shards.total_examples()
    for _ in range(2):
        lazy.run_round()
        held.run_round()
    torch.testing.assert_close(lazy.global_params, held.global_params, atol=1e-6, rtol=0)
    assert lazy.evaluate()["test_loss"] == pytest.approx(held.evaluate()["test_loss"], abs=1e-6)


@pytest.mark.parametrize(
    "extra",
    [
        ["privacy.mode='central'", "privacy.noise_multiplier=0.5", "privacy.clip_norm=1.0"],
        ["secure_aggregation.enabled=true"],
        ["simulation.mode='async'", "asynchronous.buffer_size=5"],
    ],
    ids=["central-dp", "secagg", "async"],
)
def test_features_run_on_a_population(tmp_path, extra):
    app = "task.app='shoal.tasks:SyntheticPopulationTask'"
    summary = run_simulation(cfg(2_000, 10, app, "simulation.rounds=2", *extra), tmp_path, progress=False)
    assert summary["rounds"] >= 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["test_accuracy"] >= 0
    # the clients' own evaluations are their data, un-noised: a DP run withholds them (privacy.release)
    assert ("fed_accuracy" in records[-1]) == (not any("privacy" in e for e in extra))


def test_population_only_task_refused_where_every_client_is_needed(tmp_path):
    path = tmp_path / "pop_task.py"
    path.write_text(
        "import torch\nfrom torch import nn\nfrom shoal import Population, Task\n"
        "class P(Population):\n"
        "    def __len__(self): return 10\n"
        "    def num_examples(self, i): return 4\n"
        "    def train_data(self, i): return torch.zeros(4, 3), torch.zeros(4, dtype=torch.long)\n"
        "class T(Task):\n"
        "    def model(self): return nn.Linear(3, 2)\n"
        "    def population(self, n, seed): return P()\n"
        "task = T()\n"
    )
    c = cfg(10, 2, f"task.app='{path}:task'", "simulation.mode='gossip'")
    with pytest.raises(ConfigError, match="population.*simulation_data"):
        run_simulation(c, tmp_path / "out", progress=False)


class Broken(Counting):
    def __init__(self, n, fail_at: int, wrong_size: bool = False):
        super().__init__(n)
        self.fail_at, self.wrong_size = fail_at, wrong_size

    def train_data(self, i: int):
        if i == self.fail_at and not self.wrong_size:
            raise OSError(f"shard {i} unreadable")
        x, y = super().train_data(i)
        return (x[:-1], y[:-1]) if i == self.fail_at else (x, y)


@pytest.mark.parametrize(
    "pop, needle",
    [
        (Broken(20, 0), r"population.train_data\(0\) failed: OSError: shard 0 unreadable"),
        (Broken(20, 0, wrong_size=True), r"train_data\(0\) has 2 examples but population.num_examples\(0\) said 3"),
        (type("Half", (), {"train_data": lambda self, i: None})(), "without __len__, num_examples"),
    ],
)
def test_population_errors_are_one_task_error_line(pop, needle):
    with pytest.raises(TaskError, match=needle) as e:
        InProcessSimulation.from_config(cfg(20, 5), data=pop, task=CountingTask(20))
    assert "\n" not in str(e.value)


def test_a_failing_client_later_names_the_client():
    pop = Broken(20, 7)
    sim = InProcessSimulation.from_config(cfg(20, 20, "simulation.batch_clients=1"), data=pop, task=CountingTask(20))
    with pytest.raises(ShoalError, match=r"population.train_data\(7\) failed"):
        sim.run_round()


class Rows(torch.utils.data.Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class DatasetPopulation(Counting):
    """Clients as torch Datasets: trained one by one through a DataLoader, loaded when selected."""

    def train_data(self, i: int):
        return Rows(*super().train_data(i))


def test_dataset_clients_train_one_by_one_and_match_the_tensor_population():
    as_rows, as_pairs = DatasetPopulation(300), Counting(300)
    rows = InProcessSimulation.from_config(cfg(300, 8), data=as_rows, task=CountingTask(300))
    pairs = InProcessSimulation.from_config(
        cfg(300, 8, "simulation.batch_clients=1"), data=as_pairs, task=CountingTask(300)
    )
    assert rows.batched is None and not rows.shards.in_memory
    rows.run_round()
    pairs.run_round()
    assert len(as_rows.loaded) == 1 + 8
    torch.testing.assert_close(rows.global_params, pairs.global_params, atol=1e-6, rtol=0)


def test_synthetic_population_is_a_function_of_seed_and_client():
    small, big = SyntheticPopulation(30, seed=3), SyntheticPopulation(3_000, seed=3)
    for i in (0, 7, 29):
        assert small.num_examples(i) == big.num_examples(i) == small.train_data(i)[1].shape[0]
        assert torch.equal(small.train_data(i)[0], big.train_data(i)[0])
        assert torch.equal(small.test_data(i)[1], big.test_data(i)[1])
    assert not torch.equal(small.train_data(1)[0][:5], SyntheticPopulation(30, seed=4).train_data(1)[0][:5])


def test_cli_simulates_the_builtin_population(tmp_path):
    r = run_python(
        ["simulate", "-q", "--task", "shoal.tasks:SyntheticPopulationTask"]
        + ["--out", str(tmp_path), "--set", "simulation.num_clients=20000", "--set", "simulation.clients_per_round=20"]
        + ["--set", "simulation.rounds=3"],
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in records] == [1, 2, 3]
    assert {"test_accuracy", "fed_accuracy", "fed_num_examples"} <= set(records[-1])
    assert json.loads((tmp_path / "summary.json").read_text())["num_clients"] == 20000


def test_simulation_data_task_is_unchanged_by_the_hook():
    """A task without population() runs on SimulationData as before (held whole)."""
    task = SyntheticPopulationTask()
    task.population = lambda n, seed: None  # type: ignore[method-assign]
    sim = InProcessSimulation.from_config(cfg(20, 5), task=task)
    assert isinstance(sim.data, SimulationData) and sim.shards.in_memory
