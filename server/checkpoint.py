"""Atomic checkpoints of the server after each new global version.

One safetensors file per version, ``ckpt-<version>.safetensors``: the model (tensor
``params``), the strategy's tensors (``opt.*``) and the rest of the state as JSON in
the metadata (round, version, optimizer scalars; client selection and task seeds are
derived from (seed, round), so no RNG state beyond those two is needed). It is written
to a temporary file, fsynced, renamed over the final name and the folder fsynced, so a
crash leaves either the old or the new checkpoint, never a torn one.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

log = logging.getLogger(__name__)

FORMAT = "shoal-ckpt/1"
_NAME = re.compile(r"^ckpt-(\d{8})\.safetensors$")


def save_checkpoint(
    directory: str | Path, version: int, tensors: dict[str, torch.Tensor], state: dict[str, Any], keep: int = 3
) -> Path:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{version:08d}.safetensors"
    tmp = d / f".{final.name}.tmp"
    body = save(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        metadata={"format": FORMAT, "state": json.dumps(state)},
    )
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    for old in sorted(p for p in d.iterdir() if _NAME.match(p.name))[:-keep]:
        old.unlink()
    return final


def write_durably(path: str | Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, also after a crash: a temporary file,
    fsynced, renamed over ``path``, the folder fsynced (the privacy ledger)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str | Path) -> Path | None:
    d = Path(directory)
    if not d.is_dir():
        return None
    found = sorted(p for p in d.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return tensors, json.loads(meta["state"])
