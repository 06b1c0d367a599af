"""Local DP (DP-SGD) on deployed peers: each peer's epsilon over its own trainings, accounted as
the gossip simulator accounts its peers; ``privacy.target_epsilon`` stops a peer; a peer has
no server, so central and distributed DP are refused."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.p2p.cli import run_peer
from shoal.simulations.gossip import GossipSimulation

from .processes import free_ports, start_peer, stop_peers, wait_for

TOKEN = "dp-peer-token"
DP = [
    "simulation.num_clients=3",
    "simulation.seed=3",
    'model.name="logreg"',
    "train.batch_size=20",
    "train.lr=0.05",
    'privacy.mode="local"',
    "privacy.noise_multiplier=1.0",
    "privacy.delta=1e-5",
    "gossip.period=0.5",
    "gossip.timeout=2.0",
]


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_run_peer_refuses_server_side_privacy_before_serving(mode):
    cfg = load_config(None, [f'privacy.mode="{mode}"'])
    with pytest.raises(ConfigError, match=f"privacy.mode = '{mode}': a gossip peer has no server"):
        run_peer(cfg, "127.0.0.1:1", "", "client:0", None, None, None, None, None, True, None)


def _simulated_epsilon(sim: GossipSimulation, peer: int, trainings: int) -> float:
    """The simulator's epsilon of ``peer`` after ``trainings`` local trainings (its accountant)."""
    assert sim.privacy is not None
    acc = sim.privacy.accountant
    acc.participations = {sim.ids[peer]: trainings}
    return acc.epsilon


@pytest.mark.timeout(240)
def test_three_dp_peers_report_the_simulators_epsilon_and_stop_at_the_target(tmp_path):
    """Three real peers with DP-SGD, gossip.rounds = 3: each one's final record has the epsilon the
    simulator's accountant gives that peer (same shard, schedule and noise) for its trainings.
    Peer 2 also has privacy.target_epsilon between its epsilon after 2 and after 3 trainings:
    it stops by itself after 2."""
    sim = GossipSimulation.from_config(load_config(None, [*DP, 'simulation.mode="gossip"', "output.plots=false"]))
    target = (_simulated_epsilon(sim, 2, 2) + _simulated_epsilon(sim, 2, 3)) / 2
    ports = free_ports(3)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    for i in range(3):
        args = ["--insecure", "--listen", f"127.0.0.1:{ports[i]}", "--bootstrap", urls[(i + 1) % 3]]
        args += ["--data", f"client:{i}", "--out", str(tmp_path / f"peer{i}")]
        for s in [*DP, "gossip.rounds=3", *([f"privacy.target_epsilon={target}"] if i == 2 else [])]:
            args += ["--set", s]
        procs.append(start_peer(args, TOKEN, tmp_path / f"peer{i}.log"))
    try:
        wait_for(lambda: all(p.poll() is not None for p in procs) or None, 180, "the peers to finish")
    finally:
        stop_peers(procs)
    assert all(p.returncode == 0 for p in procs)
    for i, trainings in enumerate([3, 3, 2]):
        records = [json.loads(x) for x in (tmp_path / f"peer{i}" / "metrics.jsonl").read_text().splitlines()]
        last = records[-1]
        assert last["round"] == last["dp_trainings"] == trainings and last["delta"] == 1e-5, (i, last)
        assert last["epsilon"] == pytest.approx(_simulated_epsilon(sim, i, trainings), rel=1e-12), i
        assert last["epsilon"] > 0 and last["final"] is True and torch.isfinite(torch.tensor(last["test_loss"]))
        assert "Traceback" not in (tmp_path / f"peer{i}.log").read_text()
    assert records[-1]["epsilon"] <= target
    assert "privacy budget reached" in (tmp_path / "peer2.log").read_text()
