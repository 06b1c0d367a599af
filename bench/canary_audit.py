"""How often the canary audit flags a sound run, and whether it flags planted bugs.

    python bench/canary_audit.py --runs 10
    python bench/canary_audit.py --ledger --runs 10 --bug-runs 10
    python bench/canary_audit.py --synthetic --runs 10

``--ledger``: the all-iterates audit against the run's own ledger (simulations/canary_audit.py,
``audit_iterates``) on tests/privacy/test_ledger_audit.py's setting (2NN, 20 clients + 200
canaries at q = 1/20, 10 rounds, z = 0.7), central DP sound and with four planted bugs (noise
halved, clip at 4C, sampling at 2q charged q, one round not charged), and local DP sound and with
DP-SGD's noise removed; prints each class's detection rate (sound: false alarms) and which check
fired.

For each setting, ``--runs`` sound runs (seeds 0..runs-1) and one run per planted bug; prints the
point estimate, the bootstrap interval, the accounted epsilon, and the verdict by the point
estimate and by the interval's lower end (the audit's verdict). Settings: the tests' audit
configuration (MLP, 20 clients + 500 canaries, q = 1/20, 20 rounds, z = 0.7) in central mode
(final model) and local mode (each canary client's first update), and the tight central run
(q = 1, one round) in which the planted central bugs are looked for.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "simulations"))

from test_privacy_canary import AUDIT, MODES, TIGHT, _clip_at_4c, _halve_the_noise, _no_local_noise  # noqa: E402

from shoal.assembly import task_from_config  # noqa: E402
from shoal.config import load_config  # noqa: E402
from shoal.simulations.canary_audit import run_canary_audit  # noqa: E402
from shoal.simulations.client_data import load_simulation_data  # noqa: E402

SETTINGS = {
    "central, 20 rounds at q = 1/20 (final model)": [*AUDIT, *MODES["central"]],
    "central, tight (one round, q = 1)": [*AUDIT, *MODES["central"], *TIGHT],
    "local (each canary's first update)": [*AUDIT, *MODES["local"]],
}
BUGS = {
    "central, tight (one round, q = 1)": [("noise halved", _halve_the_noise), ("clip at 4C", _clip_at_4c)],
    "local (each canary's first update)": [("DP-SGD noise removed", _no_local_noise)],
}


def one(sets: list[str], seed: int, bug=None) -> dict:
    cfg = load_config(None, [*sets, f"simulation.seed={seed}"])
    task = task_from_config(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        return run_canary_audit(
            cfg, load_simulation_data(task, cfg), task, Path(tmp), prepare=bug(cfg) if bug else None
        )


#: the ledger audit's checks, by a phrase of their message
CHECKS = (("rounds released", "rounds"), ("selected at q", "q"), ("noise per unit", "z"), ("costs epsilon", "epsilon"))


def ledger_table(runs: int, bug_runs: int) -> None:
    """Detection rate of each planted bug class and false alarms of sound runs (the module doc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "privacy"))
    from test_ledger_audit import SETTING, sample_twice_as_often, skip_one_charge

    central = [s for s in SETTING if not s.startswith("privacy.mode")] + ['privacy.mode="central"']
    local = [s for s in SETTING if not s.startswith("privacy.mode")] + ['privacy.mode="local"']
    classes = [
        ("central, sound", central, None, runs),
        ("central, noise halved", central, _halve_the_noise, bug_runs),
        ("central, clip at 4C (noise for C)", central, _clip_at_4c, bug_runs),
        ("central, sampling at 2q, charged q", central, sample_twice_as_often, bug_runs),
        ("central, one round not charged", central, skip_one_charge, bug_runs),
        ("local, sound", local, None, runs),
        ("local, DP-SGD noise removed", local, _no_local_noise, bug_runs),
    ]
    print("| class | runs | flagged | by the ledger audit | by the final-model estimate | checks that fired | s |")
    print("|---|---|---|---|---|---|---|")
    for name, sets, bug, n in classes:
        t0 = time.perf_counter()
        flagged = by_ledger = by_estimate = 0
        fired: dict[str, int] = {}
        for seed in range(n):
            o = one(sets, seed, bug)
            flagged += bool(o["canary_flagged"])
            by_ledger += bool(o["canary_ledger_flagged"])
            by_estimate += o["canary_epsilon_low"] > o["canary_accounted_epsilon"]
            for f in (o["canary_ledger_audit"] or {}).get("failed", []):
                key = next((k for part, k in CHECKS if part in f), f)
                fired[key] = fired.get(key, 0) + 1
        checks = ", ".join(f"{k} ({v})" for k, v in fired.items()) or "-"
        ledger = f"{by_ledger}/{n}" if sets is central else "n/a (local)"  # local: first updates vs its accountant
        print(
            f"| {name} | {n} | {flagged}/{n} | {ledger} | {by_estimate}/{n} | {checks} | "
            f"{time.perf_counter() - t0:.0f} |",
            flush=True,
        )


def synthetic_table(runs: int) -> None:
    """The ledger audit on releases built directly (tests/privacy/test_ledger_audit.py's ``synthetic``:
    a Poisson-sampled Gaussian sum, 200 canaries, 400 unseen directions, 20,000 coordinates, 10
    rounds): the ledger charges z = 0.7 at q = 0.1 for every round; each class plants one bug."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "privacy"))
    from test_ledger_audit import synthetic

    from shoal.privacy_plan import PrivacyPlan
    from shoal.simulations.canary_audit import audit_iterates

    classes = [  # name, true q, sigma, canary contribution, rounds charged
        ("sound", 0.1, 0.7, 1.0, 10),
        ("noise halved", 0.1, 0.35, 1.0, 10),
        ("clip at 4C (noise for C)", 0.1, 0.7, 4.0, 10),
        ("sampling at 2q, charged q", 0.2, 0.7, 1.0, 10),
        ("one round not charged", 0.1, 0.7, 1.0, 9),
    ]
    print("| class (releases built directly) | runs | flagged | checks that fired | s |")
    print("|---|---|---|---|---|")
    for name, q, sigma, c, charged in classes:
        t0 = time.perf_counter()
        flagged, fired = 0, {}
        for seed in range(runs):
            acc = PrivacyPlan(mode="central", noise_multiplier=0.7).round_accountant(0.1)
            for _ in range(charged):
                acc.record_round([])
            out = audit_iterates(*synthetic(10, q, sigma, c, seed=seed), acc, 1e-5)
            flagged += out.flagged
            for f in out.failed:
                key = next((k for part, k in CHECKS if part in f), f)
                fired[key] = fired.get(key, 0) + 1
        checks = ", ".join(f"{k} ({v})" for k, v in fired.items()) or "-"
        print(f"| {name} | {runs} | {flagged}/{runs} | {checks} | {time.perf_counter() - t0:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="sound runs per setting")
    ap.add_argument("--ledger", action="store_true", help="the all-iterates audit against the ledger, per bug class")
    ap.add_argument("--bug-runs", type=int, default=10, help="--ledger: runs per planted bug class")
    ap.add_argument("--synthetic", action="store_true", help="the ledger audit on releases built directly")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    if args.synthetic:
        synthetic_table(args.runs)
        return
    if args.ledger:
        ledger_table(args.runs, args.bug_runs)
        return
    for name, sets in SETTINGS.items():
        print(f"\n## {name}")
        print("| run | estimate | 95% interval | accounted | flagged by point | flagged (lower end) |")
        print("|---|---|---|---|---|---|")
        point_flags = low_flags = 0
        t0 = time.perf_counter()
        for seed in range(args.runs):
            o = one(sets, seed)
            acc = o["canary_accounted_epsilon"]
            point_flags += o["canary_epsilon"] > acc
            low_flags += bool(o["canary_flagged"])
            print(
                f"| sound, seed {seed} | {o['canary_epsilon']:.3f} | [{o['canary_epsilon_low']:.3f}, "
                f"{o['canary_epsilon_high']:.3f}] | {acc:.3f} | {o['canary_epsilon'] > acc} | {o['canary_flagged']} |"
            )
        for label, bug in BUGS.get(name, []):
            o = one(sets, 0, bug)
            acc = o["canary_accounted_epsilon"]
            est = o["canary_epsilon"]
            print(
                f"| {label} | {est:.3f} | [{o['canary_epsilon_low']:.3f}, {o['canary_epsilon_high']:.3f}] | "
                f"{acc:.3f} | {est > acc or math.isinf(est)} | {o['canary_flagged']} |"
            )
        print(
            f"\nsound runs flagged: {point_flags}/{args.runs} by the point estimate, {low_flags}/{args.runs} by the "
            f"lower end ({time.perf_counter() - t0:.0f} s)"
        )


if __name__ == "__main__":
    main()
