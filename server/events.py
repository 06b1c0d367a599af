"""What the aggregator's state machine hands out to be made durable (server/store.py writes them,
in the order given): metrics lines, checkpoints, the privacy ledger; and what a restart reads back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Record:
    """A line of metrics.jsonl (a new version, a federated evaluation, a privacy event)."""

    fields: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint:
    """The state a restart resumes from; written before the version's Record."""

    version: int
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]


@dataclass(frozen=True)
class PrivacyLedger:
    """Every round charged so far; durable before anything of a charged round is released."""

    state: dict[str, Any]


Event = Record | Checkpoint | PrivacyLedger


@dataclass(frozen=True)
class Restored:
    """What an earlier run left (read by server/store.py): its last checkpoint and privacy ledger,
    and the elapsed_s of its last record (a resumed run's clock goes on from there, not from 0)."""

    checkpoint: tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None = None
    ledger: dict[str, Any] | None = None
    elapsed_s: float = 0.0


def split_tensors(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``{"__tensor__": name}``, tensors into ``tensors``
    (the global model is stored as ``params``, the name a reader looks for)."""
    if isinstance(obj, torch.Tensor):
        name = "params" if path == "rounds.global_params" else path
        tensors[name] = obj
        return {"__tensor__": name}
    if isinstance(obj, dict):
        return {str(k): split_tensors(v, f"{path}.{k}", tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [split_tensors(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [join_tensors(v, tensors) for v in obj]
    return obj
