"""Whether a federation's run can still go on, what a waiting run waits for, and each node's health.

Plain logic without I/O (time passed in): server/federation/runs.py hands in the nodes' answers to the
run (``joined``, ``refused``, ``failed``: the task's own code raised on the node), when each node
was last heard from in the run, and the number of nodes registered; it gets back each node's state
(``online``, ``training``, ``offline``: not heard from for a poll period, ``refused``, ``failed``), the line a
waiting run shows in ``shoal run status``, and, for a run that cannot proceed, the reason it ends
``failed`` with:

- every registered node refused or failed the run: at once (waiting cannot help);
- fewer than ``server.min_nodes`` nodes online and taking part for ``federation.run_stall_s``
  seconds in a row (0: a run waits for its nodes for ever); nodes that refused it *for now*
  (another run spends their data's local-DP budget) count as coming, so it waits for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GONE = ("refused", "failed")  # answers that take a node out of the run for good
MAX_LISTED = 5  # nodes named in one line; the rest are counted


def node_health(
    answers: dict[str, dict[str, Any]],
    last_seen: dict[str, float],
    now: float,
    horizon: float,
    training: frozenset[str] | set[str] = frozenset(),
) -> dict[str, dict[str, Any]]:
    """Each node's state in the run: its answer, ``online``/``offline`` (heard from in the run within
    ``horizon`` seconds, one long-poll period; a node that holds a task of the run is ``training``,
    silent while it trains), seconds since it was last seen, and its reason."""
    out: dict[str, dict[str, Any]] = {}
    for node in sorted(set(answers) | set(last_seen)):
        answer = answers.get(node, {})
        seen = last_seen.get(node)
        if answer.get("temporary"):  # refused for now (a cause that passes): it may join later
            state = "deferred"
        elif answer.get("answer") in GONE:
            state = answer["answer"]
        else:
            online = seen is not None and now - seen <= horizon
            state = "training" if node in training else "online" if online else "offline"
        entry: dict[str, Any] = {**answer, "state": state}
        entry["last_seen_s"] = round(now - seen, 1) if seen is not None else None
        out[node] = entry
    return out


def _names(nodes: list[str]) -> str:
    shown = ", ".join(nodes[:MAX_LISTED])
    return shown + (f" and {len(nodes) - MAX_LISTED} more" if len(nodes) > MAX_LISTED else "")


def _others(health: dict[str, dict[str, Any]]) -> str:
    """The nodes not taking part, each with why: '; b failed: ...; c offline (last seen 40 s ago)'."""
    parts = []
    for node, h in health.items():
        if h["state"] in GONE:
            parts.append(f"{node} {h['state']}: {h.get('reason', '')}".rstrip(": "))
        elif h["state"] == "offline":
            seen = h.get("last_seen_s")
            parts.append(f"{node} offline" + (f" (last seen {seen:.0f} s ago)" if seen is not None else ""))
        elif h["state"] == "deferred":
            parts.append(f"{node} deferred: {h.get('reason', '')}")
    shown = parts[:MAX_LISTED]
    more = f"; and {len(parts) - MAX_LISTED} more" if len(parts) > MAX_LISTED else ""
    return "; ".join(shown) + more


@dataclass
class RunWatch:
    """One run's stall clock: since when it has had fewer nodes than it needs."""

    min_nodes: int
    stall_s: float
    short_since: float | None = None

    def check(self, health: dict[str, dict[str, Any]], registered: int, now: float) -> tuple[str | None, str | None]:
        """``(waiting_for, fail_reason)``: the line a waiting run shows (None: it has its nodes), and
        why the run ends ``failed`` (None: it goes on)."""
        need = max(1, self.min_nodes)
        usable = sorted(n for n, h in health.items() if h["state"] in ("online", "training"))
        gone = [n for n, h in health.items() if h["state"] in GONE]
        if gone and not usable and len(gone) >= max(registered, 1):
            return None, f"every node refused or failed the run: {_others(health)}"
        if len(usable) >= need:
            self.short_since = None
            return None, None
        if self.short_since is None:
            self.short_since = now
        others = _others(health)
        waiting = (
            f"waiting for server.min_nodes = {need} nodes online and taking part: {len(usable)} "
            f"({_names(usable) or 'none'}) for {now - self.short_since:.0f} s"
            + (f"; {others}" if others else "")
            + (f" (the run fails after federation.run_stall_s = {self.stall_s:g} s)" if self.stall_s > 0 else "")
        )
        deferred = sum(1 for h in health.values() if h["state"] == "deferred")
        if deferred and len(usable) + deferred >= need:  # nodes that join once another run is over
            self.short_since = now  # (say, its local-DP ledger): the run waits for them, its clock does not run
            return waiting, None
        if self.stall_s > 0 and now - self.short_since >= self.stall_s:
            return waiting, (
                f"fewer than server.min_nodes = {need} nodes took part for federation.run_stall_s = "
                f"{self.stall_s:g} s: {len(usable)} online ({_names(usable) or 'none'})"
                + (f"; {others}" if others else "")
            )
        return waiting, None
