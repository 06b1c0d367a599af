"""Peer sampling in the style of Cyclon (Voulgaris, Gavidia and van Steen 2005), sans-I/O.

Each peer keeps a bounded partial view of other peers, each entry with an age. A
shuffle: age every entry by one, pick the oldest entry Q, send Q up to ``shuffle_length``
entries (a fresh pointer to ourselves replacing Q's own), and remove Q from the view.
Q answers with a random subset of its view and both sides fold the received entries in,
first into empty slots, then over the entries they sent. Dead peers drop out by
themselves: the oldest entry is the one contacted, so a dead one is found and removed
within a few shuffles.

A directory on top: every peer this one has heard of (views, shuffles, direct messages),
less the removed ones, up to ``max_known``. Group averaging (p2p/group_average.py) lays
the directory out on its grid: peers that know the same peers form the same groups.

Failure detection on top: a contact that fails (timeout or transport error) counts a
failure; a peer with ``max_failures`` consecutive failures is removed and quarantined,
so stale entries of it that still circulate are ignored for ``quarantine`` time units.
A direct message from a peer proves it alive and lifts its quarantine (that is how a
restarted peer rejoins: it contacts its bootstrap peers, which re-admit it).

Against eclipse (an insider or a stranger filling views with addresses it makes up), in the
spirit of Brahms (Bortnikov et al. 2009) and Basalt (2021):

- a direct message never evicts a view entry: its sender takes a slot only if one is free;
- pushes (shuffle requests and direct messages) change the view only within a rate: at most
  ``push_limit`` per ``period`` in all, and one per sender; above it they are answered but
  fold nothing in (a flood triggers no view change, Brahms's rule);
- exchanges go to *proven* peers: entries that answered one of our contacts (``answered``),
  and failing those, the history sample's proven peers or the bootstrap peers, so a view full
  of made-up addresses never stops merges; entries only heard of are contacted by shuffles,
  where a made-up one fails and is dropped;
- the history sample is Brahms's: ``samplers`` min-wise independent samplers (p2p/samplers.py)
  fed every ID this peer learns (pushes, shuffle answers, directory entries, direct messages).
  Each keeps the ID with the least keyed hash, so repeating an ID gains nothing: an attacker
  holds about its share of the *distinct* IDs seen, however often it pushes (a flood beyond
  the push rate feeds nothing). Every other shuffle goes to a sampled ID that has not answered
  us yet, and an ID removed after failed contacts is reset out of the samplers holding it
  (Brahms's probing), so made-up IDs leave the samplers once the attack stops;
- the view is renewed as Brahms's mix: at most ``push_share`` of its slots from pushes (and
  only within the push rate), at most ``pull_share`` from shuffle answers, and at least the
  rest (one slot or more) from the history sample, which also refills a view less than half
  full, before each shuffle;
- the directory is bounded (``max_known``) and forgets an entry no one vouched for (named it
  in a view exchange or a group, or messaged us) for ``forget_after``.

No sockets and no clock: time is passed in as ``now`` (seconds, or simulator cycles).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from .samplers import Samplers

PROBE_EVERY = 2  # every other shuffle probes an unproven history-sample peer, when there is one
# where a view entry came from: a push (a shuffle request or a direct message), a pull (a shuffle
# answer), or our own choice (bootstrap, a peer that answered us, the history sample)
Origin = Literal["push", "pull", "own"]


@dataclass
class ViewEntry:
    peer: str  # the peer's identity, which is also its address (a URL for real peers)
    age: int = 0
    origin: Origin = "own"


@dataclass(frozen=True)
class ShuffleRequest:
    sender: str
    target: str
    entries: tuple[tuple[str, int], ...]
    seq: int = 0  # the sender's message counter (p2p/freshness.py)


@dataclass(frozen=True)
class ShuffleResponse:
    sender: str
    target: str
    entries: tuple[tuple[str, int], ...]
    seq: int = 0  # the sender's message counter (p2p/freshness.py)


@dataclass
class _Pending:
    sent: list[str]
    deadline: float


@dataclass
class Membership:
    """One peer's partial view and the Cyclon shuffle protocol around it."""

    self_id: str
    view_size: int = 8
    shuffle_length: int = 4
    timeout: float = 5.0  # a shuffle not answered by then counts as a failure
    max_failures: int = 2  # consecutive failures before a peer is removed
    quarantine: float = 30.0  # how long entries of a removed peer are ignored
    seed: int = 0
    bootstrap_peers: tuple[str, ...] = ()
    view: dict[str, ViewEntry] = field(default_factory=dict)
    max_known: int = 4096  # the directory's bound
    forget_after: float = 60.0  # a directory entry no one vouched for this long is forgotten
    push_limit: int = 0  # pushes that may change the view per ``period`` (0: 2 x shuffle_length)
    period: float = 1.0
    samplers: int = 16  # min-wise samplers behind the history sample
    push_share: float = 0.45  # Brahms's alpha: at most this share of the view from pushes
    pull_share: float = 0.45  # beta: at most this share from shuffle answers; the rest: history
    sampler_keys: Callable[[int], bytes] | None = None  # the samplers' key source (None: os.urandom)

    def __post_init__(self) -> None:
        if self.view_size < 1 or not 1 <= self.shuffle_length <= self.view_size:
            raise ValueError("need view_size >= 1 and 1 <= shuffle_length <= view_size")
        if not (0 <= self.push_share and 0 <= self.pull_share and self.push_share + self.pull_share < 1):
            raise ValueError("need push_share, pull_share >= 0 and push_share + pull_share < 1")
        gamma = 1.0 - self.push_share - self.pull_share
        self.caps: dict[Origin, int] = {
            "push": math.ceil(self.push_share * self.view_size - 1e-9),
            "pull": math.ceil(self.pull_share * self.view_size - 1e-9),
            "own": self.view_size,
        }
        self.history_slots = max(1, round(gamma * self.view_size))  # view slots the history sample refills
        self.history = Samplers(self.samplers, self.sampler_keys, memory=self.max_known)
        self._rng = random.Random(self.seed)
        self._pending: dict[str, _Pending] = {}
        self._failures: dict[str, int] = {}
        self._removed: dict[str, float] = {}
        self.known: dict[str, float] = {}  # the directory: peer -> when it was last vouched for
        self.answered: OrderedDict[str, float] = OrderedDict()  # proven: peers that answered us lately
        self._pushes: dict[str, int] = {}  # senders of view-changing pushes in the current period
        self._push_window = 0.0  # start of the current period
        self.floods = 0  # pushes answered without a view change (over the rate)
        self.shuffles = 0  # shuffles started (every other one may probe the history sample)
        self._clock = 0.0  # the latest ``now`` seen (what ``add`` stamps directory entries with)
        if self.push_limit <= 0:
            self.push_limit = 2 * self.shuffle_length
        for p in self.bootstrap_peers:
            self.add(p)

    # --- queries -----------------------------------------------------------------------

    def peers(self) -> list[str]:
        return sorted(self.view)

    def directory(self) -> list[str]:
        """Every other peer we know of and have not removed (sorted)."""
        return sorted(self.known)

    def _vouch(self, peer: str, now: float) -> None:
        """``peer`` was named to us or messaged us: into the directory (if there is room), fresh,
        and into the history samplers."""
        self._clock = max(self._clock, now)
        if peer == self.self_id:
            return
        self.history.feed(peer)
        if peer in self.known or len(self.known) < self.max_known:
            self.known[peer] = now

    def learn(self, peer: str, now: float) -> None:
        """``peer`` was named to us (a group's member list): into the directory unless quarantined."""
        if not self._quarantined(peer, now):
            self._vouch(peer, now)

    def forget(self, now: float) -> list[str]:
        """Directory entries no one vouched for in ``forget_after`` (and not in the view or proven)
        are forgotten; returns them."""
        keep = set(self.view) | set(self.answered)
        old = [p for p, t in self.known.items() if now - t > self.forget_after and p not in keep]
        for p in old:
            del self.known[p]
        return old

    def _may_push(self, sender: str, now: float) -> bool:
        """Whether a push from ``sender`` may change the view: within ``push_limit`` per period, once per sender."""
        if now - self._push_window >= self.period or now < self._push_window:
            self._push_window, self._pushes = now, {}
        if sender in self._pushes or len(self._pushes) >= self.push_limit:
            self.floods += 1
            return False
        self._pushes[sender] = 1
        return True

    def suspected(self) -> set[str]:
        return {p for p, n in self._failures.items() if n > 0}

    def history_sample(self) -> list[str]:
        """The samplers' IDs with no recent failure (sorted): Brahms's history sample."""
        return [p for p in self.history.sample() if self._failures.get(p, 0) == 0 and p not in self._removed]

    def sample(self) -> str | None:
        """A random exchange partner. Every other draw (at random) is a proven peer: a view entry
        that answered us, else a history-sample peer that answered us, else a bootstrap peer (the
        seeds), else any history-sample peer; the others are any view entry with no recent
        failure (healthy first). So at least half the exchanges reach peers that answer however
        many made-up addresses fill the view, and the rest keep the partners diverse."""
        ok = lambda p: self._failures.get(p, 0) == 0  # noqa: E731
        healthy = sorted(p for p in self.view if ok(p)) or sorted(self.view)
        if self._rng.random() < 0.5:
            proven = [p for p in healthy if p in self.answered and ok(p)]
            history = self.history_sample()
            fallback = (
                [p for p in history if p in self.answered]
                or [p for p in self.bootstrap_peers if p != self.self_id and p not in self._removed]
                or history
            )
            healthy = proven or fallback or healthy
        return self._rng.choice(healthy) if healthy else None

    # --- view maintenance ----------------------------------------------------------------

    def _count(self, origin: Origin) -> int:
        return sum(e.origin == origin for e in self.view.values())

    def add(self, peer: str, age: int = 0, origin: Origin = "own") -> bool:
        """Put ``peer`` in the view if there is room and its origin is under its share (or it is
        there: keep the younger age)."""
        if peer == self.self_id:
            return False
        self._vouch(peer, self._clock)
        if peer in self.view:
            self.view[peer].age = min(self.view[peer].age, age)
            return True
        if len(self.view) >= self.view_size or self._count(origin) >= self.caps[origin]:
            return False
        self.view[peer] = ViewEntry(peer, age, origin)
        return True

    def renew(self, now: float) -> None:
        """Brahms's history share: the view holds at least ``history_slots`` history-sample peers
        (the oldest entries not in it make room, unproven ones first), and a view less than half
        full is refilled from the history sample, in random order. The other free slots stay for
        pushes and shuffle answers, which bring new peers."""
        history = [p for p in self.history_sample() if p != self.self_id and not self._quarantined(p, now)]
        fresh = [p for p in history if p not in self.view]
        self._rng.shuffle(fresh)
        held = len(history) - len(fresh)
        for p in fresh:
            if held >= self.history_slots and 2 * len(self.view) >= self.view_size:
                break
            if len(self.view) >= self.view_size:
                others = [e for e in self.view.values() if e.peer not in history]
                if not others:
                    break
                victim = max(others, key=lambda e: (e.peer not in self.answered, e.age, e.peer))
                del self.view[victim.peer]
            self.view[p] = ViewEntry(p, 0, "own")
            held += 1

    def rejoin(self, now: float) -> None:
        """Refill the view from the bootstrap list: all of it when the view is empty (after a
        restart or isolation); otherwise a bootstrap peer that is not quarantined fills a free
        slot, and one missing from the directory altogether (lost to timeouts) takes the oldest
        slot of a full view. Without that, peers whose views fill up with each other (a clique
        as large as the view, each side having removed the other) would stay split for good:
        shuffles only pass on what views hold. A dead bootstrap peer costs one contact per
        quarantine."""
        empty = not self.view
        for p in self.bootstrap_peers:
            if empty:
                self._removed.pop(p, None)
            if p == self.self_id or p in self.view or self._quarantined(p, now):
                continue
            if len(self.view) >= self.view_size and p not in self.known:
                oldest = max(self.view.values(), key=lambda e: (e.age, e.peer))
                del self.view[oldest.peer]
            self.add(p)

    def heard_from(self, peer: str, now: float, origin: Origin = "push") -> None:
        """A direct message from ``peer`` (a push): it is alive and in the directory; it takes a
        view slot only if one is free (and pushes hold under their share), and never evicts an
        entry (any sender can claim a name)."""
        self._failures.pop(peer, None)
        self._removed.pop(peer, None)
        self._vouch(peer, now)
        self.add(peer, 0, origin)

    def seen(self, peer: str, now: float) -> None:
        """A direct message from ``peer`` that is no view exchange (a group's slice): it is
        alive and in the directory; it takes a view slot only if one is free."""
        self.heard_from(peer, now)

    def on_failure(self, peer: str, now: float) -> bool:
        """A contact with ``peer`` failed; returns True when this removed it."""
        n = self._failures.get(peer, 0) + 1
        self._failures[peer] = n
        if n >= self.max_failures:
            self.remove(peer, now)
            return True
        return False

    def on_success(self, peer: str, now: float) -> None:
        """``peer`` answered our contact: alive, proven, in the history sample; if the view is
        full it takes the slot of the oldest entry that never answered."""
        self.answered.pop(peer, None)
        self.answered[peer] = now
        while len(self.answered) > self.view_size:
            self.answered.popitem(last=False)
        if peer != self.self_id and peer not in self.view and len(self.view) >= self.view_size:
            unproven = [e for e in self.view.values() if e.peer not in self.answered]
            if unproven:
                del self.view[max(unproven, key=lambda e: (e.age, e.peer)).peer]
        self.heard_from(peer, now, "own")

    def remove(self, peer: str, now: float) -> None:
        """``peer`` failed our contacts (or may not be contacted): out of the view, the directory
        and the history samplers (those holding it start over), and quarantined."""
        self.history.invalidate(peer, self.answered)
        self.view.pop(peer, None)
        self.known.pop(peer, None)
        self.answered.pop(peer, None)
        self._failures.pop(peer, None)
        self._pending.pop(peer, None)
        self._removed.pop(peer, None)
        self._removed[peer] = now
        while len(self._removed) > self.max_known:  # bounded like the directory: the oldest go first
            del self._removed[next(iter(self._removed))]

    def _quarantined(self, peer: str, now: float) -> bool:
        t = self._removed.get(peer)
        if t is None:
            return False
        if now - t >= self.quarantine:
            del self._removed[peer]
            return False
        return True

    # --- the shuffle -----------------------------------------------------------------------

    def _probe(self) -> str | None:
        """A sampler-held peer that has not answered us (and has no open shuffle), a suspected one
        first: Brahms's probing, so a made-up or dead ID fails until it is removed and resets its
        samplers."""
        held = [p for p in self.history.sample() if p not in self.answered and p not in self._pending]
        unproven = [p for p in held if p not in self._removed and p != self.self_id]
        suspected = [p for p in unproven if self._failures.get(p, 0) > 0]
        pool = suspected or unproven
        return self._rng.choice(pool) if pool else None

    def start_shuffle(self, now: float) -> ShuffleRequest | None:
        """Age the view and build a shuffle request to the oldest peer, or every other time to an
        unproven history-sample peer if there is one (None if the view is empty); directory
        entries no one vouched for lately are forgotten."""
        self._clock = max(self._clock, now)
        self.forget(now)
        self.rejoin(now)
        self.renew(now)
        if not self.view:
            return None
        for e in self.view.values():
            e.age += 1
        self.shuffles += 1
        probe = self._probe() if self.shuffles % PROBE_EVERY == 0 else None
        target = probe or max(self.view.values(), key=lambda e: (e.age, e.peer)).peer
        self.view.pop(target, None)  # Cyclon: Q's slot is freed; Q comes back through its answer or later shuffles
        others = sorted(self.view)
        picked = self._rng.sample(others, min(self.shuffle_length - 1, len(others)))
        entries = ((self.self_id, 0), *((p, self.view[p].age) for p in picked))
        self._pending[target] = _Pending(sent=picked, deadline=now + self.timeout)
        return ShuffleRequest(self.self_id, target, tuple(entries))

    def on_shuffle_request(self, msg: ShuffleRequest, now: float) -> ShuffleResponse:
        """Answer with a random subset of our view, then fold the received entries in."""
        pool = sorted(p for p in self.view if p != msg.sender)
        picked = self._rng.sample(pool, min(self.shuffle_length, len(pool)))
        reply = ShuffleResponse(self.self_id, msg.sender, tuple((p, self.view[p].age) for p in picked))
        if self._may_push(msg.sender, now):  # a flood is answered but changes nothing, samplers included
            self._removed.pop(msg.sender, None)  # a direct message proves it alive: its own entry folds in
            self._fold(msg.entries, replaceable=picked, now=now, origin="push")
            self.heard_from(msg.sender, now)
        return reply

    def cancel(self, peer: str) -> None:
        """Our shuffle with ``peer`` was never sent (the transport would not contact it)."""
        self._pending.pop(peer, None)

    def on_shuffle_response(self, msg: ShuffleResponse, now: float) -> None:
        pending = self._pending.pop(msg.sender, None)
        if pending is None:  # no shuffle of ours is open with it: an answer we did not ask for
            return
        self._fold(msg.entries, replaceable=pending.sent, now=now, origin="pull")
        self.on_success(msg.sender, now)

    def expire(self, now: float) -> list[str]:
        """Shuffles unanswered past their deadline count as failures; returns those peers."""
        late = [p for p, pend in self._pending.items() if pend.deadline <= now]
        for p in late:
            del self._pending[p]
            self.on_failure(p, now)
        return late

    def _fold(
        self, entries: tuple[tuple[str, int], ...], replaceable: list[str], now: float, origin: Origin = "pull"
    ) -> None:
        """Cyclon's merge: skip self, known and quarantined peers; fill empty slots, then
        overwrite the entries we sent to the other side; no more entries of ``origin`` than its
        share of the view."""
        spare = [p for p in replaceable if p in self.view]
        held = self._count(origin)
        for peer, age in entries:
            if peer == self.self_id or self._quarantined(peer, now):
                continue
            self._vouch(peer, now)
            if peer in self.view:
                self.view[peer].age = min(self.view[peer].age, int(age))
                continue
            if len(self.view) >= self.view_size:
                if not spare or held - (self.view[spare[-1]].origin == origin) >= self.caps[origin]:
                    continue
                held -= self.view.pop(spare.pop()).origin == origin
            elif held >= self.caps[origin]:
                continue
            self.view[peer] = ViewEntry(peer, int(age), origin)
            held += 1
