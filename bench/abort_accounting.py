"""epsilon of secure distributed-DP rounds whose aborts are charged: the union bound (an abort's
failure probability added to delta, aborts kept out of the release) against the mixture (aborts
released as empty rounds: shoal.accounting_aborts / accounting_mixture), at the same total delta.

    python bench/abort_accounting.py --rounds 100 --z 1.0 --delta 1e-5 10:5:3 100:10:6 1000:100:51

Each N:K:t is a population N, clients_per_round K (q = K/N) and t noise shares; K_max is the Poisson
cap (aggregation.dp.cohort_cap). Prints, per config, the branches and both epsilons (PLD and RDP);
"refused" where the union bound's delta reaches the total (its epsilon promises nothing there). Then
what `shoal server` charges (its dropouts unbounded: privacy.abort_bound = b, a node deciding the
abort with probability b at sensitivity K_max C) for each of ``--bounds`` at or above the chance
without dropouts.
"""

from __future__ import annotations

import argparse
import time

from shoal.accounting import epsilon
from shoal.accounting_aborts import abort_branches, abort_delta, bounded_branches, flip_probability
from shoal.accounting_rounds import mixed_ledger_epsilon
from shoal.aggregation.dp import cohort_cap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="N:K:t")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--z", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5, help="the total delta both epsilons are at")
    ap.add_argument("--bounds", default="1,0.01", help="privacy.abort_bound values for the server's figures")
    a = ap.parse_args()
    print(f"T = {a.rounds} rounds, z = {a.z:g}, total delta = {a.delta:g}")
    for spec in a.configs:
        n, k, t = (int(x) for x in spec.split(":"))
        q, k_max = k / n, max(cohort_cap(n, k), t)
        phi = abort_delta(n, q, t, k_max)
        branches = abort_branches(n, q, t, k_max)
        entry = {"mechanism": "gaussian", "sampling": "poisson", "q": q, "z": a.z, "rounds": a.rounds}
        entry["abort_branches"] = [list(b) for b in branches]
        rest = a.delta - a.rounds * phi
        for kind in ("pld", "rdp"):
            t0 = time.perf_counter()
            mix = mixed_ledger_epsilon([entry], a.delta, kind)
            union = epsilon(q, a.z, a.rounds, rest, kind) if rest > 0 else float("inf")
            took = time.perf_counter() - t0
            print(
                f"N={n} K={k} t={t} K_max={k_max} {kind}: union bound (phi = {phi:.3g}/round) "
                f"{'refused' if rest <= 0 else f'{union:.4g}'}; mixture {mix:.4g}  [{took:.1f} s]"
            )
        print("  branches (s, P):", ", ".join(f"({s:g}, {p:.3g})" for s, p in branches))
        least = flip_probability(n, q, t, k_max)
        for bound in (float(b) for b in a.bounds.split(",")):
            if bound < least:
                print(f"  server, abort_bound = {bound:g}: refused (below {least:.3g}, the chance without dropouts)")
                continue
            served = {**entry, "abort_branches": [list(b) for b in bounded_branches(bound, k_max)]}
            pld = mixed_ledger_epsilon([served], a.delta, "pld")
            print(
                f"  server, abort_bound = {bound:g}: pld {pld:.4g}, rdp {mixed_ledger_epsilon([served], a.delta):.4g}"
            )


if __name__ == "__main__":
    main()
