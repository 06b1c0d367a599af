"""Min-wise independent samplers, the history sample of Brahms (Bortnikov et al. 2009), sans-I/O.

Each of ``s`` samplers holds a secret random key and keeps, of every ID it has been fed, the
one whose keyed hash (BLAKE2b keyed with its key) is smallest. Feeding an ID a thousand times
changes nothing a single feed did not, so a peer that floods its own few IDs gains no more
samplers than its share of the *distinct* IDs seen: with ``f`` fake IDs among ``n`` each
sampler holds a fake one with probability ``f / n``, however often they are pushed. An
attacker who knew a key could make up an ID that wins it, so the keys come from the OS in
production (``os.urandom``); tests and the simulator inject a seeded key source so their
runs repeat.

Validation (Brahms's probing): an ID whose contacts failed is *invalidated*: every sampler
holding it draws a new key and starts over from the peers the caller names (those that answered
it lately) and the stream from then on, so dead or made-up IDs do not hold samplers for good;
once the made-up IDs stop coming (or are quarantined), the samplers hold live peers again.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from hashlib import blake2b

KEY_BYTES = 32  # BLAKE2b takes keys up to 64 bytes


class Sampler:
    """One min-wise sampler: the ID with the smallest keyed hash of those fed since the last reset."""

    __slots__ = ("key", "best", "_rank")

    def __init__(self, key: bytes):
        self.key = key
        self.best: str | None = None
        self._rank = b""

    def rank(self, peer: str) -> bytes:
        return blake2b(peer.encode(), key=self.key, digest_size=16).digest()

    def feed(self, peer: str) -> None:
        r = self.rank(peer)
        if self.best is None or r < self._rank:
            self.best, self._rank = peer, r

    def reset(self, key: bytes) -> None:
        """A new key and nothing held (Brahms's ``init``)."""
        self.key, self.best, self._rank = key, None, b""


class Samplers:
    """``count`` samplers fed the same stream of IDs; their held IDs are the history sample."""

    def __init__(self, count: int, keys: Callable[[int], bytes] | None = None, memory: int = 4096):
        if count < 1:
            raise ValueError("need at least one sampler")
        self._keys = keys or os.urandom
        self.samplers = [Sampler(self._keys(KEY_BYTES)) for _ in range(count)]
        self.memory = memory  # the bound of the record of IDs fed since the last reset
        self._fed: OrderedDict[str, None] = OrderedDict()  # IDs every sampler has seen, most recent last
        self.resets = 0

    def feed(self, peer: str) -> None:
        """One ID of the stream. An ID every sampler has seen (none was reset since) is a no-op
        for the minimum, so it costs no hashing."""
        if peer in self._fed:
            self._fed.move_to_end(peer)
            return
        self._fed[peer] = None
        while len(self._fed) > self.memory:
            self._fed.popitem(last=False)
        for s in self.samplers:
            s.feed(peer)

    def feed_all(self, peers: Iterable[str]) -> None:
        for p in peers:
            self.feed(p)

    def invalidate(self, peer: str, refill: Iterable[str] = ()) -> int:
        """``peer`` failed our contacts: the samplers holding it start over with new keys, fed
        ``refill`` (peers known alive) at once and the stream from then on. Returns how many
        were reset."""
        held = [s for s in self.samplers if s.best == peer]
        if not held:
            return 0
        self._fed.clear()  # the reset samplers have seen nothing: every ID must be hashed again
        alive = [p for p in refill if p != peer]
        for s in held:
            s.reset(self._keys(KEY_BYTES))
            for p in alive:
                s.feed(p)
        self.resets += len(held)
        return len(held)

    def held(self) -> list[str | None]:
        """Each sampler's ID (None for an empty one), in sampler order."""
        return [s.best for s in self.samplers]

    def sample(self) -> list[str]:
        """The distinct IDs the samplers hold, sorted: the history sample."""
        return sorted({s.best for s in self.samplers if s.best is not None})

    def __contains__(self, peer: object) -> bool:
        return any(s.best == peer for s in self.samplers)
