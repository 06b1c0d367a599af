"""A node's private data on disk: one safetensors file per client with ``x`` and ``y``.

`shoal data split` (shoal/shard_split.py) writes the very split the simulator makes (load_federated with the
same data config, number of clients and seed), one file per simulated client id, so a
deployment of real nodes can be compared number for number with `shoal simulate`.
With a task (``--task`` / ``[task] app``) it writes each client's training data of
``task.simulation_data(num_clients, seed)`` (and its own test data as ``test_x`` /
``test_y`` when the task gives some), provided the task's data are tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import DataError

SHARD_FORMAT = "shoal-shard/1"


def client_id(i: int) -> str:
    """The id of the i-th client of a split (the simulator names its clients the same)."""
    return f"client-{i:05d}"


@dataclass
class Shard:
    client_id: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    test_x: torch.Tensor | None = None  # the client's own test data, when the split had some
    test_y: torch.Tensor | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


def load_shard(path: str | Path, check_dtypes: bool = True) -> Shard:
    """Read a shard file, or the only ``*.safetensors`` file in a folder. ``check_dtypes``:
    x must be float32 and y int64 (the built-in models' classification data); a task
    whose tensors are of other types (token ids, regression targets) passes False."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if len(files) != 1:
            raise DataError(
                f"--data {str(p)!r}: expected exactly one *.safetensors shard in the folder, found {len(files)}"
            )
        p = files[0]
    if not p.is_file():
        raise DataError(f"--data {str(p)!r} not found: make shards with `shoal data split --config F --out DIR`")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            x, y = f.get_tensor("x"), f.get_tensor("y")
            keys = set(f.keys())
            test_x = f.get_tensor("test_x") if "test_x" in keys else None
            test_y = f.get_tensor("test_y") if "test_y" in keys else None
    except Exception as e:
        raise DataError(f"{p}: not a shard file ({e})") from None
    if meta.get("format") != SHARD_FORMAT:
        raise DataError(f"{p}: format {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
    if x.shape[0] != y.shape[0] or len(y) == 0:
        raise DataError(f"{p}: x and y must have the same (non-zero) number of rows")
    if check_dtypes and (x.dtype != torch.float32 or y.dtype != torch.int64):
        raise DataError(f"{p}: x must be float32 and y int64 with the same (non-zero) number of rows")
    one_missing = (test_x is None) != (test_y is None)
    if one_missing or (test_x is not None and test_y is not None and test_x.shape[0] != test_y.shape[0]):
        raise DataError(f"{p}: test_x and test_y must both be there, with the same number of rows")
    return Shard(meta.get("client_id", p.stem), x, y, int(json.loads(meta.get("num_classes", "0"))), test_x, test_y)
