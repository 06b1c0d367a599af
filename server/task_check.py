"""A submitted run's task is imported and its model built in a worker process, not in the server.

The federation checks that a run can start (its registered task loads with the run's
``[task.args]`` and its model builds) before it is queued. For a user's task that is the
operator's code, but with a researcher's arguments, so it runs in one long-lived worker
(``python -m shoal.server.task_check``) whose address space is capped with ``RLIMIT_AS``
(``federation.task_check_mb``) and whose every check has a time limit (``federation.task_check_s``):
a check over either is killed (the worker with it; the next check starts a new one) and the run
refused. Nothing the check does touches the server's event loop or memory.

The protocol is one JSON line each way: ``{"config": Config.to_dict()}`` in,
``{"ok": true}`` or ``{"error": "one line"}`` out.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MAX_ANSWER = 4096


class TaskChecker:
    """The parent's side: one worker, one check at a time (callers wait on a lock, in a thread)."""

    def __init__(self, memory_mb: int, timeout_s: float, where: str = "federation.task_check"):
        """``where``: the settings of the limits, as refusals name them."""
        self.memory_mb, self.timeout_s, self.where = memory_mb, timeout_s, where
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(
            [sys.executable, "-m", "shoal.server.task_check", str(self.memory_mb), self.where],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )

    def warm(self) -> None:
        """Start the worker now (it imports torch: seconds), so the first submission does not wait."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()

    def check(self, config: dict[str, Any], registered: int | None = None) -> tuple[int | None, str | None]:
        """``(parameters, None)`` when the run's task loads, its model builds (of that many
        parameters) and the run passes the checks it meets at start with ``registered`` nodes;
        ``(None, why not)`` otherwise, in one line."""
        answer = self._ask({"config": config, "registered": registered})
        if isinstance(answer, str):
            return None, answer
        return answer["parameters"], None

    def model_check(self, config: dict[str, Any]) -> tuple[str | None, str | None]:
        """``(spec hash, None)`` when the task of ``config`` loads and builds its model (a node's
        check of a bundle's task before it imports it itself); ``(None, why not)`` otherwise."""
        answer = self._ask({"config": config, "probe": "model"})
        if isinstance(answer, str):
            return None, answer
        if not isinstance(answer.get("spec_hash"), str):
            return None, "the task check's worker answered garbage"
        return answer["spec_hash"], None

    def _ask(self, request: dict[str, Any]) -> dict[str, Any] | str:
        """The worker's answer to one request, or why there is none (one line)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            proc = self.proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request).encode() + b"\n")
                proc.stdin.flush()
            except OSError:
                self._kill()
                return "the task check's worker stopped; try again"
            line = self._read_line(proc, time.monotonic() + self.timeout_s)
            if line is None:
                self._kill()
                return (
                    f"the task did not load and build its model within {self.where}_s = "
                    f"{self.timeout_s:g} s and {self.where}_mb = {self.memory_mb} MiB"
                )
            try:
                answer = json.loads(line)
            except ValueError:
                self._kill()
                return "the task check's worker answered garbage"
            if answer.get("ok") is True and isinstance(answer.get("parameters"), int):
                return answer
            return " ".join(str(answer.get("error", "the task check failed")).split())[:500]

    def _read_line(self, proc: subprocess.Popen, end: float) -> bytes | None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = end - time.monotonic()
                if left <= 0 or len(buf) > MAX_ANSWER or not sel.select(left):
                    return None
                chunk = os.read(fd, MAX_ANSWER)
                if not chunk:  # the worker died (its memory limit, a crash)
                    return None
                buf += chunk
        return buf.split(b"\n", 1)[0]

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        with self.lock:
            if self.proc is not None:
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                self._kill()


def _check(config: dict[str, Any], registered: int | None) -> int:
    from shoal.config import config_from_dict
    from shoal.server.service import ServerService
    from shoal.task import load_task

    cfg = config_from_dict(config).validate()
    task = load_task(cfg.task.app, cfg.task.args) if cfg.task.app else None
    return ServerService.from_config(cfg, task, registered).spec.numel


def _model(config: dict[str, Any]) -> dict[str, Any]:
    """The task's model built as every engine builds it: its size and layout hash."""
    from shoal.assembly import initial_model
    from shoal.config import config_from_dict
    from shoal.params import ParamSpec
    from shoal.task import load_task

    cfg = config_from_dict(config).validate()
    task = load_task(cfg.task.app, cfg.task.args)
    model = initial_model(cfg, task)
    spec = ParamSpec.of(model, exchange_buffers=task.exchange_buffers).with_base(model)
    return {"ok": True, "parameters": spec.numel, "spec_hash": spec.hash}


def _answer(line: bytes) -> dict[str, Any]:
    """The answer to a request of the parent (a server's or a node's, never a user's)."""
    request = json.loads(line)
    if request.get("probe") == "model":
        return _model(request["config"])
    registered = request.get("registered")
    return {"ok": True, "parameters": _check(request["config"], registered if isinstance(registered, int) else None)}


def main() -> None:
    import resource

    limit = int(sys.argv[1]) << 20
    where = sys.argv[2] if len(sys.argv) > 2 else "federation.task_check"
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.CRITICAL)
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        try:
            answer = _answer(line)
        except MemoryError:
            answer = {"error": f"the task's model did not fit in {where}_mb = {sys.argv[1]} MiB"}
        except BaseException as e:  # anything the task's code raises is its answer, not the worker's end
            text = f"{type(e).__name__}: {e}"
            if "memory" in text.lower():  # torch's allocator says so in its own words
                text = f"over {where}_mb = {sys.argv[1]} MiB: {text}"
            answer = {"error": text[:500]}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
