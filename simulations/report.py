"""PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_curves(records: list[dict[str, Any]], out_dir: str | Path, x: str = "round", title: str = "") -> list[Path]:
    """accuracy.png and loss.png of the test metrics against ``x``."""
    out = Path(out_dir)
    paths = []
    for key, ylabel, fname in (("test_accuracy", "test accuracy", "accuracy.png"), ("test_loss", "test loss", "loss.png")):
        pts = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        paths.append(out / fname)
    return paths


def plot_compare(series: dict[str, list[tuple[float, float]]], path: str | Path, xlabel: str, ylabel: str, title: str = "") -> Path:
    """Several labelled curves on one axis (for docs: FedAvg vs FedProx, sync vs async...)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
