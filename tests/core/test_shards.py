"""`shoal data split`: the built-in split as before, and a task's simulation split as shard files."""

import pytest
import torch
from typer.testing import CliRunner

from shoal.cli import app
from shoal.config import load_config
from shoal.datasets import load_federated
from shoal.errors import DataError
from shoal.shard_split import write_shards
from shoal.shards import load_shard
from shoal.task import TaskError

TASK = """
import torch
from torch import nn
from torch.utils.data import Dataset

from shoal.task import SimulationData, Task


class Rows(Dataset):
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Regression(Task):
    def __init__(self, as_dataset=False):
        self.as_dataset = as_dataset

    def model(self):
        return nn.Linear(3, 1)

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        pairs = [(torch.randn(5 + i, 3, generator=g), torch.randn(5 + i, generator=g)) for i in range(num_clients)]
        train = [Rows(*p) for p in pairs] if self.as_dataset else pairs
        test = [(torch.randn(2, 3, generator=g), torch.randn(2, generator=g)) if i == 1 else None
                for i in range(num_clients)]
        return SimulationData(train=train, client_test=test, client_ids=[f"site-{i}" for i in range(num_clients)])
"""


def test_builtin_split_is_the_simulators(tmp_path):
    cfg = load_config(None, ["simulation.num_clients=3"])
    paths = write_shards(cfg, tmp_path)
    fed = load_federated(cfg.data, 3, cfg.simulation.seed)
    assert [p.name for p in paths] == [f"client-0000{i}.safetensors" for i in range(3)]
    for i, p in enumerate(paths):
        shard = load_shard(p)
        idx = torch.as_tensor(fed.client_indices[i], dtype=torch.long)
        assert torch.equal(shard.x, fed.train.x[idx]) and torch.equal(shard.y, fed.train.y[idx])
        assert shard.test_x is None and shard.num_classes == fed.num_classes


def test_task_split_writes_each_clients_tensors(tmp_path):
    (tmp_path / "reg.py").write_text(TASK)
    out = tmp_path / "shards"
    res = CliRunner().invoke(
        app,
        [
            "data",
            "split",
            "--task",
            f"{tmp_path / 'reg.py'}:Regression",
            "--set",
            "simulation.num_clients=3",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "wrote 3 shards" in res.output
    assert sorted(p.name for p in out.iterdir()) == [f"site-{i}.safetensors" for i in range(3)]
    cfg = load_config(None, ["simulation.num_clients=3"])
    from shoal.task import load_task

    want = load_task(f"{tmp_path / 'reg.py'}:Regression").simulation_data(3, cfg.simulation.seed)
    for i in range(3):
        with pytest.raises(DataError, match="float32"):  # regression targets are float: the built-in check refuses
            load_shard(out / f"site-{i}.safetensors")
        shard = load_shard(out / f"site-{i}.safetensors", check_dtypes=False)
        assert shard.client_id == f"site-{i}"
        assert torch.equal(shard.x, want.train[i][0]) and torch.equal(shard.y, want.train[i][1])
        assert (shard.test_x is not None) == (i == 1)
    one = load_shard(out / "site-1.safetensors", check_dtypes=False)
    assert torch.equal(one.test_x, want.client_test[1][0]) and torch.equal(one.test_y, want.client_test[1][1])


def test_task_split_of_datasets_is_one_clear_error(tmp_path):
    (tmp_path / "reg.py").write_text(TASK)
    cfg = load_config(
        None,
        [f"task.app='{tmp_path / 'reg.py'}:Regression'", "task.args={as_dataset = true}", "simulation.num_clients=2"],
    )
    with pytest.raises(TaskError, match=r"train\[0\] is a Rows, not tensors.*local_data"):
        write_shards(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
