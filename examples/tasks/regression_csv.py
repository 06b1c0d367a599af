"""Your own task, example 2: regression on tabular data, each node reading its own CSV file.

A small MLP predicts a number from ``num_features`` columns, trained with the mean squared
error. Think of hospitals that each hold a table of patients: the same columns everywhere,
but each site's population differs (here: every client's features are shifted and scaled
differently, a non-IID "feature shift").

Run it (from the repository root)::

    shoal simulate --task examples/tasks/regression_csv.py:task --set simulation.rounds=20
    python examples/tasks/regression_csv.py write-csvs /tmp/nodes --nodes 3   # one folder per node
    shoal client ... --task examples/tasks/regression_csv.py:task --data /tmp/nodes/node-0

What it shows of the task API (shoal/task.py, docs/tasks.md):

- ``loss()``: MSE instead of the default cross-entropy;
- ``metrics()`` + ``summarize()``: mse and R², computed soundly from example-weighted means
  (see ``metrics``);
- ``simulation_data()``: synthetic clients generated from the seed, each with its own test
  rows and a central test set (all clients' test rows);
- ``local_data(path)``: a node's own CSV file.

Task arguments (``[task.args]``): ``num_features`` (8), ``hidden`` (32), ``target`` (the
target column's name, "y"), ``features`` (the feature columns' names in the model's order;
default: every other column, in file order), ``test_fraction`` (0.2, used when a node has no
test.csv), ``rows`` (mean training rows per simulated client, 200).

``--data PATH`` format (``local_data``):

- a folder holding ``train.csv`` (required) and ``test.csv`` (optional); or a ``.csv`` file,
  with a ``test.csv`` beside it used as its test data when present;
- comma-separated, UTF-8, a header row naming the columns, then one row per example:
  ``num_features`` numeric feature columns and the numeric target column (``target``);
- without a test file, a fixed random ``test_fraction`` of the rows is held out as test data.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shoal.task import LocalData, SimulationData, Task, TaskError


class Regression(Task):
    def __init__(
        self,
        num_features: int = 8,
        hidden: int = 32,
        target: str = "y",
        features: list[str] | None = None,
        test_fraction: float = 0.2,
        rows: int = 200,
    ):
        if features is not None and len(features) != num_features:
            raise TaskError(f"regression: features names {len(features)} columns but num_features = {num_features}")
        if not 0 <= test_fraction < 1:
            raise TaskError(f"regression: test_fraction = {test_fraction} must be in [0, 1)")
        self.num_features, self.hidden, self.target = num_features, hidden, target
        self.features, self.test_fraction, self.rows = features, test_fraction, rows

    def describe(self) -> str:
        return f"regression MLP ({self.num_features} features)"

    def model(self) -> nn.Module:
        return nn.Sequential(
            nn.Linear(self.num_features, self.hidden), nn.ReLU(), nn.Linear(self.hidden, 1), nn.Flatten(0)
        )  # (B, 1) -> (B,): one prediction per row

    def loss(self, model, x, y):
        return F.mse_loss(model(x).float(), y)

    def metrics(self, model, x, y):
        # R² = 1 - MSE / Var(y) is not a mean over examples, so averaging per-batch (or
        # per-client) R² values would not give the R² of the whole test set. Instead every
        # metric here is a plain per-example mean: shoal's example-weighted average of them is
        # exactly the mean over all test rows, and summarize() derives R² from those means
        # with Var(y) = E[y²] - E[y]².
        pred = model(x).float()
        return {"mse": F.mse_loss(pred, y), "target_mean": y.mean(), "target_sq_mean": (y * y).mean()}

    def summarize(self, means):
        var = means["target_sq_mean"] - means["target_mean"] ** 2
        r2 = 1.0 - means["mse"] / var if var > 0 else float("nan")
        return {"mse": means["mse"], "r2": r2, **means}

    # --- data for `shoal simulate`: generated from the seed -----------------------------

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        train, tests = [], []
        for _c, (x, y) in enumerate(generate_clients(num_clients, self.num_features, self.rows, seed)):
            n_test = max(1, int(len(y) * self.test_fraction)) if self.test_fraction else 0
            train.append((x[n_test:], y[n_test:]))
            tests.append((x[:n_test], y[:n_test]) if n_test else None)
        held = [t for t in tests if t is not None]
        central = (torch.cat([t[0] for t in held]), torch.cat([t[1] for t in held])) if held else None
        return SimulationData(train=train, test=central, client_test=tests)

    # --- data for a deployed node: its own CSV file -------------------------------------

    def local_data(self, path: Path) -> LocalData:
        path = Path(path)
        if path.is_dir():
            train_file, test_file = path / "train.csv", path / "test.csv"
        else:
            train_file, test_file = path, path.with_name("test.csv")
        if not train_file.is_file():
            raise TaskError(
                f"regression: {str(train_file)!r} not found; --data is a folder with train.csv "
                "(and optionally test.csv) or a .csv file"
            )
        x, y = self.read_csv(train_file)
        if test_file.is_file() and test_file.resolve() != train_file.resolve():
            return LocalData(train=(x, y), test=self.read_csv(test_file))
        n_test = int(len(y) * self.test_fraction)
        if n_test == 0:
            return LocalData(train=(x, y))
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))  # the same split every run
        return LocalData(train=(x[perm[n_test:]], y[perm[n_test:]]), test=(x[perm[:n_test]], y[perm[:n_test]]))

    def read_csv(self, file: Path) -> tuple[torch.Tensor, torch.Tensor]:
        """Header + numeric rows -> x (N, num_features) float32, y (N,) float32; one clear error otherwise."""
        try:
            with open(file, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise TaskError(f"regression: cannot read {file} as CSV: {e}") from None
        rows = [r for r in rows if any(cell.strip() for cell in r)]  # blank lines are not rows
        if len(rows) < 2:
            raise TaskError(f"regression: {file} needs a header row and at least one data row")
        header = [h.strip() for h in rows[0]]
        if self.target not in header:
            raise TaskError(
                f"regression: {file} has no target column {self.target!r} (columns: {', '.join(header)}); "
                "set the task arg target"
            )
        names = self.features or [h for h in header if h != self.target]
        missing = [n for n in names if n not in header]
        if missing:
            raise TaskError(f"regression: {file} lacks feature columns {', '.join(missing)}")
        if len(names) != self.num_features:
            raise TaskError(
                f"regression: {file} has {len(names)} feature columns ({', '.join(names)}), the model "
                f"takes num_features = {self.num_features}"
            )
        cols = [header.index(n) for n in names] + [header.index(self.target)]
        values = []
        for line, row in enumerate(rows[1:], start=2):
            if len(row) != len(header):
                raise TaskError(f"regression: {file} line {line} has {len(row)} fields, the header has {len(header)}")
            try:
                values.append([float(row[i]) for i in cols])
            except ValueError:
                bad = next(i for i in cols if not _is_number(row[i]))
                raise TaskError(
                    f"regression: {file} line {line}, column {header[bad]!r}: {row[bad]!r} is not a number"
                ) from None
        t = torch.tensor(values, dtype=torch.float32)
        if not torch.isfinite(t).all():
            raise TaskError(f"regression: {file} holds inf or nan values; every value must be a finite number")
        return t[:, :-1].contiguous(), t[:, -1].contiguous()


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def generate_clients(
    num_clients: int, num_features: int, rows: int, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic non-IID tables: one target function for all, each client's features shifted and scaled.

    y = x·w + 0.5 sin(2 x_0) + noise, where every client draws x around its own mean and with
    its own spread, and holds between rows/2 and 3 rows/2 rows.
    """
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(num_features, generator=g) / math.sqrt(num_features)
    clients = []
    for _ in range(num_clients):
        n = int(rows * (0.5 + torch.rand((), generator=g)))
        shift = torch.randn(num_features, generator=g)
        scale = 0.5 + torch.rand(num_features, generator=g)
        x = shift + scale * torch.randn(n, num_features, generator=g)
        y = x @ w + 0.5 * torch.sin(2 * x[:, 0]) + 0.1 * torch.randn(n, generator=g)
        clients.append((x, y))
    return clients


task = Regression


def write_csvs(
    out: Path, nodes: int, seed: int = 0, num_features: int = 8, rows: int = 200, test_fraction: float = 0.2
) -> list[Path]:
    """``out/node-<i>/train.csv`` and ``test.csv``: the simulation's clients as files, for --data."""
    data = Regression(num_features=num_features, rows=rows, test_fraction=test_fraction).simulation_data(nodes, seed)
    header = [f"x{j}" for j in range(num_features)] + ["y"]
    folders = []
    for i, (train, test) in enumerate(zip(data.train, data.client_test or [None] * nodes)):
        folder = out / f"node-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, part in (("train.csv", train), ("test.csv", test)):
            if part is None:
                continue
            with open(folder / name, "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                w.writerow(header)
                for xr, yr in zip(part[0].tolist(), part[1].tolist()):
                    w.writerow([f"{v:.6g}" for v in xr] + [f"{yr:.6g}"])
        folders.append(folder)
    return folders


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write per-node CSV files for shoal client/peer --data.")
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write-csvs", help="DIR/node-<i>/train.csv and test.csv")
    w.add_argument("out", type=Path)
    w.add_argument("--nodes", type=int, default=3)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--num-features", type=int, default=8)
    w.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    for folder in write_csvs(args.out, args.nodes, args.seed, args.num_features, args.rows):
        print(folder)
