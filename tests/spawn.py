"""Start the process tests' `shoal` processes (servers, nodes, edges, peers) warm: forked by one
tests/forkserver.py per pytest worker, which imported torch and shoal once, instead of a fresh
``python -m shoal.cli`` that imports them again (2-3 s of CPU a process; a process test starts 5 to
10). The child is a real process with its own pid, session, environment, working directory and
log file; :class:`Forked` answers as :class:`subprocess.Popen` does (poll, wait, send_signal, kill,
returncode < 0 for a signal). ``SHOAL_TEST_SPAWN=exec`` starts every process with a plain exec."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class _Server:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("OMP_NUM_THREADS", None)  # each child sets its own torch threads
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.forkserver"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.pids: dict[int, int | str] = {}
        self.exits: dict[int, int] = {}
        self.next_id = 0
        first = json.loads(self.proc.stdout.readline() or b'{"ready": null}')
        if not first.get("ready"):
            raise RuntimeError("tests/forkserver.py did not start")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "exit" in msg:
                    self.exits[msg["exit"]] = msg["status"]
                else:
                    self.pids[msg["id"]] = msg.get("pid") or msg.get("error", "fork failed")
                    self.exits.pop(msg.get("pid"), None)  # a reused pid: the earlier child's exit is not this one's
                self.cond.notify_all()
        with self.cond:  # the server is gone: nothing more will be answered
            self.proc.wait()
            self.cond.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def start(self, req: dict[str, Any]) -> int:
        with self.lock:
            self.next_id += 1
            rid = req["id"] = self.next_id
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        with self.cond:
            if not self.cond.wait_for(lambda: rid in self.pids or not self.alive(), 60):
                raise RuntimeError("tests/forkserver.py did not answer in 60 s")
            got = self.pids.pop(rid, "the fork server exited")
        if isinstance(got, str):
            raise OSError(got)
        return got

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_server: _Server | None = None
_server_lock = threading.Lock()


def _fork_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = _Server()
            atexit.register(_server.close)
        return _server


class Forked:
    """A child of the fork server, answering as subprocess.Popen does."""

    def __init__(self, server: _Server, pid: int, args: list[str]):
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            with self._server.cond:
                self.returncode = self._server.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        with self._server.cond:
            while self.pid not in self._server.exits:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                if not self._server.alive():  # its parent is gone: the child was reparented, poll the pid
                    self._server.cond.release()
                    try:
                        return self._wait_orphan(end)
                    finally:
                        self._server.cond.acquire()
                self._server.cond.wait(left if left is not None else 1.0)
            self.returncode = self._server.exits[self.pid]
        return self.returncode

    def _wait_orphan(self, end: float | None) -> int:
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = self.returncode if self.returncode is not None else -9
                return self.returncode
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(self.args, 0)
            time.sleep(0.1)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


def python_process(
    argv: list[str],
    log: Path,
    *,
    module: str | None = "shoal.cli",
    script: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    append: bool = False,
    new_session: bool = True,
    err: Path | None = None,
    preload: tuple[str, ...] = (),
) -> Forked | subprocess.Popen:
    """``python -m MODULE ARGV`` (or ``python SCRIPT ARGV``) with stdout and stderr to ``log``
    (stderr to ``err`` if given), forked warm unless ``SHOAL_TEST_SPAWN=exec``; ``preload``: heavy
    modules the child will import, imported once by the fork server (and kept for later children)."""
    env = dict(os.environ if env is None else env)
    cwd = cwd or Path.cwd()
    entry = ["-m", module] if script is None else [str(script)]
    if os.environ.get("SHOAL_TEST_SPAWN", "fork") == "exec":
        with log.open("ab" if append else "wb") as out, (err or log).open("ab" if err is None else "wb") as errs:
            return subprocess.Popen(
                [sys.executable, *entry, *argv],
                stdout=out,
                stderr=subprocess.STDOUT if err is None else errs,
                env=env,
                cwd=cwd,
                start_new_session=new_session,
            )
    server = _fork_server()
    req: dict[str, Any] = {"argv": [str(a) for a in argv], "cwd": str(cwd), "env": env, "log": str(log.absolute())}
    req.update({"append": append, "session": new_session, "err": str(err.absolute()) if err else None})
    req["preload"] = list(preload)
    req.update({"module": module} if script is None else {"path": str(script)})
    return Forked(server, server.start(req), [sys.executable, *entry, *argv])


def run_python(
    argv: list[str],
    *,
    module: str | None = "shoal.cli",
    script: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 300,
    preload: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """:func:`subprocess.run` of ``python -m MODULE ARGV`` with its output captured as text, started
    as :func:`python_process` starts it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shoal-run-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        p = python_process(
            argv, out, module=module, script=script, env=env, cwd=cwd, new_session=False, err=err, preload=preload
        )
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
            raise
        cmd = [sys.executable, *(["-m", module] if script is None else [str(script)]), *argv]
        return subprocess.CompletedProcess(cmd, rc, out.read_text(), err.read_text())


def kill_group(p: Forked | subprocess.Popen, timeout: float = 10) -> None:
    """SIGKILL ``p``'s process group (a process started in its own session) and wait for it. A group
    already gone is fine: a forked child can have exited and been reaped by the fork server before
    its exit reached :meth:`Forked.poll`."""
    import signal

    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout)
