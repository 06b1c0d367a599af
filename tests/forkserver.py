"""A warm start for the process tests' `shoal` processes: this process imports torch and shoal's
heavy modules once (2-3 s of CPU each time a fresh Python does it), then forks one child per
request. Each child is a real process running the real entry point (``python -m MODULE ARGS`` or
``python SCRIPT ARGS``) with its own arguments, environment, working directory, session and log
file, exactly as if it had been exec'd; only the import is shared. tests/spawn.py drives it.

Protocol (one JSON object per line): requests on stdin ``{"id", "module" | "path", "argv", "cwd",
"env", "log", "err", "append", "session", "preload"}`` (``err``: stderr's own file, else it goes
with stdout to ``log``; ``preload``: modules this process imports before this fork and keeps for
the next ones, e.g. transformers for the Hugging Face tests, which no other test pays for);
answers on stdout ``{"id", "pid"}`` (or ``{"id", "error"}``), then ``{"exit": pid, "status":
code}`` when a child ends (code < 0: killed by that signal). It exits when stdin closes
(the pytest worker ended).

Nothing here runs a torch op before forking, so no thread pool exists to be copied half-made; a
child reseeds what a fresh interpreter would have seeded from the OS (numpy's global generator).
"""

from __future__ import annotations

import atexit
import gc
import io
import json
import logging
import os
import runpy
import select
import signal
import sys
import threading
from collections.abc import Iterable
from typing import Any

# what `shoal server/client/node/peer` import (not shoal.cli itself: it runs as __main__, as with -m)
PRELOAD = (
    "torch",
    "numpy",
    "aiohttp",
    "shoal.client.cli",
    "shoal.server.cli",
    "shoal.p2p.cli",
    "shoal.client.node",
    "shoal.server.app",
    "shoal.server.edge.app",
    "shoal.p2p.peer",
    # imported on first use by DP runs (2 s of CPU), DP-SGD nodes (1.6 s) and runs that plot (1 s)
    "dp_accounting",
    "shoal.client.dp_sgd",
    "matplotlib.figure",
)


def _preload(names: Iterable[str]) -> None:
    """Import ``names`` and leave the root logger as a fresh interpreter has it: opacus calls
    logging.basicConfig when imported, and a child's own basicConfig (the CLI's) would then do nothing."""
    for name in names:
        try:
            __import__(name)
        except ImportError:
            pass  # the child's own import says why
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def _reap(out: Any) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write(json.dumps({"exit": pid, "status": code}) + "\n")
        out.flush()


def serve() -> dict[str, Any] | None:
    """Answer requests until stdin closes (returns None); in a forked child, return its request."""
    _preload(PRELOAD)
    out = os.fdopen(os.dup(1), "w")
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    buf = b""
    while True:
        try:
            ready, _, _ = select.select([0, wake_r], [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(out)
        if 0 not in ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            _preload(req.get("preload") or ())  # imported here once, for this child and the next ones
            gc.freeze()  # the children's exit scan (_exit) skips everything made before the fork
            try:
                pid = os.fork()
            except OSError as e:
                out.write(json.dumps({"id": req["id"], "error": str(e)}) + "\n")
                out.flush()
                continue
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (wake_r, wake_w, out.fileno()):
                    os.close(fd)
                return req
            out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
            out.flush()


def run_child(req: dict[str, Any]) -> None:
    """Become the requested process: session, directory, environment, log file, then the entry
    point as ``__main__``; then it exits as the interpreter would (SystemExit's code, threads
    joined, atexit run, files flushed) but without the module teardown (see :func:`_exit`); an
    uncaught exception still ends it the interpreter's way (traceback, status 1)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if req.get("session"):
        os.setsid()
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if req.get("append") else os.O_TRUNC)
    log = os.open(req["log"], flags, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if req.get("err"):  # stderr to its own file
        err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 2)
        os.close(err)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, for its lifetime
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    import numpy as np
    import torch

    np.random.seed()  # a fresh interpreter seeds numpy's global generator from the OS at import
    threads = req["env"].get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    try:
        if "module" in req:
            sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
            sys.argv = [req["module"], *req["argv"]]
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [req["path"], *req["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(req["path"]))
            runpy.run_path(req["path"], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    else:
        code = 0
    _exit(code)


def _exit_code(code: Any) -> int:
    """SystemExit's code as the interpreter turns it into an exit status (a message goes to stderr)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """Exit as the interpreter would (threads joined, atexit handlers run, logs and streams flushed)
    but without tearing down the modules inherited from the fork server: that teardown writes to
    every inherited page (copied on write) and cost each child 2-3 s of CPU, more than its work."""
    threading._shutdown()  # type: ignore[attr-defined]  # joins non-daemon threads, as at exit
    atexit._run_exitfuncs()
    logging.shutdown()
    # files the program left open are flushed as their teardown would have; the fork server froze
    # what it made, so only this child's objects are looked at
    for obj in [*gc.get_objects(), sys.stdout, sys.stderr]:
        if isinstance(obj, io.IOBase):
            try:
                obj.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


if __name__ == "__main__":
    job = serve()
    if job is not None:
        run_child(job)
