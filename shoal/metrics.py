"""Run outputs every mode shares: metrics.jsonl (one JSON object per line) and summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def json_safe(v: Any) -> Any:
    """JSON has no NaN/Inf: write them as null rather than invalid JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


class MetricsLog:
    """Appends one record per evaluated round to ``metrics.jsonl`` and keeps them in memory;
    with ``tensorboard``, the same numbers also go to TensorBoard event files in the same folder."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = False):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.path.write_text("")
        self.records: list[dict[str, Any]] = []
        self.tensorboard = None
        if tensorboard:
            from shoal.tensorboard import TensorBoardLog

            self.tensorboard = TensorBoardLog(self.dir)

    def write(self, record: dict[str, Any]) -> None:
        record = json_safe(record)
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()

    def summary(self, summary: dict[str, Any]) -> Path:
        path = self.dir / "summary.json"
        path.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
        return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
