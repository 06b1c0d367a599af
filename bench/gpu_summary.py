"""The GPU suite's summary: each section's figures beside the previous ones, with new / previous
and the share of the card's peak where a FLOP count is defined.

bench/gpu_suite.sh calls it at the end of a run. It reads, from the suite's output folder, the
sections that ran (``sections.tsv``: name, how it ended, seconds) and each section's log, in
which the benches print one ``RESULT {json}`` line per measured cell; the previous figures come
from ``bench/gpu_previous.json``. The peak is the data-sheet figure of the card found
(bench/sim_throughput.py's table); a card not in that table gets "peak unknown", never a guess.

    python bench/gpu_summary.py --out /tmp/gpu_suite --card "NVIDIA H200"
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_throughput import card_peak  # noqa: E402 - bench/ is not a package

PREVIOUS = Path(__file__).resolve().parent / "gpu_previous.json"


@dataclass
class Figure:
    """One measured figure: ``value`` in ``unit``; ``better`` says which direction is an improvement."""

    name: str
    value: float | None
    unit: str
    better: str
    measured: bool = True  # False: a previous figure this run did not give


def results(log: Path) -> list[dict]:
    """The ``RESULT {json}`` lines of a section's log (a line cut short by a timeout is skipped)."""
    out = []
    if not log.exists():
        return out
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("RESULT "):
            try:
                out.append(json.loads(line[len("RESULT ") :]))
            except json.JSONDecodeError:
                continue
    return out


def share(flop: float | None, seconds: float, peak: float | None) -> float | None:
    """Achieved FLOP/s over the peak (TFLOP/s), or None when either is not known."""
    if not flop or not peak or seconds <= 0:
        return None
    return flop / seconds / (peak * 1e12)


def batched_figures(records: list[dict], card: str) -> list[Figure]:
    """Per model at its largest K: seconds per round, the speed-up over one by one, the share of peak."""
    largest: dict[str, dict] = {}
    for r in records:
        if r.get("bench") != "sim_throughput":
            continue
        model = r["model"] if r.get("conv", "grouped") == "grouped" else f"{r['model']}_{r['conv']}"
        if r["k"] >= largest.get(model, {"k": -1})["k"]:
            largest[model] = r
    out = []
    for model, r in largest.items():
        tag = f"{model}_{r['k']}"
        peak = card_peak(card, r["precision"])
        out += [
            Figure(f"{tag}_s_per_round", r["s_per_round"], "s", "lower"),
            Figure(f"{tag}_x_one_by_one", r["batched_over_seq"], "x", "higher"),
            Figure(f"{tag}_of_peak", share(r["flop_per_round"], r["s_per_round"], peak), "of peak", "higher"),
        ]
        if r.get("eager_s_per_round"):  # the same round without CUDA graphs, timed beside it
            out.append(Figure(f"{tag}_x_eager", r["eager_s_per_round"] / r["s_per_round"], "x", "higher"))
    return out


def dp_figures(records: list[dict], card: str) -> list[Figure]:
    """Per model: ms per step of plain SGD and DP-SGD (seeded and CSPRNG noise), and each one's share of peak."""
    out = []
    peak = card_peak(card, "fp32")
    for r in records:
        if r.get("bench") != "dp_sgd":
            continue
        for way, flop in (
            ("plain", r.get("plain_flop_per_step")),
            ("seeded", r.get("dp_flop_per_step")),
            ("csprng", r.get("dp_flop_per_step")),
        ):
            ms = r[f"{way}_ms_per_step"]
            out.append(Figure(f"{r['model']}_{way}_ms_per_step", ms, "ms", "lower"))
            out.append(Figure(f"{r['model']}_{way}_of_peak", share(flop, ms / 1e3, peak), "of peak", "higher"))
    return out


def niid_figures(records: list[dict]) -> list[Figure]:
    """NIID-Bench's setting (10 clients, E = 10, B = 64): seconds per round with CUDA graphs, and the
    same run's eager seconds over them."""
    out = []
    runs = {
        (r["split"], r["algorithm"], r["cuda_graphs"]): r["s_per_round"]
        for r in records
        if r.get("bench") == "niid_round"
    }
    for (split, algorithm, graphs), sec in runs.items():
        if not graphs:
            continue
        out.append(Figure(f"{algorithm}_{split}_s_per_round", sec, "s", "lower"))
        eager = runs.get((split, algorithm, False))
        if sec and eager:
            out.append(Figure(f"{algorithm}_{split}_x_eager", eager / sec, "x", "higher"))
    return out


def layer_figures(records: list[dict]) -> list[Figure]:
    """bench/batched_layers.py: each case's batched seconds per round and speed-up over one by one."""
    out = []
    for r in records:
        if r.get("bench") == "batched_layers":
            out.append(Figure(f"{r['case']}_s_per_round", r["s_per_round"], "s", "lower"))
            out.append(Figure(f"{r['case']}_x_one_by_one", r["x_one_by_one"], "x", "higher"))
    return out


def ray_figures(records: list[dict]) -> list[Figure]:
    return [
        Figure(f"{r['engine']}_x_inprocess", r["x_inprocess"], "x", "lower")
        for r in records
        if r.get("bench") == "engines" and r["engine"] != "inprocess"
    ]


def node_figures(records: list[dict]) -> list[Figure]:
    return [Figure("cpu_over_cuda", r["cpu_over_cuda"], "x", "higher") for r in records if r.get("bench") == "gpu_node"]


def test_figures(log: Path) -> list[Figure]:
    """pytest's last count line: passed and failed tests."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = re.findall(r"(\d+) (passed|failed)", text.splitlines()[-1] if text.strip() else "")
    counts = {kind: float(n) for n, kind in found}
    return [Figure(kind, counts[kind], "tests", "higher" if kind == "passed" else "lower") for kind in counts]


def section_figures(name: str, log: Path, card: str) -> list[Figure]:
    records = results(log)
    if name.startswith("batched"):
        return batched_figures(records, card)
    if name == "dp_sgd":
        return dp_figures(records, card)
    if name == "ray_gpu":
        return ray_figures(records)
    if name == "batched_layers":
        return layer_figures(records)
    if name == "niid_round":
        return niid_figures(records)
    if name == "node_cuda":
        return node_figures(records)
    if name == "cuda_tests":
        return test_figures(log)
    return []


def shown(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if unit == "of peak":
        return f"{100 * value:.2f}%"
    if unit == "tests":
        return f"{value:.0f}"
    return f"{value:.3g} {unit}"


def peak_line(card: str, section: str) -> str | None:
    """What the section's shares are of: the card's peak, or that it is unknown."""
    precision = {"batched_fp32": "fp32", "batched_tf32": "tf32", "batched_bf16": "bf16", "dp_sgd": "fp32"}.get(section)
    if section.startswith("batched_mm_"):  # the matmul-convolution sections: batched_mm_<precision>
        precision = section.removeprefix("batched_mm_")
    if precision is None:
        return None
    peak = card_peak(card, precision)
    if peak is None:
        return f"peak unknown for {card!r} (not in bench/sim_throughput.py's table): shares are n/a"
    return f"shares of {card}'s {peak:g} TFLOP/s dense {precision} data-sheet peak"


def summary(out: Path, card: str, previous: Path = PREVIOUS) -> list[str]:
    """The summary's lines for the sections listed in ``out/sections.tsv``."""
    prev: dict[tuple[str, str], dict] = {}
    for f in json.loads(previous.read_text())["figures"]:
        prev[(f["section"], f["figure"])] = f
    lines = [
        f"{'section':<13} {'status':<11} {'s':>4}  {'figure':<26} {'new':>10} {'previous':>10}  "
        f"{'card, date':<25} {'new/prev':>8}  better"
    ]
    table = out / "sections.tsv"
    rows = [ln.split("\t") for ln in table.read_text().splitlines() if ln.strip()] if table.exists() else []
    for name, status, seconds in rows:
        figures = section_figures(name, out / f"{name}.log", card)
        names = [f.name for f in figures]
        # the previous figures this run did not give (a failed or timed-out section) are listed too
        figures += [
            Figure(f["figure"], None, f["unit"], f["better"], measured=False)
            for (section, fig), f in prev.items()
            if section == name and fig not in names
        ]
        head = f"{name:<13} {status:<11} {seconds:>4}"
        if not figures:
            lines.append(f"{head}  (no figures)")
        for i, fig in enumerate(figures):
            p = prev.get((name, fig.name))
            ratio = "-"
            if p is not None and fig.value is not None and p["value"]:
                ratio = f"{fig.value / p['value']:.2f}"
            new = shown(fig.value, fig.unit) if fig.measured else "-"
            old = shown(p["value"], p["unit"]) if p else "-"
            when = f"{p['card']}, {p['date']}" if p else ""
            lines.append(
                f"{head if i == 0 else '':<30}  {fig.name:<26} {new:>10} {old:>10}  {when:<25} {ratio:>8}  {fig.better}"
            )
        note = peak_line(card, name)
        if note and any(f.measured for f in figures):
            lines.append(f"{'':<30}  ({note})")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the suite's output folder (sections.tsv and the sections' logs)")
    ap.add_argument("--card", required=True, help="the GPU's name as torch.cuda.get_device_name gives it")
    ap.add_argument("--previous", default=str(PREVIOUS), help="the previous figures (JSON)")
    args = ap.parse_args(argv)
    print("\n".join(summary(Path(args.out), args.card, Path(args.previous))))


if __name__ == "__main__":
    main()
