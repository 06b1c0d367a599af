"""A node's private data on disk: one safetensors file per client with ``x`` and ``y``.

`shoal data split` writes the very split the simulator makes (load_federated with the
same data config, number of clients and seed), one file per simulated client id, so a
deployment of real nodes can be compared number for number with `shoal simulate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import Config
from .datasets import load_federated
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

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])


def write_shards(cfg: Config, out_dir: str | Path) -> list[Path]:
    """Write one shard per client of the simulator's split of ``cfg`` (seed = simulation.seed)."""
    data = load_federated(cfg.data, cfg.simulation.num_clients, cfg.simulation.seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, idx in enumerate(data.client_indices):
        ix = torch.as_tensor(idx, dtype=torch.long)
        meta = {"format": SHARD_FORMAT, "client_id": client_id(i), "dataset": data.name,
                "num_classes": str(data.num_classes)}
        path = out / f"{client_id(i)}.safetensors"
        save_file({"x": data.train.x[ix].contiguous(), "y": data.train.y[ix].contiguous()}, str(path), metadata=meta)
        paths.append(path)
    return paths


def load_shard(path: str | Path) -> Shard:
    """Read a shard file, or the only ``*.safetensors`` file in a folder."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if len(files) != 1:
            raise DataError(f"--data {str(p)!r}: expected exactly one *.safetensors shard in the folder, found {len(files)}")
        p = files[0]
    if not p.is_file():
        raise DataError(f"--data {str(p)!r} not found: make shards with `shoal data split --config F --out DIR`")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            x, y = f.get_tensor("x"), f.get_tensor("y")
    except Exception as e:
        raise DataError(f"{p}: not a shard file ({e})") from None
    if meta.get("format") != SHARD_FORMAT:
        raise DataError(f"{p}: format {meta.get('format')!r}, expected {SHARD_FORMAT!r}")
    if x.dtype != torch.float32 or y.dtype != torch.int64 or x.shape[0] != y.shape[0] or len(y) == 0:
        raise DataError(f"{p}: x must be float32 and y int64 with the same (non-zero) number of rows")
    return Shard(meta.get("client_id", p.stem), x, y, int(json.loads(meta.get("num_classes", "0"))))
