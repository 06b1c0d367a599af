"""What every `shoal` sub-command shares (the top command's and those of server/, client/, p2p/):
``--task`` folded into the ``--set`` overrides, and the logging setup. A module of its own, so the
sub-commands' modules need not import the top command that imports them."""

from __future__ import annotations

import json
import logging


def with_task(set_: list[str] | None, task: str | None) -> list[str]:
    """The --set overrides, plus ``task.app`` when ``--task`` is given."""
    out = list(set_ or [])
    if task:
        out.append(f"task.app={json.dumps(task)}")
    return out


def setup_logging(verbose: bool, quiet: bool = False) -> None:
    """Log to stderr; no token, cookie or Authorization header reaches a line (shoal/log_redaction.py)."""
    from shoal.log_redaction import install

    install()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )
