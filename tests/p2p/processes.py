"""Real `shoal peer` processes for the process tests: free loopback ports, start (forked warm by
tests/spawn.py: no torch import per peer), /status, bounded waits and a stop that always ends
every process."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import pytest

from tests.ports import free_ports  # noqa: F401 - the peers' tests take their ports from here
from tests.spawn import Forked, python_process

T = TypeVar("T")


def start_peer(args: list[str], token: str, log: Path) -> Forked | subprocess.Popen:
    """``shoal peer --token TOKEN ARGS`` with one torch thread, its output appended to ``log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return python_process(["peer", "--token", token, *args], log, env=env, append=True)


def peer_status(url: str, token: str, ctx: ssl.SSLContext | None = None) -> dict | None:
    """The peer's GET /status, or None while it does not answer."""
    req = urllib.request.Request(f"{url}/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=3, context=ctx) as r:
            return json.load(r)
    except OSError:
        return None


def wait_for(
    pred: Callable[[], T | None], seconds: float, what: str, procs: Iterable[Forked | subprocess.Popen] = ()
) -> T:
    """Poll ``pred`` until it returns something truthy; fail after ``seconds``, or at once when
    one of ``procs`` (those that must stay up) has exited."""
    procs = list(procs)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a peer exited (status {[p.poll() for p in procs]}) while waiting for {what}")
        got = pred()
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def stop_peers(procs: Iterable[Forked | subprocess.Popen]) -> None:
    """SIGTERM every live peer, then wait; a peer that does not stop in 20 s is killed."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
