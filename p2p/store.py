"""What a gossip peer keeps on disk in its ``--out`` folder, and nothing else writes there.

- ``model.safetensors``: the peer's model as named tensors (one per entry of the task's
  state_dict, like ``shoal run pull`` gives), with ``version``, ``age`` and ``spec_hash`` in its
  metadata, so ``model.load_state_dict(safetensors.torch.load_file(path))`` takes it; written
  whole to a temporary file, then renamed;
- ``metrics.jsonl`` (and TensorBoard files with ``output.tensorboard``): one record per evaluation;
- ``privacy_ledger.json``: under local DP, the peer's spent trainings, so a restarted peer goes
  on from its epsilon (client privacy state owns the format; this module only names the path).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shoal.metrics import MetricsLog
from shoal.params import ParamSpec
from shoal.tensor_file import save_file

MODEL_FILE = "model.safetensors"
LEDGER_FILE = "privacy_ledger.json"


class PeerStore:
    """The peer's output folder (``None``: the peer writes nothing)."""

    def __init__(self, out_dir: Path | None, tensorboard: bool = False):
        self.dir = out_dir
        self.metrics = MetricsLog(out_dir, tensorboard) if out_dir is not None else None

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.metrics.records if self.metrics is not None else []

    @property
    def ledger_path(self) -> Path | None:
        return self.dir / LEDGER_FILE if self.dir is not None else None

    def write_metrics(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def save_model(self, params: torch.Tensor, spec: ParamSpec, version: int, age: int) -> Path | None:
        """``params`` (the flat buffer) as named tensors in ``model.safetensors``; its path."""
        if self.dir is None:
            return None
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / MODEL_FILE
        tmp = path.with_suffix(".tmp")
        flat = params.detach().to("cpu", torch.float32).clone()
        tensors = {k: v.contiguous() for k, v in spec.views(flat).items()}
        save_file(tensors, str(tmp), metadata={"version": str(version), "age": str(age), "spec_hash": spec.hash})
        tmp.replace(path)
        return path
