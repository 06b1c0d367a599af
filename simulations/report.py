"""PNG plots of a run's metrics (matplotlib's object API: no display and no global backend switch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A figure drawn off-screen through matplotlib's object API: no pyplot state, and the
    backend of a program that imports shoal is left alone (its own windows keep working)."""
    return Figure(figsize=figsize)


EVAL_PREFIXES = ("test_", "fed_")  # central test set, clients' own test data (federated evaluation)


def final_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """The evaluation figures of one metrics record (``test_*`` and ``fed_*``)."""
    return {k: v for k, v in record.items() if k.startswith(EVAL_PREFIXES) and isinstance(v, (int, float))}


def plot_curves(records: list[dict[str, Any]], out_dir: str | Path, x: str = "round", title: str = "") -> list[Path]:
    """One PNG per evaluation metric against ``x`` (accuracy.png, loss.png, ...): the central
    test set's curve and, when clients evaluate on their own data, the federated curve."""
    out = Path(out_dir)
    names: list[str] = []
    for r in records:
        for k in final_metrics(r):
            name = k.split("_", 1)[1].removeprefix("personal_")  # fed_personal_*: on the fed_ figure
            if name != "num_examples" and name not in names:
                names.append(name)
    paths = []
    for name in names:
        fig = new_figure((6, 4))
        ax = fig.subplots()
        for prefix, label in (
            ("test_", "central test set"),
            ("fed_", "clients' test data"),
            ("fed_personal_", "clients' own models, their test data"),
        ):
            key = prefix + name
            pts = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 60 else None, label=label)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(name.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=120)
        paths.append(out / f"{name}.png")
    return paths


def plot_compare(
    series: dict[str, list[tuple[float, float]]], path: str | Path, xlabel: str, ylabel: str, title: str = ""
) -> Path:
    """Several labelled curves on one axis (for docs: FedAvg vs FedProx, sync vs async...)."""
    fig = new_figure((6.5, 4.2))
    ax = fig.subplots()
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
    return Path(path)
