"""`shoal report DIR...`: several runs side by side, as one PNG and one self-contained HTML file.

Each DIR is a run's output folder (`shoal simulate --out`, a server's ``server.out_dir``, a
federation run pulled with `shoal run pull`, a peer's ``--out``): its metrics.jsonl is read and
four panels drawn with every run's curve: accuracy (or the task's first evaluation metric when it
reports no accuracy) against the version (a peer's round), loss, bytes moved, and epsilon spent.
A panel no run has data for is left out. The HTML file embeds the PNG and a table of each run's final figures, so it
can be mailed or attached to a report as it is.
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from shoal.errors import ConfigError
from shoal.simulations.report import EVAL_PREFIXES, new_figure


@dataclass
class Run:
    label: str
    folder: Path
    records: list[dict[str, Any]]
    x: str  # "version" or "round"


@dataclass
class Panel:
    title: str
    ylabel: str
    curves: dict[str, list[tuple[float, float]]]  # run label -> points


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load_run(folder: str | Path, label: str | None = None) -> Run:
    """A run folder's metrics.jsonl (a ConfigError naming the folder if there is none, or it is not JSON lines)."""
    folder = Path(folder)
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{folder}: no metrics.jsonl (give the output folder of a run)")
    records = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            raise ConfigError(f"{path}:{i}: not a JSON line") from None
        if isinstance(rec, dict):
            records.append(rec)
    # the version when every line has one (a server's federated evaluations have no round), else the round
    if records and all(_num(r.get("version")) for r in records):
        x = "version"
    elif any(_num(r.get("round")) for r in records):
        x = "round"
    else:
        raise ConfigError(f"{path}: its lines have neither a round nor a version to draw against")
    return Run(label or folder.name or str(folder), folder, records, x)


def _points(run: Run, key: str) -> list[tuple[float, float]]:
    return [(r[run.x], r[key]) for r in run.records if _num(r.get(key)) and _num(r.get(run.x))]


#: evaluation figures drawn: the central test set, the clients' own (federated), a peer's own test data
REPORT_PREFIXES = (*EVAL_PREFIXES, "local_test_")


def _eval_key(runs: list[Run], *names: str) -> str | None:
    """The first of ``test_NAME`` / ``fed_NAME`` / ``local_test_NAME`` that a run reports."""
    for name in names:
        for prefix in REPORT_PREFIXES:
            if any(_points(r, prefix + name) for r in runs):
                return prefix + name
    return None


def _bytes(run: Run) -> list[tuple[float, float]]:
    """Bytes moved so far: the simulators' up + down totals, a peer's bytes sent, or the per-round sums."""
    pts = [
        (r[run.x], r["bytes_up_total"] + r["bytes_down_total"])
        for r in run.records
        if _num(r.get(run.x)) and _num(r.get("bytes_up_total")) and _num(r.get("bytes_down_total"))
    ]
    if pts:
        return pts
    pts = _points(run, "bytes_sent")
    if pts:
        return pts
    total, out = 0.0, []
    for r in run.records:
        if _num(r.get(run.x)) and (_num(r.get("bytes_up")) or _num(r.get("bytes_down"))):
            total += (r.get("bytes_up") or 0) + (r.get("bytes_down") or 0)
            out.append((r[run.x], total))
    return out


def _same_figure(run: Run, key: str) -> list[tuple[float, float]]:
    """``key``'s points, or the same figure on another test set the run reports (a federation's
    ``fed_accuracy`` beside a peer's ``local_test_accuracy``)."""
    pts = _points(run, key)
    if pts:
        return pts
    name = next((key.removeprefix(p) for p in sorted(REPORT_PREFIXES, key=len, reverse=True) if key.startswith(p)), key)
    return next((p for p in (_points(run, prefix + name) for prefix in REPORT_PREFIXES) if p), [])


def panels(runs: list[Run]) -> list[Panel]:
    """Accuracy (or the first evaluation metric), loss, bytes and epsilon: those some run has."""
    out = []
    first_metric = None
    for r in runs:
        for rec in r.records:
            first_metric = first_metric or next(
                (
                    k
                    for k, v in rec.items()
                    if k.startswith(REPORT_PREFIXES) and _num(v) and "num_examples" not in k and k != "fed_nodes"
                ),
                None,
            )
    acc = _eval_key(runs, "accuracy") or first_metric
    if acc:
        out.append(Panel(acc.replace("_", " "), acc, {r.label: _same_figure(r, acc) for r in runs}))
    loss = _eval_key(runs, "loss")
    if loss and loss != acc:
        out.append(Panel(loss.replace("_", " "), loss, {r.label: _same_figure(r, loss) for r in runs}))
    elif any(_points(r, "train_loss") for r in runs):
        out.append(Panel("train loss", "train_loss", {r.label: _points(r, "train_loss") for r in runs}))
    moved = {r.label: _bytes(r) for r in runs}
    if any(moved.values()):
        out.append(Panel("bytes moved (total)", "bytes", moved))
    eps = {r.label: _points(r, "epsilon") for r in runs}
    if any(eps.values()):
        out.append(Panel("epsilon spent", "epsilon", eps))
    return [p for p in out if any(p.curves.values())]


def draw(runs: list[Run], path: Path) -> list[Panel]:
    """The panels side by side in one PNG."""
    ps = panels(runs)
    if not ps:
        raise ConfigError("none of the runs has a metric to draw (their metrics.jsonl files are empty?)")
    cols = min(len(ps), 2)
    rows = math.ceil(len(ps) / cols)
    fig = new_figure((6.2 * cols, 4.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    xlabel = " / ".join(sorted({r.x for r in runs}))
    for ax, p in zip(axes.flat, ps):
        for label, pts in p.curves.items():
            if pts:
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="." if len(pts) < 60 else None, label=label)
        ax.set_title(p.title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(p.ylabel.replace("_", " "))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(ps) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return ps


def _final(run: Run, panel: Panel) -> str:
    pts = panel.curves.get(run.label) or []
    if not pts:
        return "–"
    v = pts[-1][1]
    return f"{v:,.0f}" if panel.ylabel == "bytes" else f"{v:.4g}"


def write_html(runs: list[Run], ps: list[Panel], png: Path, path: Path) -> None:
    """One file: the PNG inline and each run's last figures (every string escaped)."""
    image = base64.b64encode(png.read_bytes()).decode()
    esc = html.escape
    head = "".join(f"<th>{esc(p.title)} (last)</th>" for p in ps)
    rows = []
    for r in runs:
        last = r.records[-1] if r.records else {}
        cells = "".join(f"<td>{esc(_final(r, p))}</td>" for p in ps)
        rows.append(
            f"<tr><td>{esc(r.label)}</td><td><code>{esc(str(r.folder))}</code></td>"
            f"<td>{esc(str(last.get(r.x, '–')))}</td>{cells}</tr>"
        )
    path.write_text(
        "<!doctype html>\n<html lang='en'><head><meta charset='utf-8'><title>shoal report</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1d2430}"
        "table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:.3rem .7rem;text-align:left}"
        "img{max-width:100%}</style></head><body>\n"
        f"<h1>shoal report: {len(runs)} runs</h1>\n"
        f"<table><thead><tr><th>run</th><th>folder</th><th>last round / version</th>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>\n"
        f"<p><img alt='curves of the runs' src='data:image/png;base64,{image}'></p>\n</body></html>\n"
    )


def report(folders: list[Path], out: Path) -> tuple[Path, Path]:
    """``out``.png and ``out``.html for the runs in ``folders``."""
    if not folders:
        raise ConfigError("give at least one run folder")
    labels = [f.name or str(f) for f in folders]
    if len(set(labels)) < len(labels):  # two runs named alike: tell them apart by their paths
        labels = [str(f) for f in folders]
    runs = [load_run(f, label) for f, label in zip(folders, labels)]
    out.parent.mkdir(parents=True, exist_ok=True)
    png, page = out.with_suffix(".png"), out.with_suffix(".html")
    ps = draw(runs, png)
    write_html(runs, ps, png, page)
    return png, page
