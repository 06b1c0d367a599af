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

    __slots__ = ("key", "best", "rank", "keyed", "epoch")
    key: bytes
    best: str | None
    rank: bytes
    keyed: blake2b  # a keyed state, copied for each ID
    epoch: int

    def __init__(self, key: bytes, epoch: int = 0):
        self.reset(key, epoch)

    def feed(self, peer: str, data: bytes | None = None) -> None:
        h = self.keyed.copy()  # the key's block was hashed once, at reset, not once per ID
        h.update(peer.encode() if data is None else data)
        r = h.digest()
        if self.best is None or r < self.rank:
            self.best, self.rank = peer, r

    def reset(self, key: bytes, epoch: int) -> None:
        """A new key and nothing held (Brahms's ``init``), at the samplers' reset count ``epoch``."""
        self.key, self.best, self.rank, self.epoch = key, None, b"", epoch
        self.keyed = blake2b(key=key, digest_size=16)


class Samplers:
    """``count`` samplers fed the same stream of IDs; their held IDs are the history sample."""

    def __init__(self, count: int, keys: Callable[[int], bytes] | None = None, memory: int = 4096):
        if count < 1:
            raise ValueError("need at least one sampler")
        self._keys = keys or os.urandom
        self.samplers = [Sampler(self._keys(KEY_BYTES)) for _ in range(count)]
        self.memory = memory  # the bound of the record of IDs fed
        self._fed: OrderedDict[str, int] = OrderedDict()  # ID -> the epoch it was last fed at, most recent last
        self._epoch = 0  # resets so far
        self.resets = 0

    def feed(self, peer: str) -> None:
        """One ID of the stream. Feeding an ID a sampler has seen is a no-op for its minimum, so
        only the samplers reset since this ID was last fed hash it (all of them, for a new ID)."""
        seen = self._fed.get(peer)
        self._fed[peer] = self._epoch
        self._fed.move_to_end(peer)
        if seen == self._epoch:
            return
        while len(self._fed) > self.memory:
            self._fed.popitem(last=False)
        data = peer.encode()
        for s in self.samplers:  # Sampler.feed inlined: this loop is the samplers' whole cost
            if seen is not None and s.epoch <= seen:
                continue
            h = s.keyed.copy()
            h.update(data)
            r = h.digest()
            if s.best is None or r < s.rank:
                s.best, s.rank = peer, r

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
        self._epoch += 1
        alive = [p for p in refill if p != peer]
        for s in held:
            s.reset(self._keys(KEY_BYTES), self._epoch)
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
