"""Edge aggregators in a deployment: the root's intake of partials, without I/O.

An edge aggregator serves its nodes as a root does and sends the root one partial per round
(aggregation/partial.py): the sum of its nodes' updates, their total weight and their ids.
:class:`PartialIntake` is the root's side: it checks a partial from the network as the
server checks an update (size, spec hash, dtypes, finite values, every header field), takes
the authenticated edge as its origin (never what the body claims), lets a retransmit of a
partial already taken through as a ``duplicate`` (counted once: an edge retransmits until it
hears back), refuses another partial from the same edge in the same round (``conflict``),
and streams the sum into the open sync round with SyncRounds.submit_sum, which checks every
node inside as it checks one update (selected, not yet received, from this version; all or
nothing). Only the root divides: its strategy takes the sums and steps its optimizer.

What the edge itself does (the node protocol, its quorum and deadline, the retransmits) is
docs/hierarchy.md's "not yet" list: the simulator (simulations/hierarchy.py) drives the same
partial and inbox objects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shoal.aggregation.partial import PartialInbox, decode_partial
from shoal.errors import UpdateRejected
from shoal.wire import MAX_HEADER_BYTES

if TYPE_CHECKING:
    from .service import ServerService


class PartialIntake:
    """The root's intake of edge partials into its sync rounds (one per ServerService)."""

    def __init__(self, service: ServerService):
        self.service = service
        self._inbox: PartialInbox | None = None
        numel = service.spec.numel
        # a float64 sum of the whole model, and a header naming up to ~40,000 nodes
        self.max_bytes = 8 * numel + MAX_HEADER_BYTES + 4096

    def _why_not(self) -> str | None:
        cfg = self.service.cfg
        if self.service.sync is None:
            return f"server.mode = {cfg.server.mode!r}: partials from edges join sync rounds"
        if cfg.secure_aggregation.enabled:
            return "secure aggregation is on: a plain partial would reveal its edge's sum"
        if cfg.privacy.mode != "none":
            return f"privacy.mode = {cfg.privacy.mode!r}: the DP mean clips each update, which a sum hides"
        if cfg.robust.rule != "mean":
            return f"robust.rule = {cfg.robust.rule!r} needs each update, not a sum"
        return None

    def inbox(self) -> PartialInbox:
        """The open round's inbox (a new one when the round changed)."""
        r = self.service.sync
        assert r is not None
        if self._inbox is None or (self._inbox.round, self._inbox.version) != (r.round, r.version):
            self._inbox = PartialInbox(r.round, r.version, self.service.spec.numel, self.service.cfg.strategy.weighting)
        return self._inbox

    def submit(self, edge: str, body: bytes | memoryview, now: float) -> dict[str, Any]:
        """Validate a partial from ``edge`` (the authenticated identity) and merge it into the open
        round; raises a ShoalError (WireError or UpdateRejected) with nothing changed if refused."""
        svc = self.service  # an edge is no node: it is not marked seen, so rounds never select it
        try:
            why = self._why_not()
            if why is not None:
                raise UpdateRejected("not_supported", f"this server takes no partials: {why}")
            part = decode_partial(body, svc.spec.numel, svc.spec.hash, self.max_bytes)
            part = part.sealed(edge)  # the authenticated edge is its origin, whatever the body says
            r = svc.sync
            assert r is not None
            if svc.done:
                raise UpdateRejected("done", f"training is complete at version {r.version}; no more partials")
            if not r.open:
                raise UpdateRejected("round_closed", f"no round is open (version {r.version})")
            inbox = self.inbox()
            receipt, merged = inbox.admit(part)
            if merged is not None:
                if not merged.senders:
                    raise UpdateRejected("empty", "a partial of no node")
                try:
                    r.submit_sum(merged.to_partial_sum())
                except BaseException:
                    inbox.release(edge)
                    raise
                inbox.record(edge)
        except Exception as e:
            svc.refused(getattr(e, "code", "error"))
            svc.activity.refused(edge, getattr(e, "code", "error"), str(e), now)
            raise
        if merged is not None:
            svc.counters.accepted += len(merged.senders)
            svc.counters.bytes_received += len(body)
            svc.activity.accepted(edge, len(body), r.round, now)
        return {
            "status": "accepted" if merged is not None else "duplicate",
            "round": r.round,
            "version": svc.version,
            "nodes": receipt.senders,
        }
