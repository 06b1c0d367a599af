"""Progress where a person waits, on a terminal (a pseudo-terminal here): `shoal privacy-sweep` says
which setting trains and its round and epsilon so far, not only when a setting is done; the async
(virtual-clock) simulator's bar moves at every version."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

CONFIG = """
[simulation]
rounds = 3
num_clients = 6
clients_per_round = 3
[train]
batch_size = 10
lr = 0.05
[model]
name = "logreg"
[privacy]
sweep_modes = ["central"]
sweep_noise_multipliers = [1.0]
mia_samples = 100
canaries = 0
"""


def _on_a_terminal(args: list[str], timeout: float = 180) -> str:
    """``shoal ARGS`` with a 200-column pseudo-terminal as stdin, stdout and stderr: what it showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))  # wide: no line is cut
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200", "TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", *args], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
    )
    os.close(slave)
    out = b""
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the terminal closed: the process is gone
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(10) == 0, out.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return out.decode(errors="replace")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_privacy_sweep_shows_the_setting_and_round_on_a_terminal(tmp_path):
    (tmp_path / "sweep.toml").write_text(CONFIG)
    text = _on_a_terminal(["privacy-sweep", "-c", str(tmp_path / "sweep.toml"), "-o", str(tmp_path)])
    assert "setting 2 of 2: central z=1" in text  # the log line as a setting starts
    assert "central z=1: round 3 of 3, epsilon" in text, text[-3000:]  # the bar while it trains


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_async_simulation_shows_each_version_on_a_terminal(tmp_path):
    args = ["simulate", "-o", str(tmp_path), "--set", 'simulation.mode="async"', "--set", "simulation.rounds=4"]
    args += [
        "--set",
        "simulation.num_clients=8",
        "--set",
        "simulation.clients_per_round=4",
        "--set",
        "output.plots=false",
    ]
    text = _on_a_terminal(args)
    for version in range(1, 5):  # the bar at every version, with its accuracy
        assert f"{version}/4" in text, text[-3000:]
    assert "acc 0." in text
