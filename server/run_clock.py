"""A run's clock for its records: elapsed seconds across restarts, and each version's cost (seconds
since the last version, the process's CPU seconds in them, its resident memory), with the smoothed
pace of versions that async uploads' horizon uses. Time is passed in, as everywhere in the service."""

from __future__ import annotations

from collections.abc import Callable

from .activity import process_usage


class RunClock:
    def __init__(
        self,
        started_at: float | None = None,
        elapsed_before: float = 0.0,
        usage: Callable[[], tuple[float, float]] = process_usage,
    ):
        """``started_at``: the ``now`` elapsed seconds count from (default: the first call's);
        ``elapsed_before``: the run's life before a restart (its last record's elapsed_s);
        ``usage``: the process's (CPU seconds, resident MB)."""
        self.started_at = started_at
        self.elapsed_before = elapsed_before
        self.usage = usage
        self.last_version: tuple[float, float] | None = None  # (now, CPU seconds) at the last version
        self.interval: float | None = None  # seconds between versions, smoothed
        self.latest = elapsed_before  # the last elapsed() (a checkpoint keeps it: DP records do not carry it)

    def elapsed(self, now: float) -> float:
        if self.started_at is None:
            self.started_at = now
        self.latest = round(now - self.started_at + self.elapsed_before, 4)
        return self.latest

    def version_figures(self, now: float) -> dict[str, float]:
        """The server's cost of this version: seconds since the last version (the run's start for
        the first), the process's CPU seconds in them and its resident memory now. Process-wide:
        a federation's runs share the process, so each run's figures include the others' work."""
        cpu, rss = self.usage()
        since, cpu_then = self.last_version if self.last_version is not None else (self.started_at, None)
        self.last_version = (now, cpu)
        out = {"server_rss_mb": round(rss, 1)}
        if since is not None:
            out["server_round_s"] = round(now - since, 4)
            dt = max(now - since, 0.0)
            self.interval = dt if self.interval is None else 0.8 * self.interval + 0.2 * dt
        if cpu_then is not None:
            out["server_cpu_s"] = round(cpu - cpu_then, 4)
        return out

    def seconds_for(self, versions: int, now: float) -> float | None:
        """Seconds until ``versions`` more versions are made at the recent pace (None before the
        pace is known)."""
        if self.interval is None or self.last_version is None:
            return None
        return versions * self.interval - (now - self.last_version[0])
