"""Clients on a virtual clock, and the asynchronous engine (FedAsync / FedBuff).

Real numbers, virtual time: each dispatched client trains for real (the same
LocalTrainer, ``train_clients`` and ``client_steps`` as the synchronous engine) at the
moment it is handed the model, and its result is *delivered* at

    now + download delay + local_steps * step_time_s / speed + upload delay

(simulations/virtual_clock.py). A client that goes offline before then drops out: its
result never arrives. At most ``asynchronous.concurrency`` clients train at once;
whenever one finishes or drops out, another idle, available client is picked at
random. The protocol is shoal.async_rounds' AsyncRounds, the object the server drives.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from shoal.assembly import make_async_rounds
from shoal.async_rounds import AsyncStats
from shoal.config import Config
from shoal.errors import UpdateRejected, WireError
from shoal.rounds import Assignment, evaluation_due
from shoal.seeding import rng
from shoal.update import Update

from .inprocess import InProcessSimulation
from .run_loop import Report, Step, progress_status
from .virtual_clock import ClientTiming, EventQueue

log = logging.getLogger(__name__)


def planned_steps(cfg: Config, n: int) -> int:
    """Local steps of a client with ``n`` examples: ``train.epochs`` x its batches (LocalTrainer's
    and the batched trainer's count; the partial last batch is a step)."""
    return cfg.train.epochs * -(-n // cfg.train.batch(n)) if n else 0


class TrainedBatch:
    """The updates of clients launched together, fetched from the pool once, when first needed."""

    def __init__(self, results: Callable[[], list[tuple[Assignment, Update]]]):
        self._results: Callable[[], list[tuple[Assignment, Update]]] | None = results
        self._updates: dict[str, Update] = {}

    def update(self, client: str) -> Update:
        if self._results is not None:
            self._updates = {t.client_id: u for t, u in self._results()}
            self._results = None
        return self._updates.pop(client)


@dataclass(eq=False)
class Launch:
    """One client's task handed out at a virtual time; ``arrival`` is made by VirtualClients.resolve."""

    task: Assignment
    batch: TrainedBatch
    steps: int
    arrival: Update | WireError | None = None


class IdleClients(Sequence[str]):
    """``ids`` without the positions ``busy`` (ascending), in order, without a copy:
    the k-th idle client is ids[k] moved past each busy position at or before it."""

    def __init__(self, ids: Sequence[str], busy: list[int]):
        self.ids, self.busy = ids, busy

    def __len__(self) -> int:
        return len(self.ids) - len(self.busy)

    @overload
    def __getitem__(self, k: int) -> str: ...
    @overload
    def __getitem__(self, k: slice) -> list[str]: ...
    def __getitem__(self, k: int | slice) -> str | list[str]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        n = len(self)
        if not -n <= k < n:
            raise IndexError(k)
        p = k % n
        for b in self.busy:
            if b > p:
                break
            p += 1
        return self.ids[p]


class VirtualClients:
    """The simulated clients' side of a virtual-clock run: who is busy, who is online,
    training a task and scheduling its arrival (or drop-out) on the event queue."""

    def __init__(self, cfg: Config, sim: InProcessSimulation | None = None):
        self.cfg = cfg
        self.sim = sim if sim is not None else InProcessSimulation.from_config(cfg)
        seed = cfg.simulation.seed
        self.timing = ClientTiming(cfg.heterogeneity, self.sim.client_ids, seed)
        self.queue = EventQueue()
        self.busy: set[str] = set()
        self._pick = rng(seed, 0xD15C)
        self._wake_at = math.inf
        self.dropouts = 0
        self.pending: dict[Launch, None] = {}  # launches whose upload is not made yet, in launch order

    @property
    def now(self) -> float:
        return self.queue.now

    def idle_online(self) -> Sequence[str]:
        """The clients neither busy nor offline now, in client order. Without on/off periods
        that is every client but the busy few: a view, so an async run over a population of
        100,000 does not list it at every launch."""
        if self.timing.always_available:
            return IdleClients(self.sim.client_ids, sorted(map(self.sim.client_index, self.busy)))
        now = self.now
        return [c for c in self.sim.client_ids if c not in self.busy and self.timing.available(c, now)]

    def pick(self, candidates: Sequence[str], n: int) -> list[str]:
        idx = self._pick.choice(len(candidates), size=min(n, len(candidates)), replace=False)
        return [candidates[i] for i in sorted(idx)]

    def wake_when_someone_is_online(self) -> None:
        """Schedule a ``wake`` event when the next idle client comes online (once)."""
        idle = [c for c in self.sim.client_ids if c not in self.busy]
        t = self.timing.next_online(idle, self.now) if idle else math.inf
        if math.isfinite(t) and t < self._wake_at:
            self._wake_at = t
            self.queue.schedule(t, "wake")

    def woke(self) -> None:
        self._wake_at = math.inf

    def launch(self, task: Assignment, global_params: torch.Tensor, tag: Any = None) -> None:
        """Hand ``task`` out now; schedule ``arrive`` or ``dropout`` (client, Launch, tag)."""
        self.launch_all([task], global_params, tag)

    def launch_all(self, tasks: list[Assignment], global_params: torch.Tensor, tag: Any = None) -> None:
        """Hand ``tasks`` out now, at one virtual time, as one call to the client pool (a batch for
        the batched trainer; on Ray, work that runs while the driver goes on with later events),
        and schedule each one's ``arrive`` or ``dropout`` at its simulated finish time:

            now + download delay + local_steps * step_time_s / speed + upload delay

        The local steps are planned from the client's data (epochs x batches; checked against the
        trained update). What a client uploads (its update after the client steps: attacks,
        then the wire round trip) is made by :meth:`resolve` when its event comes, or by
        :meth:`flush` before anything reads the counters: per-client steps give the same
        updates and the same totals as if they had run at the launch."""
        if not tasks:
            return
        for task in tasks:
            self.sim.wire.download(global_params, task.version)
        batch = TrainedBatch(self.sim.submit_clients(tasks, global_params))
        t = self.timing
        for task in tasks:
            c = task.client_id
            steps = planned_steps(self.cfg, self.sim.shards.size(self.sim.client_index(c)))
            launch = Launch(task, batch, steps)
            self.pending[launch] = None
            finish = self.now + t.network_s(c) + t.compute_s(c, steps) + t.network_s(c)
            offline = t.online_until(c, self.now)
            self.busy.add(c)
            if offline < finish:
                self.queue.schedule(offline, "dropout", (c, launch, tag))
            else:
                self.queue.schedule(finish, "arrive", (c, launch, tag))

    def resolve(self, launch: Launch) -> Update | WireError:
        """What ``launch``'s client uploads: its update after the client steps, or the WireError
        of a payload validation refuses (the engine counts it when it arrives)."""
        if launch.arrival is None:
            task = launch.task
            update = launch.batch.update(task.client_id)
            trained = int(update.metrics.get("local_steps", launch.steps))
            if trained != launch.steps:
                raise RuntimeError(
                    f"{task.client_id} trained {trained} local steps; the virtual clock planned {launch.steps}"
                )
            try:
                for step in self.sim.client_steps:  # attacks, then the wire round trip (encode, decode, validate)
                    update = step(task, update)
                launch.arrival = update
            except WireError as e:  # the server refuses the payload when it arrives
                launch.arrival = e
            self.pending.pop(launch, None)
        return launch.arrival

    def flush(self) -> None:
        """Resolve every launch still open, in launch order (before records and totals are read)."""
        for launch in list(self.pending):
            self.resolve(launch)

    def evaluate(self, params: torch.Tensor) -> dict[str, float]:
        """``test_<metric>`` / ``fed_<metric>`` of ``params``, as the in-process engine reports them."""
        return self.sim.evaluate(params)


def staleness_figures(hist: dict[int, int]) -> dict[str, Any]:
    """Mean, max and the histogram itself (keys as strings: JSON objects need them)."""
    n = sum(hist.values())
    return {
        "staleness_mean": (sum(t * k for t, k in hist.items()) / n) if n else None,
        "staleness_max": max(hist) if hist else None,
        "staleness_hist": {str(t): hist[t] for t in sorted(hist)},
    }


class VirtualEngine:
    """The run loop's Engine (simulations/run_loop.py) of an engine on the virtual clock: its
    records (``run``) become steps whose progress is server steps (sync: rounds closed; async:
    versions) out of ``simulation.rounds``."""

    cfg: Config
    clients: VirtualClients
    sim: InProcessSimulation
    algorithm: str
    x_axis = "virtual_time_s"

    def run(self) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def totals(self) -> dict[str, Any]:
        raise NotImplementedError

    def server_steps(self) -> int:
        """Server steps taken so far (sync: rounds closed, failed ones included; async: versions)."""
        raise NotImplementedError

    @property
    def label(self) -> str:
        return self.sim.task_label

    @property
    def title(self) -> str:
        return f"{self.label} / {self.algorithm}"

    def drive(self, report: Report) -> None:
        done = 0
        for rec in self.run():
            now = self.server_steps()
            report(Step(max(0, now - done), rec))
            done = max(done, now)
            log.info("virtual %.0fs  version %d  %s", rec["virtual_time_s"], rec["version"], progress_status(rec))

    def figures(self, last: dict[str, Any]) -> dict[str, Any]:
        sim = self.sim
        return {
            "rounds": self.server_steps(),
            "mode": self.cfg.simulation.mode,
            "algorithm": self.algorithm,
            **self.totals(),
            "num_clients": len(sim.client_ids),
            "num_parameters": sim.spec.numel,
            "device": str(sim.device),
            **sim.pool_figures(),
        }

    def close(self) -> None:
        self.sim.close()


class AsyncEngine(VirtualEngine):
    """Runs AsyncRounds over VirtualClients; :meth:`run` yields one record per evaluation."""

    def __init__(self, cfg: Config, sim: InProcessSimulation | None = None):
        self.cfg = cfg
        self.algorithm = cfg.asynchronous.algorithm
        self.clients = VirtualClients(cfg, sim)
        self.sim = self.clients.sim
        self.rounds = make_async_rounds(cfg, self.sim.trainer.flat.detach().clone(), self.sim.spec.numel)
        self._recorded: tuple[int, float] | None = None
        self._bytes_mark = (0, 0)  # wire totals (up, down) at the previous record

    def server_steps(self) -> int:
        return self.rounds.version

    def _fill(self) -> None:
        free = self.cfg.asynchronous.concurrency - len(self.clients.busy)
        if free <= 0:
            return
        candidates = self.clients.idle_online()
        tasks = [self.rounds.task(c) for c in self.clients.pick(candidates, free)]
        self.clients.launch_all(tasks, self.rounds.global_params)
        if len(candidates) < free:
            self.clients.wake_when_someone_is_online()

    def run(self) -> Iterator[dict[str, Any]]:
        """Until version ``simulation.rounds`` or ``heterogeneity.max_virtual_time_s``."""
        cfg, het = self.cfg, self.cfg.heterogeneity
        q, r = self.clients.queue, self.rounds
        if het.eval_interval_s > 0:
            q.schedule(het.eval_interval_s, "eval")
        if het.max_virtual_time_s > 0:
            q.schedule(het.max_virtual_time_s, "stop")
        last = r.stats.copy()
        yield self._record(last)
        last = r.stats.copy()
        self._fill()
        while len(q) and r.version < cfg.simulation.rounds:
            ev = q.pop()
            if ev.kind == "stop":
                break
            if ev.kind == "eval":
                yield self._record(last)
                last = r.stats.copy()
                q.schedule(q.now + het.eval_interval_s, "eval")
                continue
            if ev.kind == "wake":
                self.clients.woke()
            elif ev.kind == "dropout":
                c, launch, _ = ev.payload
                self.clients.resolve(launch)  # it trained and encoded; nothing reaches the server
                self.clients.busy.discard(c)
                self.clients.dropouts += 1
                r.forget(c)
                self.sim.wire.not_accepted(c)  # never delivered: top-k error feedback keeps it
            elif ev.kind == "arrive":
                c, launch, _ = ev.payload
                update = self.clients.resolve(launch)
                self.clients.busy.discard(c)
                if isinstance(update, WireError):  # refused by validation: counted, never applied
                    r.stats.rejected[update.code] = r.stats.rejected.get(update.code, 0) + 1
                    r.forget(c)
                    self._fill()
                    continue
                try:
                    advanced = r.submit(c, update)
                    self.sim.wire.accepted(c)
                except UpdateRejected:
                    advanced = False
                    self.sim.wire.not_accepted(c)
                if advanced and het.eval_interval_s == 0 and evaluation_due(r.version, cfg.simulation.eval_every):
                    yield self._record(last)
                    last = r.stats.copy()
            if r.version < cfg.simulation.rounds:  # no new tasks once the last version is reached
                self._fill()
        if self._recorded != (r.version, q.now):  # the last state, unless just recorded
            yield self._record(last)

    def _record(self, since: AsyncStats) -> dict[str, Any]:
        """Test metrics of the current model and what happened since ``since``."""
        self.clients.flush()  # every upload handed out so far is counted, as at its launch
        r, s = self.rounds, self.rounds.stats
        self._recorded = (r.version, self.clients.now)
        ev = self.clients.evaluate(r.global_params)
        hist = {t: k - since.staleness.get(t, 0) for t, k in s.staleness.items() if k - since.staleness.get(t, 0)}
        n_ex = s.examples - since.examples
        w = self.sim.wire
        up, down = w.total_up - self._bytes_mark[0], w.total_down - self._bytes_mark[1]
        self._bytes_mark = (w.total_up, w.total_down)
        return {
            "round": r.version,
            "version": r.version,
            "virtual_time_s": round(self.clients.now, 3),
            **ev,
            "train_loss": (s.loss_sum - since.loss_sum) / n_ex if n_ex else None,
            "num_results": s.accepted - since.accepted,
            "num_examples": n_ex,
            **staleness_figures(hist),
            "accepted": s.accepted,
            "rejected": dict(s.rejected),
            "bytes_up": up,
            "bytes_down": down,
            "bytes_up_total": w.total_up,
            "bytes_down_total": w.total_down,
        }

    def totals(self) -> dict[str, Any]:
        self.clients.flush()
        s = self.rounds.stats
        return {
            "updates_accepted": s.accepted,
            "updates_rejected": dict(s.rejected),
            "updates_rejected_total": sum(s.rejected.values()),
            "dropouts": self.clients.dropouts,
            "staleness": staleness_figures(s.staleness),
            "version": self.rounds.version,
            "virtual_time_s": round(self.clients.now, 3),
            "bytes_up_total": self.sim.wire.total_up,
            "bytes_down_total": self.sim.wire.total_down,
        }
