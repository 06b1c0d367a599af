"""Synchronous rounds on the virtual clock, so sync and async runs compare in virtual time.

Each round selects among the idle, online clients (SyncRounds with over-selection),
trains them for real and delivers each result at its simulated finish time
(simulations/async_engine.VirtualClients). The round closes when K results arrived,
at its deadline (``asynchronous.deadline_s``; below ``min_fraction`` the round fails
and the model is unchanged), or, without a deadline, when every selected client has
reported or dropped out. A result that comes after its round closed is late: dropped,
or folded into the open round with its staleness weight (``asynchronous.late``).
A client still training for an old round is busy and cannot be selected again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from shoal.config import Config
from shoal.errors import ConfigError, UpdateRejected, WireError
from shoal.rounds import RoundSummary, evaluation_due

from .async_engine import VirtualClients, VirtualEngine, staleness_figures
from .inprocess import InProcessSimulation

log = logging.getLogger(__name__)


class VirtualSyncEngine(VirtualEngine):
    """Runs deadline-aware SyncRounds over VirtualClients; :meth:`run` yields records."""

    algorithm = "sync"

    def __init__(self, cfg: Config, sim: InProcessSimulation | None = None):
        self.cfg = cfg
        self.clients = VirtualClients(cfg, sim)
        self.sim = self.clients.sim
        if not self.sim.cfg.heterogeneity.enabled:
            raise ConfigError("the virtual-clock sync engine runs configs with heterogeneity.enabled = true")
        # the deadline-aware SyncRounds shoal.assembly built for the virtual clock (SimulationParts.rounds)
        self.rounds = self.sim.rounds
        self.live: set[str] = set()  # selected this round, still training
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self.staleness: dict[int, int] = {}
        self.failed_rounds = 0
        self.rounds_done = 0
        self._recorded: tuple[int, float] | None = None
        self._submitted: list[str] = []  # whose uploads the open round holds (settled when it closes)

    def server_steps(self) -> int:
        return self.rounds_done

    def _start(self) -> bool:
        """Open a round if anyone is online; else wait for someone (False)."""
        online = self.clients.idle_online()
        if not online:
            self.clients.wake_when_someone_is_online()
            return False
        r = self.rounds
        tasks = r.start_round(online, now=self.clients.now)
        if r.deadline_at is not None:
            self.clients.queue.schedule(r.deadline_at, "deadline", r.round)
        self.live = {t.client_id for t in tasks}
        self.clients.launch_all(tasks, r.global_params, tag=r.round)
        return True

    def _close(self) -> RoundSummary | None:
        held, self._submitted = self._submitted, []
        try:
            s = self.rounds.finish_round()
        except UpdateRejected:  # no result at all: nothing to aggregate, model unchanged
            self.failed_rounds += 1
            return None
        for c in held:  # top-k error feedback: applied, or (failed round) folded back
            (self.sim.wire.not_accepted if s.failed else self.sim.wire.accepted)(c)
        if s.failed:
            self.failed_rounds += 1
        else:
            self.accepted += s.num_results + s.num_late
            if s.num_results:
                self.staleness[0] = self.staleness.get(0, 0) + s.num_results
            for t, k in s.late_staleness.items():
                self.staleness[t] = self.staleness.get(t, 0) + k
        return s

    def run(self) -> Iterator[dict[str, Any]]:
        """Until ``simulation.rounds`` rounds closed or ``heterogeneity.max_virtual_time_s``."""
        cfg, het = self.cfg, self.cfg.heterogeneity
        q, r = self.clients.queue, self.rounds
        if het.eval_interval_s > 0:
            q.schedule(het.eval_interval_s, "eval")
        if het.max_virtual_time_s > 0:
            q.schedule(het.max_virtual_time_s, "stop")
        yield self._record(None)
        self._start()
        while len(q) and self.rounds_done < cfg.simulation.rounds:
            ev = q.pop()
            if ev.kind == "stop":
                break
            if ev.kind == "eval":
                yield self._record(None)
                q.schedule(q.now + het.eval_interval_s, "eval")
                continue
            if ev.kind == "wake":
                self.clients.woke()
            elif ev.kind in ("arrive", "dropout"):
                c, launch, tag = ev.payload
                arrival = self.clients.resolve(launch)  # a dropped client trained and encoded too
                self.clients.busy.discard(c)
                if tag == r.round:
                    self.live.discard(c)
                if ev.kind == "dropout":
                    self.clients.dropouts += 1
                    self.sim.wire.not_accepted(c)  # never delivered: error feedback keeps it
                elif isinstance(arrival, WireError):  # refused by validation: counted, not aggregated
                    self.rejected[arrival.code] = self.rejected.get(arrival.code, 0) + 1
                else:
                    try:
                        r.submit(c, arrival)
                        self._submitted.append(c)
                    except UpdateRejected as e:  # late and dropped, too stale, ...: folded back
                        self.rejected[e.code] = self.rejected.get(e.code, 0) + 1
                        self.sim.wire.not_accepted(c)
            if r.open and (r.should_close(q.now) or not self.live):
                s = self._close()
                self.rounds_done += 1
                if het.eval_interval_s == 0 and evaluation_due(
                    self.rounds_done, cfg.simulation.eval_every, cfg.simulation.rounds
                ):
                    yield self._record(s)
            if not r.open and self.rounds_done < cfg.simulation.rounds:
                self._start()
        if self._recorded != (self.rounds_done, q.now):  # the last state, unless just recorded
            yield self._record(None)

    def _record(self, s: RoundSummary | None) -> dict[str, Any]:
        self.clients.flush()  # every upload handed out so far is counted, as at its launch
        r = self.rounds
        self._recorded = (self.rounds_done, self.clients.now)
        ev = self.clients.evaluate(r.global_params)
        rec: dict[str, Any] = {
            "round": self.rounds_done,
            "version": r.version,
            "virtual_time_s": round(self.clients.now, 3),
            **ev,
        }
        if s is not None:
            hist = dict(s.late_staleness)
            if s.num_results:
                hist[0] = hist.get(0, 0) + s.num_results  # on-time results have staleness 0
            rec.update(
                train_loss=s.train_loss,
                num_results=s.num_results,
                num_examples=s.num_examples,
                num_late=s.num_late,
                failed=s.failed,
                **staleness_figures(hist),
            )
        rec.update(accepted=self.accepted, rejected=dict(self.rejected), failed_rounds=self.failed_rounds)
        return rec

    def totals(self) -> dict[str, Any]:
        self.clients.flush()
        return {
            "updates_accepted": self.accepted,
            "updates_rejected": dict(self.rejected),
            "updates_rejected_total": sum(self.rejected.values()),
            "failed_rounds": self.failed_rounds,
            "dropouts": self.clients.dropouts,
            "staleness": staleness_figures(self.staleness),
            "version": self.rounds.version,
            "virtual_time_s": round(self.clients.now, 3),
            "bytes_up_total": self.sim.wire.total_up,
            "bytes_down_total": self.sim.wire.total_down,
        }
