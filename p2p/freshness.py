"""Fresh messages: every model and shuffle a peer sends carries a counter that only grows, and a
receiver takes each sender's counters in increasing order and only while they are recent (sans-I/O).

The counter is the sender's wall clock in microseconds when it sends, bumped past the last one it
sent (:class:`Counter`): it grows across the sender's restarts without any stored state, and it
tells the receiver how old the message is. A receiver (:class:`Freshness`) refuses

- a counter at or below the highest it took from that sender (a replay, or an older message
  overtaken by a newer one): ``replayed``, 409;
- a counter more than ``validity`` seconds away from its own wall clock (a message recorded
  long ago, sent again to a peer that has since forgotten the sender, or a sender whose clock
  is far off): ``expired``, 400.

A refused message moves nothing: :meth:`Freshness.check` raises before anything changes, and
:meth:`Freshness.take` records the counter only once the message is accepted. The table of
senders is bounded (LRU); a sender pushed out leaves its counter as a floor that every sender's
next counter must clear, so forgetting a sender never reopens the replay of its messages.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from shoal.errors import WireError

VALIDITY = 30.0  # seconds a message stays acceptable (both ways: clocks of peers differ a little)
MAX_SENDERS = 4096  # senders whose last counter is remembered


class Stale(WireError):
    """A replayed, out-of-order or expired message; ``status`` says how it is answered."""

    code = "replayed"

    def __init__(self, code: str, status: int, detail: str):
        super().__init__(detail)
        self.code, self.status = code, status


class Counter:
    """A sender's message counter: microseconds of its wall clock, strictly increasing."""

    def __init__(self) -> None:
        self.last = 0

    def next(self, wall: float) -> int:
        self.last = max(self.last + 1, int(wall * 1e6))
        return self.last


class Freshness:
    """The highest counter taken from each sender, and the validity window around our wall clock."""

    def __init__(self, validity: float = VALIDITY, max_senders: int = MAX_SENDERS):
        if not validity > 0 or max_senders < 1:
            raise ValueError("need validity > 0 and max_senders >= 1")
        self.validity, self.max_senders = float(validity), int(max_senders)
        self.last: OrderedDict[str, int] = OrderedDict()
        self.floor = 0  # the highest counter of a sender pushed out of the table
        self.refused = 0

    def check(self, sender: str, seq: int, wall: float) -> None:
        """Raise :class:`Stale` unless ``sender``'s ``seq`` is new and recent at ``wall``; changes nothing
        but the refusal count."""
        age = wall - seq / 1e6
        if not math.isfinite(age) or abs(age) > self.validity:
            self.refused += 1
            raise Stale(
                "expired",
                400,
                f"message counter {seq} is {age:+.1f} s from this peer's clock, outside the {self.validity:g} s "
                "validity: a replay, or the sender's clock is off",
            )
        if seq <= max(self.last.get(sender, 0), self.floor):
            self.refused += 1
            raise Stale("replayed", 409, f"message counter {seq} of {sender[:200]} is not above the last taken")

    def take(self, sender: str, seq: int) -> None:
        """Record an accepted message's counter."""
        self.last.pop(sender, None)
        self.last[sender] = seq
        while len(self.last) > self.max_senders:
            _, old = self.last.popitem(last=False)
            self.floor = max(self.floor, old)
