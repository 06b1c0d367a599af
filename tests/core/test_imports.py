"""What each job imports: the core (simulate, server, client, peer) needs neither Flower nor Ray,
which come with the optional extra ``shoal[flower]``."""

from __future__ import annotations

import subprocess
import sys

CORE_MODULES = [
    "shoal.cli",
    "shoal.server.app",
    "shoal.server.cli",
    "shoal.client.node",
    "shoal.client.cli",
    "shoal.p2p.peer",
    "shoal.p2p.cli",
    "shoal.simulations.experiment",
    "shoal.simulations.privacy_sweep",
    "shoal.simulations.gossip_sim",
    "shoal.simulations.virtual_run",
]


def test_the_core_jobs_import_neither_flower_nor_ray():
    code = (
        "import importlib, sys\n"
        f"for m in {CORE_MODULES!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flwr', 'ray'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_the_deployed_server_client_and_peer_import_nothing_from_the_simulator():
    code = (
        "import sys\n"
        "import shoal.server.app, shoal.server.cli, shoal.client.node, shoal.client.cli\n"
        "import shoal.p2p.peer, shoal.p2p.cli\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('shoal.simulations'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_importing_shoal_leaves_the_matplotlib_backend_alone(tmp_path):
    code = (
        "import matplotlib\nmatplotlib.use('svg')\n"
        "import shoal.simulations.experiment, shoal.simulations.privacy_sweep, shoal.simulations.report as r\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
        "recs = [{'round': 1, 'test_accuracy': 0.5}, {'round': 2, 'test_accuracy': 0.6}]\n"
        f"r.plot_curves(recs, {str(tmp_path)!r})\n"
        "assert matplotlib.get_backend() == 'svg', matplotlib.get_backend()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
