"""A gossip peer's own page: ``shoal peer`` serves the dashboard of shoal/web/dashboard.py for itself,
behind its network token: its training steps and metric curves, epsilon (local DP), bytes sent,
merges and refusals, and its neighbours (the view) and directory."""

from __future__ import annotations

import hmac
import time
from typing import TYPE_CHECKING, Any

from shoal.web.dashboard import Dashboard, curves

if TYPE_CHECKING:
    from .peer import Peer

RUN = "peer"  # the page's one run: this peer's training


class PeerSource:
    """What the page shows of one :class:`~shoal.p2p.peer.Peer`."""

    kind = "peer"

    def __init__(self, peer: Peer):
        self.peer = peer
        self.started = time.monotonic()

    def _summary(self, now: float) -> dict[str, Any]:
        p = self.peer
        rounds = p.g.rounds or None
        done = p._stop.is_set() or (rounds is not None and p.steps >= rounds)
        return {
            "run": RUN,
            "task": p.status()["task"],
            "status": "finished" if done else "running",
            "mode": f"gossip: {p.g.algorithm}",
            "round": p.steps,
            "version": p.node.version,
            **({"rounds_target": rounds} if rounds else {}),
            "elapsed_s": round(now - self.started, 1),
        }

    def runs(self, now: float) -> list[dict[str, Any]]:
        return [self._summary(now)]

    def run(self, run_id: str, now: float) -> dict[str, Any] | None:
        if run_id != RUN:
            return None
        p = self.peer
        records = p.metrics.records if p.metrics is not None else []
        status = p.svc.counters()
        refused = {"messages": p.svc.rejected, "addresses": status["addresses"]["refused"]}
        refused.update({f"merge_bound_{k}": v for k, v in status["merge_bound"].items()})
        refused["connections"] = p.guard.refused
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
            "bytes_up": p.svc.bytes_sent,
            "bytes_down": None,
            "accepted": p.node.merges,
            "refused": {k: v for k, v in refused.items() if v},
            "stragglers": None,
            "dropouts": None,
            "history": history,
        }
        return {**self._summary(now), "records": len(records), **curves(records, x="round"), "traffic": traffic}

    def nodes(self, now: float) -> list[dict[str, Any]]:
        """The view (neighbours this peer exchanges with) and the rest of its directory."""
        m = self.peer.node.membership
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


def peer_dashboard(peer: Peer) -> Dashboard:
    """The page, opened by the peer's network token (off when the peer runs without one)."""
    token = peer.s.token

    def check(candidate: str) -> bool:
        return bool(token) and hmac.compare_digest(candidate.encode(errors="replace"), token.encode())

    off = "" if token else "this peer runs without a network token (--token-file): its page is off"
    return Dashboard(PeerSource(peer), check, off)
