"""SIGINT and SIGTERM as a call on the running event loop: how every long-running shoal process
(server, edge, node, daemon, peer) is told to stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable


def on_stop_signals(callback: Callable[[], object]) -> None:
    """Call ``callback`` on SIGINT or SIGTERM. Where the loop cannot take signal handlers (not the
    main thread, or a platform without them) nothing is installed and the owner stops the process."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, callback)
        except (NotImplementedError, RuntimeError):
            pass
