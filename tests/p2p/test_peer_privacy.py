"""A deployed peer does not train with DP: ``shoal peer`` refuses [privacy] instead of ignoring it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.p2p.cli import run_peer


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_run_peer_refuses_privacy_before_serving(mode):
    cfg = load_config(None, [f'privacy.mode="{mode}"'])
    with pytest.raises(ConfigError, match=f"privacy.mode = '{mode}'.*does not train with differential privacy"):
        run_peer(cfg, "127.0.0.1:1", "", "client:0", None, None, None, None, None, True, None)


def test_shoal_peer_with_local_dp_is_one_error_line():
    r = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "peer", "--insecure", "--listen", "127.0.0.1:1", "--data", "client:0"]
        + ["--set", 'privacy.mode="local"'],
        capture_output=True,
        text=True,
        timeout=100,
    )
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "privacy.mode = 'local'" in lines[0] and "simulation.mode = 'gossip'" in lines[0], lines[0]
