"""`shoal data split`: write the simulator's split of a config as one shard file per client.

The format and its reader are shoal/shards.py (a node reads its shard without importing the
simulator or the assembly); this writer builds the split the way the simulator does.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from .assembly import task_from_config
from .config import Config
from .datasets import load_federated
from .shards import SHARD_FORMAT, client_id
from .simulations.client_data import load_simulation_data  # the simulator's checks of the split
from .task import TaskError, as_tensors, task_name
from .tensor_file import save_file


def write_shards(cfg: Config, out_dir: str | Path) -> list[Path]:
    """Write one shard per client of the simulator's split of ``cfg`` (seed = simulation.seed)."""
    if cfg.task.app:
        return write_task_shards(cfg, out_dir)
    data = load_federated(cfg.data, cfg.simulation.num_clients, cfg.simulation.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, idx in enumerate(data.client_indices):
        ix = torch.as_tensor(idx, dtype=torch.long)
        meta = {
            "format": SHARD_FORMAT,
            "client_id": client_id(i),
            "dataset": data.name,
            "num_classes": str(data.num_classes),
        }
        path = out / f"{client_id(i)}.safetensors"
        save_file({"x": data.train.x[ix].contiguous(), "y": data.train.y[ix].contiguous()}, str(path), metadata=meta)
        paths.append(path)
    return paths


def write_task_shards(cfg: Config, out_dir: str | Path) -> list[Path]:
    """One shard per client of the task's simulation split: its training tensors (x, y) and,
    when it has its own test data, ``test_x`` / ``test_y``. Datasets that are not tensors
    are refused: a task with such data reads its own format in ``local_data``."""
    task = task_from_config(cfg)
    data = load_simulation_data(task, cfg)
    ids = (
        [str(c) for c in data.client_ids]
        if data.client_ids is not None
        else [client_id(i) for i in range(len(data.train))]
    )
    tests = data.client_test if data.client_test is not None else [None] * len(ids)
    files: list[tuple[str, dict[str, torch.Tensor]]] = []
    for i, (cid, train, test) in enumerate(zip(ids, data.train, tests)):
        tensors: dict[str, torch.Tensor] = {}
        for what, part, keys in (("train", train, ("x", "y")), ("client_test", test, ("test_x", "test_y"))):
            if part is None:
                continue
            pair = as_tensors(part)
            if pair is None:
                raise TaskError(
                    f"task {task_name(task)}: simulation_data().{what}[{i}] is a {type(part).__name__}, not tensors; "
                    "shoal data split writes (x, y) tensors only: give each node its own files and read them "
                    "in the task's local_data(path)"
                )
            tensors.update({keys[0]: pair[0].detach().cpu().contiguous(), keys[1]: pair[1].detach().cpu().contiguous()})
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", cid):
            raise TaskError(
                f"task {task_name(task)}: client id {cid!r} cannot name a shard file "
                "(use letters, digits, '.', '_' and '-')"
            )
        files.append((cid, tensors))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    num_classes = getattr(task, "num_classes", None)
    for cid, tensors in files:
        meta = {
            "format": SHARD_FORMAT,
            "client_id": cid,
            "dataset": task_name(task),
            "num_classes": str(int(num_classes or 0)),
        }
        path = out / f"{cid}.safetensors"
        save_file(tensors, str(path), metadata=meta)
        paths.append(path)
    return paths
