"""The distributed discrete Gaussian's epsilon: the paper's RDP bound with Zhu-Wang amplification
(``privacy.accountant = "rdp"``) beside the PLD analysis (``"pld"``), and the continuous Gaussian of
the same noise multiplier, for a few settings. Run: ``python bench/ddg_pld.py``."""

from __future__ import annotations

import time

from shoal.accounting import epsilon
from shoal.accounting_rounds import epsilon_ddg
from shoal.aggregation.discrete_gaussian import plan

SETTINGS = [  # dim, z, C, t, K, bits, q, rounds
    (199_210, 1.0, 1.0, 10, 10, 16, 0.1, 100),
    (199_210, 1.0, 1.0, 10, 10, 16, 0.1, 1000),
    (199_210, 0.7, 1.0, 10, 10, 16, 0.01, 1000),
    (199_210, 2.0, 1.0, 50, 50, 20, 0.5, 200),
    (54_410, 1.0, 1.0, 3, 5, 16, 0.5, 15),
    (54_410, 1.0, 1.0, 3, 5, 16, 1.0, 15),
]


def main() -> None:
    delta = 1e-5
    print(f"delta = {delta:g}; columns: RDP bound (old), PLD (new), PLD/RDP, continuous Gaussian PLD at z")
    for dim, z, clip, t, k, bits, q, rounds in SETTINGS:
        p = plan(dim, clip, z, t, k, bits)
        ddg = {**p.as_dict(), "sensitivity_sq": p.sensitivity_sq()}
        t0 = time.perf_counter()
        old = epsilon_ddg(q, ddg, rounds, delta, "rdp")
        t1 = time.perf_counter()
        new = epsilon_ddg(q, ddg, rounds, delta, "pld")
        t2 = time.perf_counter()
        cont = epsilon(q, z, rounds, delta, "pld")
        print(
            f"d = {dim}, z = {z:g}, t = {t}, K = {k}, bits = {bits}, q = {q:g}, {rounds} rounds: "
            f"rdp {old:.3f} ({t1 - t0:.1f} s), pld {new:.3f} ({t2 - t1:.1f} s), {new / old:.3f}; continuous {cont:.3f}"
        )


if __name__ == "__main__":
    main()
