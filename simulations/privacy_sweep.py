"""`shoal privacy-sweep`: accuracy and empirical leakage against epsilon, in one command.

Runs the config without privacy (the baseline), then once per (mode, noise multiplier)
of ``privacy.sweep_modes`` x ``privacy.sweep_noise_multipliers``, all on the same data
split and seed. After each run a loss-threshold membership-inference audit (mia.py)
attacks the final global model, and (``privacy.canaries`` > 0) a second run of the same
setting with canary clients gives a one-shot empirical epsilon (canary_audit.py, Andrew et
al. 2024) to set beside the accounted one. Writes, under the output folder:

* ``<setting>/``: each run's metrics.jsonl and summary.json (the audit run's in ``canary_audit/``),
* ``results.csv`` and ``results.md``: one row per setting,
* ``accuracy_vs_epsilon.png``: the task's utility metric, attack AUC and empirical epsilon
  against the accounted epsilon (log x).

The utility column is the task's own headline figure: accuracy when the task reports one, else
R², macro-F1 or F1, else its loss (read from the baseline run's final metrics, central test set
first, then the clients' own test data). A setting whose run fails (a noise level that makes
training diverge, say) is recorded as failed with its reason, and the sweep goes on.
"""

from __future__ import annotations

import copy
import csv
import logging
import math
import time
from pathlib import Path
from typing import Any

from shoal.assembly import task_from_config, task_label
from shoal.config import Config, PrivacyConfig, PrivacyMode
from shoal.errors import ConfigError, ShoalError
from shoal.progress import ProgressBar
from shoal.seeding import derive_seed
from shoal.task import SimulationData, Task, UserCodeError, as_tensors

from .canary_audit import AuditTooSmall, run_canary_audit
from .client_data import load_simulation_data
from .experiment import run_simulation
from .inprocess import InProcessSimulation
from .mia import loss_threshold_audit
from .run_loop import OnRecord

log = logging.getLogger(__name__)

COLUMNS = [
    "mode",
    "noise_multiplier",
    "status",
    "epsilon",
    "delta",
    "sampling",
    "rounds",
    "metric",
    "utility",
    "test_accuracy",
    "canary_epsilon",
    "canary_epsilon_low",
    "canary_epsilon_high",
    "canary_accounted_epsilon",
    "canary_flagged",
    "canaries",
    "mia_auc",
    "mia_tpr_at_1pct_fpr",
    "member_loss",
    "nonmember_loss",
    "mia_samples",
    "wall_s",
]
# The utility figure, in order of preference (higher is better for each but the losses).
UTILITY = ("accuracy", "r2", "macro_f1", "f1", "loss", "mse")
LOWER_IS_BETTER = ("loss", "mse")
NO_AUDIT = {
    "canary_epsilon": math.nan,
    "canary_epsilon_low": math.nan,
    "canary_epsilon_high": math.nan,
    "canary_accounted_epsilon": math.nan,
    "canary_flagged": False,
    "canaries": 0,
}


def settings(cfg: Config) -> list[tuple[PrivacyMode, float]]:
    """The baseline, then every (mode, noise multiplier) of the grid."""
    p = cfg.privacy
    baseline: list[tuple[PrivacyMode, float]] = [("none", 0.0)]
    return baseline + [(m, z) for m in p.sweep_modes for z in p.sweep_noise_multipliers]


def skip_local_dp_for_datasets(
    grid: list[tuple[PrivacyMode, float]], cfg: Config, data: SimulationData
) -> list[tuple[PrivacyMode, float]]:
    """The default grid without its local-DP settings when the clients' data are Datasets (local
    DP-SGD trains on (x, y) tensors), said once; a grid that names local DP is kept as asked."""
    asked = cfg.privacy.sweep_modes != PrivacyConfig().sweep_modes
    local = [s for s in grid if s[0] == "local"]
    if asked or not local or all(as_tensors(d) is not None for d in data.train):
        return grid
    log.warning(
        "privacy-sweep: the task's clients' data are Datasets and local DP-SGD trains on (x, y) tensors: "
        "skipping the %d local-DP settings (name privacy.sweep_modes to choose the modes)",
        len(local),
    )
    return [s for s in grid if s[0] != "local"]


def run_setting(
    cfg: Config,
    data: SimulationData,
    mode: PrivacyMode,
    z: float,
    out: Path,
    task: Task | None = None,
    metric: str | None = None,
    on_record: OnRecord | None = None,
    warned: set[str] | None = None,
) -> dict[str, Any]:
    """One simulation plus its audit; members are the samples of clients that trained.
    ``metric``: the final metric reported as the utility (None: chosen from this run's).
    ``on_record``: sees each round's metrics record (the sweep's progress line).
    ``warned``: warnings the sweep already gave (each is given once, not per setting)."""
    c = copy.deepcopy(cfg)
    c.privacy.mode, c.privacy.noise_multiplier = mode, z
    c.output.plots = False
    c.validate()
    t0 = time.perf_counter()
    sim = InProcessSimulation.from_config(c, data, task)
    summary = run_simulation(c, out, progress=False, sim=sim, on_record=on_record)
    # the sweep's own evaluation of the final model, as its audits use the clients' data: a DP run's
    # records withhold the clients' evaluations (privacy.release), the experiment still reports them
    summary = {**summary, "final_metrics": {**sim.evaluate(), **(summary.get("final_metrics") or {})}}
    metric = metric or utility_metric(summary)
    members = [sim.shards.data(i) for i, cid in enumerate(sim.client_ids) if cid in sim.participants]
    audit = loss_threshold_audit(
        sim.trainer,
        sim.global_params,
        members,
        held_out(sim),
        c.privacy.mia_samples,
        derive_seed(c.simulation.seed, 0x41A),
    )
    canary = dict(NO_AUDIT)
    if c.privacy.canaries > 0:
        try:
            found = run_canary_audit(c, data, task, out / "canary_audit")
            canary = {k: found[k] for k in NO_AUDIT}
        except AuditTooSmall as e:
            if warned is None or str(e) not in warned:
                log.warning("no canary audit (for any setting of this sweep): %s", e)
            else:
                log.info("%s z=%g: no canary audit: %s", mode, z, e)
            if warned is not None:
                warned.add(str(e))
    row = {
        "mode": mode,
        "noise_multiplier": z,
        "epsilon": summary.get("epsilon", math.inf),
        "delta": c.privacy.delta if mode != "none" else 0.0,
        "sampling": summary.get("sampling", "fixed"),
        "status": "ok",
        "rounds": summary["rounds"],
        "metric": metric or "",
        "utility": final_metric(summary, metric),
        "test_accuracy": headline_accuracy(summary),
        **canary,
        **audit,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    log.info(
        "%s z=%g: epsilon %.3g (empirical %.3g), %s %.4f, MIA AUC %.3f",
        mode,
        z,
        row["epsilon"],
        row["canary_epsilon"],
        row["metric"] or "utility",
        row["utility"],
        row["mia_auc"],
    )
    return row


def failed_row(mode: PrivacyMode, z: float, delta: float, metric: str | None, reason: str) -> dict[str, Any]:
    """A setting whose run or audit raised: recorded with its reason, every figure NaN."""
    row: dict[str, Any] = {k: math.nan for k in COLUMNS}
    row.update(mode=mode, noise_multiplier=z, status=f"failed: {reason}", metric=metric or "", canaries=0)
    row.update(delta=delta if mode != "none" else 0.0, sampling="", rounds=0)
    return row


def utility_metric(summary: dict[str, Any]) -> str | None:
    """The task's headline final metric: accuracy, else R², macro-F1, F1, else a loss; central
    test set before the clients' own test data. None when the run reported no metric."""
    figures = {k: v for k, v in (summary.get("final_metrics") or {}).items() if isinstance(v, (int, float))}
    for name in UTILITY:
        for prefix in ("test_", "fed_"):
            value = figures.get(prefix + name)
            if value is not None and math.isfinite(value):
                return prefix + name
    return None


def final_metric(summary: dict[str, Any], metric: str | None) -> float:
    value = (summary.get("final_metrics") or {}).get(metric or "")
    return float(value) if isinstance(value, (int, float)) else math.nan


def held_out(sim: InProcessSimulation) -> list:
    """The audit's non-members: the central test set, else the clients' own test data."""
    if sim.test is not None:
        return [sim.test]
    pool = [d for d in (sim.client_test or []) if d is not None]
    if not pool:
        raise ConfigError(
            "privacy-sweep's membership-inference audit needs held-out data the model never trained "
            "on: give the task's simulation_data() a central test set or per-client test sets"
        )
    return pool


def headline_accuracy(summary: dict[str, Any]) -> float:
    """Accuracy on the central test set, else on the clients' own test data (NaN if the task has none)."""
    figures = summary.get("final_metrics") or {}
    for key in ("test_accuracy", "fed_accuracy"):
        if figures.get(key) is not None:
            return float(figures[key])
    return math.nan


def _round_status(bar: ProgressBar, mode: str, z: float, cfg: Config) -> OnRecord:
    """The sweep's progress line while one setting trains: its round and the epsilon spent so far."""

    def show(rec: dict[str, Any]) -> None:
        eps = rec.get("epsilon")
        spent = f", epsilon {eps:.3g}" if isinstance(eps, (int, float)) else ""
        bar.advance(f"{mode} z={z:g}: round {rec.get('round')} of {cfg.simulation.rounds}{spent}", 0)

    return show


def run_privacy_sweep(cfg: Config, out_dir: str | Path) -> list[dict[str, Any]]:
    if cfg.simulation.mode == "gossip":  # run_setting trains and audits an InProcessSimulation's rounds
        raise ConfigError(
            "privacy-sweep runs and audits synchronous rounds; simulation.mode = 'gossip' is not swept: run "
            "`shoal simulate` with privacy.mode = 'local' per noise multiplier, or set simulation.mode = 'sync'"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    task = task_from_config(cfg)
    data = load_simulation_data(task, cfg)  # one split for every setting
    grid = skip_local_dp_for_datasets(settings(cfg), cfg, data)
    warned: set[str] = set()
    rows: list[dict[str, Any]] = []
    metric: str | None = None
    with ProgressBar(len(grid), "setting") as bar:
        for i, (mode, z) in enumerate(grid, 1):
            where = out / (mode if mode == "none" else f"{mode}_z{z:g}")
            bar.advance(f"running {mode} z={z:g}", 0)  # where the sweep is while a setting trains and is audited
            log.info("privacy-sweep: setting %d of %d: %s z=%g (%s)", i, len(grid), mode, z, where)
            try:
                row = run_setting(cfg, data, mode, z, where, task, metric, _round_status(bar, mode, z, cfg), warned)
            except UserCodeError:  # the task's own code raised: every setting would, so the sweep stops with it
                raise
            except (ShoalError, RuntimeError, ValueError, ArithmeticError) as e:
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                log.warning("%s z=%g failed, the sweep goes on: %s", mode, z, reason)
                row = failed_row(mode, z, cfg.privacy.delta, metric, reason)
            metric = metric or row["metric"] or None
            rows.append(row)
            bar.advance(
                f"{mode} z={z:g}: "
                + (
                    f"{row['metric'] or 'utility'} {row['utility']:.4f}, AUC {row['mia_auc']:.3f}, "
                    f"empirical eps {row['canary_epsilon']:.3g}"
                    if row["status"] == "ok"
                    else row["status"]
                )
            )
    if not any(r["status"] == "ok" for r in rows):
        raise ConfigError(f"privacy-sweep: every setting failed; the first: {rows[0]['status']}")
    write_csv(rows, out / "results.csv")
    (out / "results.md").write_text(markdown_table(rows))
    plot_sweep(rows, out / "accuracy_vs_epsilon.png", title=task_label(cfg, task))
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r[k] for k in COLUMNS})


def _fmt_eps(e: float) -> str:
    return "∞ (no DP)" if math.isinf(e) else f"{e:.3g}"


def _fmt_canary(r: dict[str, Any]) -> str:
    """The empirical epsilon with its bootstrap interval, and the audit run's own accounted epsilon."""
    if not r.get("canaries"):
        return "-"
    acc = (
        ""
        if math.isinf(r["canary_accounted_epsilon"])
        else f"; audit run accounted {r['canary_accounted_epsilon']:.3g}"
    )
    flag = "; EXCEEDS what is accounted" if r.get("canary_flagged") else ""
    return f"{r['canary_epsilon']:.3g} [{r['canary_epsilon_low']:.3g}, {r['canary_epsilon_high']:.3g}]{acc}{flag}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    metric = next((r["metric"] for r in rows if r["metric"]), "") or "utility"
    lines = [
        "| mode | noise multiplier z | accounted epsilon (delta) | empirical epsilon (canaries, 95% interval) | rounds "
        f"| {metric} | attack AUC | TPR @ 1% FPR | loss member / non-member |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = _fmt_eps(r["epsilon"]) + ("" if r["mode"] == "none" else f" ({r['delta']:g})")
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['noise_multiplier']:g} | {r['status']} | | | | | | |")
            continue
        lines.append(
            f"| {r['mode']} | {r['noise_multiplier']:g} | {eps} | {_fmt_canary(r)} | {r['rounds']} | "
            f"{r['utility']:.4f} | {r['mia_auc']:.3f} | {r['mia_tpr_at_1pct_fpr']:.3f} | "
            f"{r['member_loss']:.3f} / {r['nonmember_loss']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot_sweep(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Accuracy, attack AUC and (with the canary audit) empirical epsilon against the accounted
    epsilon, log x; the baseline dashed, the empirical panel with the line empirical = accounted."""
    from .report import new_figure

    rows = [r for r in rows if r["status"] == "ok"]
    metric = next((r["metric"] for r in rows if r["metric"]), "") or "utility"
    audited = any(r.get("canaries") for r in rows)
    fig = new_figure((15 if audited else 10, 4))
    axes = fig.subplots(1, 3 if audited else 2)
    base = next((r for r in rows if r["mode"] == "none"), None)
    if audited:
        ax = axes[2]
        floor = 1e-2  # a log axis: estimates of 0 are drawn at the floor
        for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"] != "none"):
            pts = sorted(
                (r["epsilon"], r["canary_epsilon"], r["canary_epsilon_low"], r["canary_epsilon_high"])
                for r in rows
                if r["mode"] == mode and math.isfinite(r["epsilon"]) and r.get("canaries")
            )
            if pts:
                x, y = [p[0] for p in pts], [max(p[1], floor) for p in pts]
                err = [
                    [y[i] - max(p[2], floor) for i, p in enumerate(pts)],
                    [max(p[3], floor) - y[i] for i, p in enumerate(pts)],
                ]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{mode} DP")
        finite = [r["epsilon"] for r in rows if math.isfinite(r["epsilon"])]
        if finite:
            lo, hi = min(finite), max(finite)
            ax.plot([lo, hi], [lo, hi], color="grey", ls=":", lw=1, label="empirical = accounted")
        if base is not None and base.get("canaries"):
            ax.axhline(base["canary_epsilon"], color="k", ls="--", lw=1, label="no DP")
        _log_axis(ax, "x", [p for r in rows for p in (r["epsilon"],)])
        _log_axis(ax, "y", [max(r["canary_epsilon"], floor) for r in rows if r.get("canaries")])
        ax.set_xlabel("accounted epsilon (log scale)")
        ax.set_ylabel("empirical epsilon, canaries (log scale)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    for ax, key, label in ((axes[0], "utility", metric.replace("_", " ")), (axes[1], "mia_auc", "attack ROC AUC")):
        for mode in dict.fromkeys(r["mode"] for r in rows if r["mode"] != "none"):
            curve = sorted((r["epsilon"], r[key]) for r in rows if r["mode"] == mode and math.isfinite(r["epsilon"]))
            ax.plot([p[0] for p in curve], [p[1] for p in curve], marker="o", label=f"{mode} DP")
        if base is not None and math.isfinite(base[key]):
            ax.axhline(base[key], color="k", ls="--", lw=1, label="no DP")
        if key == "mia_auc":
            ax.axhline(0.5, color="grey", ls=":", lw=1, label="chance")
        _log_axis(ax, "x", [r["epsilon"] for r in rows])
        ax.set_xlabel("accounted epsilon (log scale)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def _log_axis(ax: Any, which: str, values: list[float]) -> None:
    """A log scale only where something positive and finite is drawn (matplotlib refuses otherwise)."""
    if any(math.isfinite(v) and v > 0 for v in values):
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
