"""What a tier below the aggregator adds to it: a root's edge aggregators (server/edge/intake.py's
PartialIntake is the one implementation). The service is given a factory for it at construction
(``ServerService(..., tier=PartialIntake)``) and asks it; nothing sets the service's attributes."""

from __future__ import annotations

from typing import Any, Protocol


class Tier(Protocol):
    def figures(self, round_: int) -> dict[str, Any]:
        """What the tier adds to a version's record (the edges' partials of the round)."""
        ...

    def available(self, nodes: list[str], now: float) -> list[str]:
        """Which of the connected ``nodes`` a round may select now."""
        ...

    def status(self, now: float) -> dict[str, Any]:
        """The tier's part of the run's status (``"hierarchy"``)."""
        ...

    def state(self) -> dict[str, Any]:
        """What the tier keeps across a restart, saved in each checkpoint (JSON values only)."""
        ...
