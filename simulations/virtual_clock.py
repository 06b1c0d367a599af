"""A virtual clock and the simulated clients' timing: hours of virtual time in seconds.

:class:`EventQueue` is a discrete-event queue: events are popped in time order (ties in
the order they were scheduled) and the clock jumps to each one; nothing sleeps.
:class:`ClientTiming` says how long things take for each client, from the
``[heterogeneity]`` config:

- compute: ``local_steps * step_time_s / speed``, speed ~ lognormal(0, speed_sigma)
  per client (median 1; sigma = 1 gives a 10x spread between the 5th and 95th
  percentiles, the heavy tail FedBuff's paper models);
- network: an exponential delay of mean ``network_delay_s`` for the download and
  again for the upload;
- availability: alternating on/off periods, exponential with means ``mean_on_s`` and
  ``mean_off_s``, starting in a random phase (on with probability on/(on+off)).

Every draw comes from a generator seeded by (seed, client), so a client's timeline is
the same whatever else happens in the run.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shoal.config import HeterogeneityConfig
from shoal.seeding import rng


@dataclass(order=True)
class Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


class EventQueue:
    """Events in time order; ``now`` is the time of the last event popped."""

    def __init__(self, now: float = 0.0):
        self.now = now
        self._heap: list[Event] = []
        self._seq = itertools.count()

    def schedule(self, at: float, kind: str, payload: Any = None) -> Event:
        if at < self.now:
            raise ValueError(f"cannot schedule {kind!r} at {at} before now = {self.now}")
        ev = Event(at, next(self._seq), kind, payload)
        heapq.heappush(self._heap, ev)
        return ev

    def pop(self) -> Event:
        ev = heapq.heappop(self._heap)
        self.now = ev.time
        return ev

    def __len__(self) -> int:
        return len(self._heap)


class _Availability:
    """One client's on/off timeline, generated forwards as the clock advances: queries
    must not go back in time (the event queue never does)."""

    def __init__(self, gen: np.random.Generator, mean_on: float, mean_off: float):
        self.gen, self.mean_on, self.mean_off = gen, mean_on, mean_off
        self.on = bool(gen.random() < mean_on / (mean_on + mean_off))
        # start inside a period: the residual of an exponential is exponential (memoryless)
        self.end = self._length()

    def _length(self) -> float:
        return float(self.gen.exponential(self.mean_on if self.on else self.mean_off))

    def _advance(self, t: float) -> None:
        while self.end <= t:
            self.on = not self.on
            self.end += self._length()

    def available(self, t: float) -> bool:
        self._advance(t)
        return self.on

    def next_change(self, t: float) -> float:
        """When the current state (at t) ends."""
        self._advance(t)
        return self.end


class ClientTiming:
    """Per-client speeds, network delays and availability (see the module docstring)."""

    def __init__(self, cfg: HeterogeneityConfig, client_ids: list[str], seed: int):
        self.cfg = cfg
        speed_gen = rng(seed, 0x5EED)
        self.speed = {
            c: float(s) for c, s in zip(client_ids, speed_gen.lognormal(0.0, cfg.speed_sigma, len(client_ids)))
        }
        # a client's network generator is made when it first downloads: a population of
        # 100,000 clients does not hold (or seed) 100,000 generators up front
        self._seed = seed
        self._index = {c: i for i, c in enumerate(client_ids)}
        self._net: dict[str, np.random.Generator] = {}
        self._avail = (
            {c: _Availability(rng(seed, 0xA7A1, i), cfg.mean_on_s, cfg.mean_off_s) for i, c in enumerate(client_ids)}
            if cfg.mean_on_s > 0
            else {}
        )

    def compute_s(self, client: str, local_steps: int) -> float:
        return local_steps * self.cfg.step_time_s / self.speed[client]

    def network_s(self, client: str) -> float:
        d = self.cfg.network_delay_s
        if d <= 0:
            return 0.0
        gen = self._net.get(client)
        if gen is None:
            gen = self._net[client] = rng(self._seed, 0xDE1A, self._index[client])
        return float(gen.exponential(d))

    @property
    def always_available(self) -> bool:
        """No on/off periods (``mean_on_s = 0``): every client is online at every time."""
        return not self._avail

    def available(self, client: str, t: float) -> bool:
        return not self._avail or self._avail[client].available(t)

    def online_until(self, client: str, t: float) -> float:
        """The time an available client goes offline (inf if always available)."""
        return self._avail[client].next_change(t) if self._avail else math.inf

    def next_online(self, clients: list[str], t: float) -> float:
        """The earliest time at or after t when one of ``clients`` is available."""
        best = math.inf
        for c in clients:
            if self.available(c, t):
                return t
            best = min(best, self._avail[c].next_change(t))
        return best
