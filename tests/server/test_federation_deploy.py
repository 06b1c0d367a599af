"""The README's federation walk-through, run as written (real processes over TLS on 127.0.0.1),
then SIGKILL of the server in the middle of two runs: both resume, and each final model equals
the fault-free run's of the walk-through bit for bit; then SIGTERM in the middle of a run stops
the server within 5 s with its checkpoint and metrics in agreement. No node daemon is restarted.

The runs select 2 of 3 nodes a round, so each round's weighted sum has two terms and is the same
whatever order the uploads arrive in (float addition of two terms commutes): the final models of
two runs with one config are equal bit for bit, with or without a restart in the middle.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from safetensors.torch import load_file

from shoal.server.checkpoint import latest_checkpoint, load_checkpoint
from shoal.tls import client_context
from tests.p2p.processes import free_ports

ROOT = Path(__file__).resolve().parents[2]


def walkthrough(port: int) -> str:
    """The sh blocks of the README's federation section, on ``port`` instead of 8443."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("<!-- walkthrough:") : text.index("## Gossip without a server")]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, "the README's walk-through lost its sh blocks"
    return "set -euo pipefail\n" + "\n".join(blocks).replace("8443", str(port))


ROUNDS = 60  # of each run in the README


def _env(port: int) -> dict:
    """The walk-through's environment: this Python's bin first, the `shoal run` settings it exports."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "SHOAL_SERVER": f"https://127.0.0.1:{port}",
        "SHOAL_TOKEN_FILE": "admin.token",
        "SHOAL_CA_CERT": "pki/ca.pem",
    }


def _dump(fed: Path) -> str:
    logs = sorted(fed.glob("*.log")) if fed.exists() else []
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in logs)


def _shoal_run(fed: Path, port: int, *args: str, timeout: float = 60) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "run", *args],
        cwd=fed,
        env=_env(port),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"shoal run {args}: {out.stdout}{out.stderr}\n{_dump(fed)}"
    return out.stdout


def _api(fed: Path, port: int, path: str, body: dict | None = None) -> dict:
    """/v1/runs as `shoal run` calls it, without a process per call (the two runs start together)."""
    req = urllib.request.Request(
        f"https://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {(fed / 'admin.token').read_text().strip()}"},
    )
    with urllib.request.urlopen(req, timeout=10, context=client_context(fed / "pki" / "ca.pem")) as resp:
        return json.loads(resp.read())


def _run_toml(fed: Path, name: str) -> dict:
    return tomllib.loads((fed / name).read_text())


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_readme_walkthrough_then_sigkill_in_the_middle_of_two_runs(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    (port,) = free_ports(1)
    script = tmp_path / "walkthrough.sh"
    script.write_text(walkthrough(port))
    fed = tmp_path / "fed"
    env = _env(port)
    # the walk-through's server and node daemons stay up after the script: one process group to end
    shell = subprocess.Popen(
        ["bash", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=(tmp_path / "walkthrough.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    servers: list[subprocess.Popen] = []
    try:
        try:
            rc = shell.wait(300)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"walk-through rc {rc}:\n{(tmp_path / 'walkthrough.log').read_text()[-4000:]}\n{_dump(fed)}"
        listing = _shoal_run(fed, port, "list")
        assert [line.split("\t")[:2] for line in listing.splitlines()] == [
            [f"run-{i}", "finished"] for i in range(1, 5)
        ], listing
        for i in (3, 4):  # the two at once, followed to their end
            lines = [json.loads(x) for x in (fed / f"run-{i}.jsonl").read_text().splitlines()]
            assert [r["version"] for r in lines if "evaluation" not in r] == list(range(1, ROUNDS + 1)), lines
        pulled = fed / "results" / "run-4"
        assert json.loads((pulled / "summary.json").read_text())["status"] == "finished"
        assert len((pulled / "metrics.jsonl").read_text().splitlines()) >= ROUNDS
        status = json.loads(_shoal_run(fed, port, "status", "run-4"))
        assert {n: v["answer"] for n, v in status["nodes"].items()} == {f"node{i}": "joined" for i in range(3)}

        # SIGKILL the server while two runs train, start it again: both go on from their checkpoints
        regression = "regression"  # as `shoal server tasks add` registered it
        a = _api(fed, port, "/v1/runs", {"task": "builtin", "config": _run_toml(fed, "run-logreg.toml")})["run"]
        b = _api(fed, port, "/v1/runs", {"task": regression, "config": _run_toml(fed, "run-regression.toml")})["run"]
        assert (a, b) == ("run-5", "run-6")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            versions = {run: _api(fed, port, f"/v1/runs/{run}").get("version", 0) for run in (a, b)}
            if all(v >= 2 for v in versions.values()):
                break
            time.sleep(0.02)
        assert all(2 <= v < ROUNDS for v in versions.values()), versions
        os.kill(int((fed / "server.pid").read_text()), signal.SIGKILL)
        time.sleep(1.0)  # the nodes see the server gone and back off
        servers.append(
            subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "server", "-c", "federation.toml"],
                cwd=fed,
                env=env,
                stdout=(fed / "server-restarted.log").open("w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        for run in (a, b):
            _shoal_run(fed, port, "logs", run, "--follow", timeout=120)
        log = (fed / "server-restarted.log").read_text()
        assert "run-5 resumed" in log and "run-6 resumed" in log, log
        for run, reference in ((a, "run-3"), (b, "run-4")):
            summary = json.loads((fed / "runs" / run / "summary.json").read_text())
            assert summary["status"] == "finished" and summary["version"] == ROUNDS, summary
            got = load_file(fed / "runs" / run / "model.safetensors")
            want = load_file(fed / "runs" / reference / "model.safetensors")
            assert got.keys() == want.keys()
            assert all(got[k].numpy().tobytes() == want[k].numpy().tobytes() for k in got), run

        # SIGTERM while a run trains (nodes polling and uploading): the server exits cleanly (a bound,
        # not a speed: a held long-poll would keep it 30 s), and what it made is whole: the run's
        # newest checkpoint and its last metrics line agree
        c = _api(fed, port, "/v1/runs", {"task": "builtin", "config": _run_toml(fed, "run-logreg.toml")})["run"]
        while _api(fed, port, f"/v1/runs/{c}").get("version", 0) < 2:
            time.sleep(0.02)
        servers[-1].send_signal(signal.SIGTERM)
        assert servers[-1].wait(25) == 0
        ckpt = latest_checkpoint(fed / "runs" / c / "checkpoints")
        assert ckpt is not None
        version = load_checkpoint(ckpt)[1]["version"]
        lines = [json.loads(x) for x in (fed / "runs" / c / "metrics.jsonl").read_text().splitlines()]
        assert 2 <= version < ROUNDS and max(r["version"] for r in lines if "evaluation" not in r) == version
        for i in range(3):  # each node daemon started once and took part in all seven runs
            log = (fed / f"node{i}.log").read_text()
            assert log.count(" joins ") == 1 and log.count(" joined: task ") == 7, log[-3000:]
    finally:
        for p in [shell, *servers]:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)
