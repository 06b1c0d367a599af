"""The federation's database: runs, their status, the nodes' answers to them and their metrics.

One embedded SQLite file (``federation.dir``/runs.sqlite, WAL, every write committed at
once) so a SIGKILL loses nothing already written and a restart knows every run, its
config and where it stood. Checkpoints stay files in the run's folder (server/checkpoint.py
writes them atomically); this database says which runs exist and what they reported.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS runs (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        id TEXT UNIQUE NOT NULL,
        task TEXT NOT NULL,
        task_sha256 TEXT NOT NULL,
        config TEXT NOT NULL,
        status TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        submitted_by TEXT NOT NULL,
        created REAL NOT NULL,
        ended REAL
    )""",
    """CREATE TABLE IF NOT EXISTS run_nodes (
        run TEXT NOT NULL,
        node TEXT NOT NULL,
        answer TEXT NOT NULL,
        reason TEXT NOT NULL DEFAULT '',
        at REAL NOT NULL,
        PRIMARY KEY (run, node)
    )""",
    """CREATE TABLE IF NOT EXISTS metrics (
        run TEXT NOT NULL,
        seq INTEGER NOT NULL,
        line TEXT NOT NULL,
        PRIMARY KEY (run, seq)
    )""",
    # what happened to a run, for `shoal run logs`: the server's events and its nodes' answers
    """CREATE TABLE IF NOT EXISTS events (
        run TEXT NOT NULL,
        seq INTEGER NOT NULL,
        at REAL NOT NULL,
        source TEXT NOT NULL,
        line TEXT NOT NULL,
        PRIMARY KEY (run, seq)
    )""",
)
MAX_EVENTS = 10_000  # a run's event lines kept (later ones are dropped: a node's answers cannot fill the disk)

#: A run's life: queued -> running -> finished | failed | stopped.
ACTIVE = ("queued", "running")


@dataclass(frozen=True)
class RunRow:
    """One run as the database holds it."""

    id: str
    task: str
    task_sha256: str
    config: dict[str, Any]
    status: str
    reason: str
    submitted_by: str
    created: float
    ended: float | None


class RunsDB:
    """The runs table and what belongs to each run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a committed status survives a power cut too
        for stmt in _SCHEMA:
            self.db.execute(stmt)

    def close(self) -> None:
        self.db.close()

    def add(self, run_id: str, task: str, task_sha256: str, config: dict[str, Any], who: str, now: float) -> None:
        self.db.execute(
            "INSERT INTO runs (id, task, task_sha256, config, status, submitted_by, created) "
            "VALUES (?, ?, ?, ?, 'queued', ?, ?)",
            (run_id, task, task_sha256, json.dumps(config), who, now),
        )

    def set_status(self, run_id: str, status: str, reason: str = "", ended: float | None = None) -> None:
        self.db.execute(
            "UPDATE runs SET status = ?, reason = ?, ended = ? WHERE id = ?", (status, reason, ended, run_id)
        )

    def get(self, run_id: str) -> RunRow | None:
        row = self.db.execute(
            "SELECT id, task, task_sha256, config, status, reason, submitted_by, created, ended FROM runs WHERE id = ?",
            (run_id,),
        ).fetchone()
        return _row(row) if row else None

    def runs(self, statuses: tuple[str, ...] | None = None) -> list[RunRow]:
        """Every run (or those in ``statuses``), oldest first."""
        where = f" WHERE status IN ({', '.join('?' * len(statuses))})" if statuses else ""
        rows = self.db.execute(
            "SELECT id, task, task_sha256, config, status, reason, submitted_by, created, ended FROM runs"
            f"{where} ORDER BY seq",
            statuses or (),
        ).fetchall()
        return [_row(r) for r in rows]

    def count(self, status: str | None = None) -> int:
        """Runs in ``status`` (all runs when None)."""
        if status is None:
            return int(self.db.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
        return int(self.db.execute("SELECT COUNT(*) FROM runs WHERE status = ?", (status,)).fetchone()[0])

    def answer(self, run_id: str, node: str, answer: str, reason: str, now: float) -> None:
        """A node's answer to a run: ``joined``, ``refused`` (for good) or ``deferred`` (refused for a
        temporary cause: the run is offered to the node again), with its reason."""
        self.db.execute(
            "INSERT OR REPLACE INTO run_nodes (run, node, answer, reason, at) VALUES (?, ?, ?, ?, ?)",
            (run_id, node, answer, reason, now),
        )

    def answer_of(self, run_id: str, node: str) -> str | None:
        """``node``'s answer to the run (None: it has not answered)."""
        row = self.db.execute("SELECT answer FROM run_nodes WHERE run = ? AND node = ?", (run_id, node)).fetchone()
        return row[0] if row is not None else None

    def answers(self, run_id: str) -> dict[str, dict[str, str]]:
        rows = self.db.execute(
            "SELECT node, answer, reason FROM run_nodes WHERE run = ? ORDER BY node", (run_id,)
        ).fetchall()
        return {r[0]: _answer(r[1], r[2]) for r in rows}

    def add_metric(self, run_id: str, fields: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO metrics (run, seq, line) VALUES (?, "
            "(SELECT COALESCE(MAX(seq), 0) + 1 FROM metrics WHERE run = ?), ?)",
            (run_id, run_id, json.dumps(fields)),
        )

    def metrics(self, run_id: str, after: int = 0, limit: int = 1000) -> list[tuple[int, dict[str, Any]]]:
        """The run's metrics lines numbered from 1, those after ``after`` (at most ``limit``)."""
        rows = self.db.execute(
            "SELECT seq, line FROM metrics WHERE run = ? AND seq > ? ORDER BY seq LIMIT ?", (run_id, after, limit)
        ).fetchall()
        return [(int(r[0]), json.loads(r[1])) for r in rows]

    def add_event(self, run_id: str, source: str, line: str, now: float) -> bool:
        """One line of the run's log (``source``: "server" or a node's name); False once the run
        has MAX_EVENTS lines (nothing is written)."""
        seq = int(self.db.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run = ?", (run_id,)).fetchone()[0])
        if seq >= MAX_EVENTS:
            return False
        self.db.execute(
            "INSERT INTO events (run, seq, at, source, line) VALUES (?, ?, ?, ?, ?)",
            (run_id, seq + 1, now, source, line),
        )
        return True

    def events(self, run_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        """The run's log lines numbered from 1, those after ``after`` (at most ``limit``)."""
        rows = self.db.execute(
            "SELECT seq, at, source, line FROM events WHERE run = ? AND seq > ? ORDER BY seq LIMIT ?",
            (run_id, after, limit),
        ).fetchall()
        return [{"seq": int(r[0]), "at": float(r[1]), "source": r[2], "line": r[3]} for r in rows]


def _answer(answer: str, reason: str) -> dict[str, Any]:
    """A node's answer as `shoal run status` shows it (a deferred one is a temporary refusal)."""
    out: dict[str, Any] = {"answer": "refused", "temporary": True} if answer == "deferred" else {"answer": answer}
    return {**out, **({"reason": reason} if reason else {})}


def _row(r: tuple) -> RunRow:
    return RunRow(r[0], r[1], r[2], json.loads(r[3]), r[4], r[5], r[6], r[7], r[8])
