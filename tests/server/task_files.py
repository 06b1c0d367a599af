"""A user's task file, as a user would write it, for the deploy tests to put in a folder
outside the repository: an MLP regression on 4 features, each node's data in a .pt file."""

from __future__ import annotations

from pathlib import Path

import torch

REGRESSION_TASK = '''
"""MLP regression: MSE loss, MSE/MAE metrics; a node's --data is a .pt file of tensors."""
import os

import torch
from torch import nn

from shoal.task import LocalData, Task


def _mark(part):  # lets the tests see which process called which part
    folder = os.environ.get("REGTASK_MARKS")
    if folder:
        open(os.path.join(folder, f"{part}-{os.getpid()}"), "w").close()


class Regression(Task):
    def __init__(self, hidden=8, central=False):
        self.hidden, self.central = hidden, central

    def model(self):
        return nn.Sequential(nn.Linear(4, self.hidden), nn.Tanh(), nn.Linear(self.hidden, 1))

    def loss(self, model, x, y):
        return nn.functional.mse_loss(model(x).squeeze(-1), y)

    def metrics(self, model, x, y):
        err = model(x).squeeze(-1) - y
        return {"mse": (err ** 2).mean(), "mae": err.abs().mean()}

    def local_data(self, path):
        _mark("local_data")
        d = torch.load(path)
        return LocalData(train=(d["x"], d["y"]), test=(d["test_x"], d["test_y"]))

    def central_test_data(self):
        _mark("central_test_data")
        if not self.central:
            return None
        g = torch.Generator().manual_seed(99)
        x = torch.randn(64, 4, generator=g)
        return x, x @ torch.tensor([1.0, -2.0, 0.5, 3.0])


def wide():  # another model (another parameter spec)
    return Regression(hidden=16)
'''

BROKEN_TASK = "import shoal_no_such_module_for_tests\n"


def write_task(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "regtask.py"
    path.write_text(REGRESSION_TASK)
    return path


def write_node_data(path: Path, seed: int, n: int = 64, n_test: int = 20) -> Path:
    """One node's train and test tensors: y = x . w + noise, a node-specific input shift."""
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor([1.0, -2.0, 0.5, 3.0])

    def make(k):
        x = torch.randn(k, 4, generator=g) + 0.3 * seed
        return x, x @ w + 0.1 * torch.randn(k, generator=g)

    (x, y), (tx, ty) = make(n), make(n_test)
    torch.save({"x": x, "y": y, "test_x": tx, "test_y": ty}, path)
    return path
