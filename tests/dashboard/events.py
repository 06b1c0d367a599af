"""Read TensorBoard event files back with tensorboard's own EventAccumulator and compare
them with metrics.jsonl in the same folder (shared by the engines' tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shoal.metrics import read_jsonl
from shoal.tensorboard import STEP_KEYS, step_of


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the folder's event files: [(step, value), ...] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_events_match_metrics(folder: Path, must_have: tuple[str, ...] = ()) -> dict[str, list]:
    """The event files hold exactly metrics.jsonl's numbers: the same tags as its keys, each
    value at the record's version (or round), as float32 (TensorBoard's scalar type)."""
    records = read_jsonl(folder / "metrics.jsonl")
    assert records, f"no metrics in {folder}"
    expected: dict[str, list[tuple[int, float]]] = {}
    for i, rec in enumerate(records):
        step = step_of(rec)
        for key, v in rec.items():
            if key in STEP_KEYS or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            expected.setdefault(key, []).append((i if step is None else step, float(np.float32(v))))
    got = scalars(folder)
    assert set(got) == set(expected), (sorted(set(got) ^ set(expected)), sorted(got))
    for tag, points in expected.items():
        assert got[tag] == points, tag
    for tag in must_have:
        assert tag in got, (tag, sorted(got))
    return got
