"""Staleness weights s(t): how much an update trained from an old global version counts.

Staleness t = (current global version) - (the version the client trained from). Every
rule gives s(0) = 1 and never increases with t:

- ``constant``:   s(t) = 1 (no discount; plain FedAsync/FedBuff without a staleness rule).
- ``polynomial``: s(t) = (1 + t)^-a. a = 0.5 is FedBuff's 1/sqrt(1 + t) (Nguyen et al.
  2022, "Federated Learning with Buffered Asynchronous Aggregation", AISTATS, Sec. 4);
  FedAsync's polynomial rule (Xie et al. 2019, "Asynchronous Federated Optimization",
  Sec. 5.2) is the same function.
- ``hinge``:      s(t) = 1 if t <= b else 1 / (a (t - b) + 1) (Xie et al. 2019, Sec. 5.2).

Updates older than a maximum staleness are rejected outright by the protocol objects
(shoal.async_rounds, shoal.rounds), not weighted here.
"""

from __future__ import annotations

from collections.abc import Callable

WEIGHT_KINDS = ("constant", "polynomial", "hinge")

StalenessWeight = Callable[[int], float]


def staleness_weight(kind: str, staleness: int, a: float = 0.5, b: int = 4) -> float:
    """s(t) for ``kind`` in constant | polynomial | hinge (see the module docstring)."""
    if staleness < 0:
        raise ValueError(f"staleness = {staleness} must be >= 0 (an update cannot be newer than the model)")
    match kind:
        case "constant":
            return 1.0
        case "polynomial":
            if a < 0:
                raise ValueError(f"staleness exponent a = {a} must be >= 0")
            return float((1.0 + staleness) ** -a)
        case "hinge":
            if a < 0 or b < 0:
                raise ValueError(f"hinge staleness needs a >= 0 and b >= 0, got a = {a}, b = {b}")
            return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"staleness weight {kind!r} is not one of {', '.join(WEIGHT_KINDS)}")


def make_staleness_weight(kind: str, a: float = 0.5, b: int = 4) -> StalenessWeight:
    """``t -> staleness_weight(kind, t, a, b)``, with the arguments checked now, not at the first update."""
    staleness_weight(kind, 0, a, b)
    return lambda t: staleness_weight(kind, t, a, b)
