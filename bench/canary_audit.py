"""How often the canary audit flags a sound run, and whether it flags planted bugs.

    python bench/canary_audit.py --runs 10

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10, help="sound runs per setting")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
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
