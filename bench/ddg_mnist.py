"""Accuracy of the distributed discrete Gaussian against the continuous noise shares, at the same epsilon.

    python bench/ddg_mnist.py --data ../shared/datasets/mnist-reconstructed

MNIST 2NN (McMahan et al. 2017's MLP, 199,210 parameters), IID over 100 clients, Poisson sampling
with q = K/N, secure aggregation in the simulator, distributed DP at clip C. Runs, in one process:

* secure aggregation without DP (the reference);
* today's continuous mechanism (``privacy.mechanism = "gaussian"``) at noise multiplier z;
* the distributed discrete Gaussian at each ``--bits``, with the noise multiplier z' whose epsilon
  after the same rounds equals the continuous run's (bisection on its accountant: the paper's
  bound with Zhu-Wang's general Poisson amplification is looser than the Gaussian's exact one, so
  z' > z; that, the rounding and the modular range are what the discrete mechanism costs).

Small enough for a shared 2-core machine (defaults: 100 clients, K = 10, 20 rounds, E = 1): with
so few clients per round user-level DP needs a small z to learn at all, so the epsilons are large;
the comparison at equal epsilon is the point. Prints a markdown table (docs/results.md has one).
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time

from shoal.accounting import epsilon
from shoal.accounting_rounds import DdgRoundAccountant
from shoal.aggregation.discrete_gaussian import DdgConfigError, plan
from shoal.config import load_config
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation


def base(a: argparse.Namespace) -> list[str]:
    return [
        f"simulation.seed={a.seed}",
        f"simulation.rounds={a.rounds}",
        f"simulation.num_clients={a.clients}",
        f"simulation.clients_per_round={a.per_round}",
        f"simulation.eval_every={a.rounds}",
        'data.dataset="mnist"',
        f'data.dir="{a.data}"',
        'data.partition="iid"',
        'model.name="2nn"',
        "train.epochs=1",
        "train.batch_size=10",
        f"train.lr={a.lr}",
        "secure_aggregation.enabled=true",
        "secure_aggregation.bits=20",
        "secure_aggregation.clip=4.0",
    ]


def dp(a: argparse.Namespace, z: float, mechanism: str, bits: int = 16) -> list[str]:
    return [
        'privacy.mode="distributed"',
        f'privacy.mechanism="{mechanism}"',
        f"privacy.noise_multiplier={z}",
        f"privacy.clip_norm={a.clip}",
        f"privacy.bits={bits}",
        f"privacy.delta={a.delta}",
        "privacy.reproducible=true",  # the three runs see the same selections
    ]


def ddg_epsilon(numel: int, t: int, most: int, q: float, a: argparse.Namespace, z: float, bits: int) -> float:
    p = plan(numel, a.clip, z, t, most, bits)
    return DdgRoundAccountant(q, {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}, a.delta).epsilon_after(a.rounds)


def matching_z(target: float, numel: int, t: int, most: int, q: float, a: argparse.Namespace, bits: int) -> float:
    """The z' whose discrete-Gaussian epsilon after the rounds equals ``target`` (bisection)."""
    lo, hi = a.z, a.z * 4
    while ddg_epsilon(numel, t, most, q, a, hi, bits) > target:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ddg_epsilon(numel, t, most, q, a, mid, bits) > target else (lo, mid)
    return hi


def run(sets: list[str], label: str) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_simulation(load_config(None, sets), tmp, progress=False)
    out = {
        "label": label,
        "accuracy": summary.get("final_test_accuracy"),
        "epsilon": (summary.get("privacy") or {}).get("epsilon", summary.get("epsilon")),
        "seconds": time.perf_counter() - start,
    }
    print(f"{label}: accuracy {out['accuracy']}, epsilon {out['epsilon']}, {out['seconds']:.0f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="../shared/datasets/mnist-reconstructed")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--z", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--delta", type=float, default=1e-3)
    ap.add_argument("--bits", type=int, nargs="+", default=[16, 12])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only-discrete", action="store_true", help="skip the no-DP and continuous runs")
    ap.add_argument("--no-reference", action="store_true", help="skip the no-DP run")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    q = a.per_round / a.clients
    probe = InProcessSimulation.from_config(load_config(None, [*base(a), *dp(a, a.z, "discrete_gaussian")]))
    sa = probe.secure_aggregation
    assert sa is not None and sa.ddg is not None
    numel, t, most = probe.spec.numel, sa.noise_shares, sa.max_summands
    del probe
    target = epsilon(q, a.z, a.rounds, a.delta)
    print(f"MNIST 2NN ({numel} parameters), {a.clients} clients, q = {q:g}, {a.rounds} rounds, C = {a.clip:g}, "
          f"t = {t} shares, continuous z = {a.z:g} -> epsilon {target:.4g} at delta {a.delta:g}")  # fmt: skip
    rows = []
    if not (a.only_discrete or a.no_reference):
        rows.append(run(base(a), "secure aggregation, no DP"))
    if not a.only_discrete:
        rows.append(run([*base(a), *dp(a, a.z, "gaussian")], f"continuous Gaussian shares, z = {a.z:g}"))
    for bits in a.bits:
        try:
            z2 = matching_z(target, numel, t, most, q, a, bits)
        except DdgConfigError as e:
            print(f"bits = {bits}: refused: {e}")
            continue
        p = plan(numel, a.clip, z2, t, most, bits)
        label = f"discrete Gaussian, 2^{bits}, z = {z2:.4g} (gamma {p.gamma:.3g}, Delta_2/C {math.sqrt(p.sensitivity_sq()) / a.clip:.4f})"
        rows.append(run([*base(a), *dp(a, z2, "discrete_gaussian", bits)], label))
    print("\n| run | test accuracy | epsilon | seconds |\n|---|---|---|---|")
    for r in rows:
        eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.4g}"
        print(f"| {r['label']} | {r['accuracy']:.4f} | {eps} | {r['seconds']:.0f} |")


if __name__ == "__main__":
    main()
