"""What a node says of its training: whether a trained update may leave it (:func:`diverged`) and
its metrics as one log line (:func:`figures_line`)."""

from __future__ import annotations

import logging
import math

import torch

from shoal.task import Task, TaskError
from shoal.update import Update

from .training import summarize_means

log = logging.getLogger(__name__)


def diverged(update: Update) -> str | None:
    """What is wrong with a trained update that must not be uploaded (None if nothing): a
    non-finite training loss, or NaN/Inf entries in the update itself."""
    loss = update.metrics.get("train_loss")
    if loss is not None and not math.isfinite(loss):
        return f"loss {loss}"
    delta = update.delta
    if delta.numel() and all(math.isfinite(float(v)) for v in torch.aminmax(delta)):  # one pass, no temporary
        return None
    bad = int((~torch.isfinite(delta)).sum())
    if bad:
        return f"the update has {bad} NaN/Inf entries of {delta.numel()}"
    return None


def figures_line(task: Task, means: dict[str, float]) -> str:
    """The task's summarized figures of raw means, for a log line: what ``summarize`` derives
    (R², macro-F1, perplexity) first, then loss and accuracy; the raw parts a task derives them
    from (sums of squares, per-class counts) only when it derives nothing."""
    try:
        summary = summarize_means(task, means)
    except TaskError as e:
        log.warning("%s; the raw means are shown", e)
        summary = dict(means)
    derived = {k: v for k, v in summary.items() if k not in means or means[k] != v}
    shown: dict[str, float] = summary
    if derived:
        shown = {**derived, **{k: summary[k] for k in ("loss", "accuracy") if k in summary}}
    return ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) or "no metrics"
