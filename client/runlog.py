"""Log lines that name their run: `shoal node` takes part in several federation runs at once.

The daemon sets :data:`RUN` in the asyncio task of each run it takes part in (asyncio copies
the context into the task, and ``asyncio.to_thread`` into the thread that trains), and
:class:`RunTag`, a filter on the node's loggers, prefixes every line that work logs with the
run's id. A node outside a federation (`shoal client`) has no run and its lines stay as they are.
"""

from __future__ import annotations

import contextvars
import logging

RUN = contextvars.ContextVar("shoal_run", default="")


class RunTag(logging.Filter):
    """Prefix a record with the run of the work that logs it (:data:`RUN`), unless it names it already."""

    def filter(self, record: logging.LogRecord) -> bool:
        run = RUN.get()
        if run and not getattr(record, "run_tagged", False) and run not in record.getMessage():
            record.msg, record.args, record.run_tagged = f"{run}: {record.getMessage()}", None, True
        return True
