"""A progress bar on a terminal, nothing elsewhere: for the simulator's rounds and settings and for
`shoal run wait`. It imports neither torch nor shoal's parts, so a command that only draws progress
starts in well under a second."""

from __future__ import annotations

import sys
from typing import Any


class ProgressBar:
    """A rich progress bar of ``total`` units on a terminal (nothing otherwise)."""

    def __init__(self, total: int, label: str = "round", enabled: bool | None = None):
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total, self.label = total, label
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn(f"[bold]{self.label}"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
            )
            self._bar.__enter__()
            self._task = self._bar.add_task(self.label, total=self.total, status="")
        return self

    def advance(self, status: str = "", by: int = 1) -> None:
        if self._bar is not None:  # drawn now: a short step's status is seen, not skipped by the refresh rate
            self._bar.update(self._task, advance=by, status=status, refresh=True)

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
