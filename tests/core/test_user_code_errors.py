"""A mistake in the user's task code is one line naming the task's part, the exception and a fix,
exit status 2 and no traceback (unless -v), in simulate and in the privacy sweep."""

from __future__ import annotations

import sys

import pytest

from shoal import cli
from shoal.task import UserCodeError

# a model with 5 logits for labels 0-9: the two-example check passes (labels 0 and 1), training does not
FIVE_LOGITS = """
import torch
from torch import nn
from shoal.task import SimulationData, Task


class FiveLogits(Task):
    def model(self):
        return nn.Linear(8, 5)

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(20 * num_clients, 8, generator=g)
        y = torch.arange(20 * num_clients) % 10
        return SimulationData(train=[(x[i::num_clients], y[i::num_clients]) for i in range(num_clients)],
                              test=(x[:10], y[:10] % 5))


task = FiveLogits()
"""

# a Dataset with one unreadable item (as an image folder with one corrupt PNG)
BAD_ITEM = """
import torch
from torch import nn
from torch.utils.data import Dataset
from shoal.task import SimulationData, Task


class Images(Dataset):
    def __init__(self, n, bad):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise OSError(f"cannot identify image file 'digits/{i}.png'")
        return torch.full((8,), float(i % 3)), i % 3


class BadItem(Task):
    def model(self):
        return nn.Linear(8, 3)

    def simulation_data(self, num_clients, seed):
        return SimulationData(train=[Images(12, 7) for _ in range(num_clients)], test=Images(6, -1))


task = BadItem()
"""

SMALL = ["--set", "simulation.num_clients=2", "--set", "simulation.rounds=1", "--set", "train.batch_size=4", "-q"]


def run_cli(monkeypatch, capsys, args: list[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["shoal", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    return int(e.value.code or 0), capsys.readouterr().err


@pytest.mark.parametrize(
    "source, needle",
    [
        (FIVE_LOGITS, "is out of bounds; the model gives fewer outputs (classes) than the labels need"),
        (BAD_ITEM, "data (dataset[i] / collate_fn) failed: OSError: cannot identify image file 'digits/7.png'"),
    ],
)
def test_simulate_prints_one_line_with_the_part_and_a_fix(tmp_path, monkeypatch, capsys, source, needle):
    path = tmp_path / "task.py"
    path.write_text(source)
    rc, err = run_cli(monkeypatch, capsys, ["simulate", "--task", f"{path}:task", "-o", str(tmp_path / "out"), *SMALL])
    assert rc == 2
    assert err.startswith(f"error: task {path}:task: ") and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    # -v: the traceback of what the task raised, then the same line
    rc, err = run_cli(
        monkeypatch, capsys, ["simulate", "--task", f"{path}:task", "-o", str(tmp_path / "out"), *SMALL, "-v"]
    )
    assert rc == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: task ")


def test_the_privacy_sweep_stops_at_the_tasks_own_error(tmp_path, monkeypatch, capsys):
    path = tmp_path / "task.py"
    path.write_text(BAD_ITEM)
    rc, err = run_cli(
        monkeypatch, capsys, ["privacy-sweep", "--task", f"{path}:task", "-o", str(tmp_path / "sweep"), *SMALL]
    )
    assert rc == 2
    assert "data (dataset[i] / collate_fn) failed: OSError" in err and "Traceback" not in err
    assert err.count("error: ") == 1


def test_under_dp_only_the_part_and_the_type_leave_a_node():
    line = "task t.py:task: loss(model, x, y) failed: IndexError: Target 9"
    e = UserCodeError(line, "t.py:task", "loss", "IndexError")
    assert e.public() == "task t.py:task: loss raised IndexError"
    assert "9" not in e.public()
