"""A gossip peer's own page: ``shoal peer`` serves the dashboard of shoal/web/dashboard.py for itself,
behind its network token: its training steps and metric curves, epsilon (local DP), bytes sent,
merges and refusals, and its neighbours (the view) and directory."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Any

from shoal.web.dashboard import Dashboard, curves

from .connections import Connections
from .runtime import PeerRuntime
from .service import PeerService
from .store import PeerStore

RUN = "peer"  # the page's one run: this peer's training


class PeerSource:
    """What the page shows of one peer: its protocol state, its training, its records."""

    kind = "peer"

    def __init__(
        self,
        svc: PeerService,
        runtime: PeerRuntime,
        store: PeerStore,
        guard: Connections,
        stopped: Callable[[], bool],
    ):
        self.svc, self.runtime, self.store, self.guard, self.stopped = svc, runtime, store, guard, stopped
        self.started = time.monotonic()

    def _summary(self, now: float) -> dict[str, Any]:
        g, steps = self.svc.g, self.runtime.steps
        rounds = g.rounds or None
        done = self.stopped() or (rounds is not None and steps >= rounds)
        return {
            "run": RUN,
            "task": self.runtime.task_name,
            "status": "finished" if done else "running",
            "mode": f"gossip: {g.algorithm}",
            "round": steps,
            "version": self.svc.node.version,
            **({"rounds_target": rounds} if rounds else {}),
            "elapsed_s": round(now - self.started, 1),
        }

    def runs(self, now: float) -> list[dict[str, Any]]:
        return [self._summary(now)]

    def run(self, run_id: str, now: float) -> dict[str, Any] | None:
        if run_id != RUN:
            return None
        svc = self.svc
        records = self.store.records
        status = svc.counters()
        refused = {"messages": svc.rejected, "addresses": status["addresses"]["refused"]}
        refused.update({f"merge_bound_{k}": v for k, v in status["merge_bound"].items()})
        refused["connections"] = self.guard.refused
        history = [
            {
                "version": r["round"],
                "bytes_up": r.get("bytes_sent"),
                "bytes_down": None,
                "accepted": r.get("merges"),
                "refused": r.get("rejected"),
                "stragglers": None,
                "dropouts": None,
            }
            for r in records
            if isinstance(r.get("round"), int)
        ]
        traffic = {
            "live": True,
            "bytes_up": svc.bytes_sent,
            "bytes_down": None,
            "accepted": svc.node.merges,
            "refused": {k: v for k, v in refused.items() if v},
            "stragglers": None,
            "dropouts": None,
            "history": history,
        }
        return {**self._summary(now), "records": len(records), **curves(records, x="round"), "traffic": traffic}

    def nodes(self, now: float) -> list[dict[str, Any]]:
        """The view (neighbours this peer exchanges with) and the rest of its directory."""
        m = self.svc.node.membership
        suspected = m.suspected()
        return [
            {
                "name": peer,
                "online": peer in m.view and peer not in suspected,
                "revoked": False,
                "last_seen_ago_s": None,
                "runs": {},
                "last_refusal": {"code": "unreachable", "detail": "its last contact failed", "ago_s": None}
                if peer in suspected
                else None,
                "in_view": peer in m.view,
            }
            for peer in sorted(set(m.view) | set(m.known))
        ]


def peer_dashboard(source: PeerSource, token: str) -> Dashboard:
    """The page, opened by the peer's network token (off when the peer runs without one)."""

    def check(candidate: str) -> bool:
        return bool(token) and hmac.compare_digest(candidate.encode(errors="replace"), token.encode())

    off = "" if token else "this peer runs without a network token (--token-file): its page is off"
    return Dashboard(source, check, off)
