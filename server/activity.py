"""What a run's nodes did, for the dashboard: bytes up and down, refusals by node, rounds taken,
stragglers and dropouts, and one row of totals per new version (the dashboard's traffic curves).

Plain bookkeeping without I/O: :class:`~shoal.server.service.ServerService` calls it as uploads are
accepted or refused and rounds close; server/app.py adds the model bytes it sends. Memory is
bounded: at most MAX_NODES nodes and MAX_HISTORY version rows are kept (the oldest go first).
"""

from __future__ import annotations

import os
import resource
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

MAX_NODES = 10_000  # nodes remembered per run (the least recently active are forgotten first)
MAX_HISTORY = 5_000  # version rows kept for the traffic curves
MAX_DETAIL = 300  # characters of a refusal's detail kept


def process_usage() -> tuple[float, float]:
    """This process's CPU seconds so far (user + system, every thread) and its resident memory in
    MB now (/proc/self/statm; where there is none, the peak from getrusage)."""
    cpu = time.process_time()
    try:
        with open("/proc/self/statm", "rb") as f:
            resident = int(f.read().split()[1])
        return cpu, resident * os.sysconf("SC_PAGE_SIZE") / 1e6
    except (OSError, ValueError, IndexError):
        return cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3  # kB on Linux


@dataclass
class NodeActivity:
    """One node in one run."""

    accepted: int = 0  # uploads accepted
    rounds: list[int] = field(default_factory=list)  # the last rounds it contributed to (at most 20)
    bytes_up: int = 0
    bytes_down: int = 0
    refused: int = 0
    last_refusal: dict[str, Any] | None = None  # {"code", "detail", "at"} (wall-clock seconds)
    last_active: float = 0.0


@dataclass
class Activity:
    """A run's traffic and refusals, by node and over versions."""

    bytes_up: int = 0
    bytes_down: int = 0
    stragglers: int = 0  # results that arrived after their round closed
    dropouts: int = 0  # selected nodes whose round closed without their result
    nodes: OrderedDict[str, NodeActivity] = field(default_factory=OrderedDict)
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=MAX_HISTORY))

    def node(self, name: str, now: float) -> NodeActivity:
        entry = self.nodes.get(name)
        if entry is None:
            entry = self.nodes[name] = NodeActivity()
            while len(self.nodes) > MAX_NODES:
                self.nodes.popitem(last=False)
        else:
            self.nodes.move_to_end(name)
        entry.last_active = now
        return entry

    def accepted(self, name: str, nbytes: int, round_: int, now: float) -> None:
        n = self.node(name, now)
        n.accepted += 1
        n.bytes_up += nbytes
        if not n.rounds or n.rounds[-1] != round_:
            n.rounds = [*n.rounds[-19:], round_]
        self.bytes_up += nbytes

    def refused(self, name: str, code: str, detail: str, now: float) -> None:
        n = self.node(name, now)
        n.refused += 1
        n.last_refusal = {"code": code, "detail": detail[:MAX_DETAIL], "at": now}

    def sent(self, name: str, nbytes: int, now: float) -> None:
        """The global model sent to ``name`` (GET /v1/model answered 200)."""
        self.node(name, now).bytes_down += nbytes
        self.bytes_down += nbytes

    def round_closed(self, selected: int, results: int, late: int) -> None:
        self.dropouts += max(selected - results, 0)
        self.stragglers += late

    def snapshot(self, round_: int, version: int, accepted: int, refused: int, elapsed_s: float) -> None:
        """A row of totals at a new version (the x of the traffic curves is the version)."""
        self.history.append(
            {
                "round": round_,
                "version": version,
                "elapsed_s": elapsed_s,
                "bytes_up": self.bytes_up,
                "bytes_down": self.bytes_down,
                "accepted": accepted,
                "refused": refused,
                "stragglers": self.stragglers,
                "dropouts": self.dropouts,
            }
        )


#: The record fields a console line shows first, when the run reports them.
CONSOLE_FIRST = ("test_accuracy", "fed_accuracy", "test_loss", "fed_loss", "train_loss")


def console_line(record: dict[str, Any], target: int) -> str:
    """One line per new version for the server's console: where the run is and how it does."""
    figures = [k for k in CONSOLE_FIRST if isinstance(record.get(k), (int, float))]
    figures += [k for k in record if k.startswith(("test_", "fed_")) and k not in figures and "num_examples" not in k]
    shown = ", ".join(f"{k} {record[k]:.4g}" for k in figures[:4] if isinstance(record.get(k), (int, float)))
    parts = []
    if shown:
        parts.append(shown)
    if isinstance(record.get("num_results"), int):
        late = record.get("num_late") or 0
        parts.append(f"{record['num_results']} results" + (f" ({late} late)" if late else ""))
    if isinstance(record.get("epsilon"), (int, float)):
        target_eps = record.get("target_epsilon")
        parts.append(f"epsilon {record['epsilon']:.3g}" + (f" of {target_eps:g}" if target_eps else ""))
    if isinstance(record.get("elapsed_s"), (int, float)):
        parts.append(f"{record['elapsed_s']:.1f} s")
    return f"version {record.get('version')} of {target} (round {record.get('round')}): " + ", ".join(parts)
