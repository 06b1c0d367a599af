"""TensorBoard event files beside metrics.jsonl (``[output] tensorboard = true``).

Every numeric field of a metrics record becomes a scalar under the same name as its key
(``test_accuracy``, ``fed_loss``, ``epsilon``, ``bytes_sent`` ...), at the record's version
when it has one, else at its round: the same numbers as metrics.jsonl, for TensorBoard's
side-by-side runs (``tensorboard --logdir runs/``). Written by torch.utils.tensorboard, which
needs the ``tensorboard`` package: ``pip install 'shoal[tensorboard]'``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError

#: The fields a record's step is read from, in order (the first one present is the x axis).
STEP_KEYS = ("version", "round")


def _scalar(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def step_of(record: dict[str, Any]) -> int | None:
    for key in STEP_KEYS:
        if _scalar(record.get(key)):
            return int(record[key])
    return None


class TensorBoardLog:
    """One event file per run folder; :meth:`write` takes the same records as metrics.jsonl."""

    def __init__(self, out_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch's module needs the tensorboard package itself
            raise ConfigError(
                "output.tensorboard = true needs the tensorboard package: pip install 'shoal[tensorboard]' "
                f"(or set output.tensorboard = false); importing it failed: {e}"
            ) from None
        self.dir = Path(out_dir)
        self.writer = SummaryWriter(log_dir=str(self.dir), flush_secs=5)
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        """Every numeric field as a scalar at the record's version or round (its index if it has neither)."""
        step = step_of(record)
        step = self.count if step is None else step
        self.count += 1
        for key, v in record.items():
            if isinstance(key, str) and key not in STEP_KEYS and _scalar(v):
                self.writer.add_scalar(key, v, global_step=step)
        self.writer.flush()  # a record is on disk when metrics.jsonl has it (a live TensorBoard sees it)

    def close(self) -> None:
        self.writer.close()
