"""Local DP (DP-SGD) on deployed peers: each peer's epsilon over its own trainings, accounted as
the gossip simulator accounts its peers; ``privacy.target_epsilon`` stops a peer; a peer has
no server, so central and distributed DP are refused."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.p2p.cli import run_peer
from shoal.simulations.gossip import GossipSimulation

from .network import LocalNetwork

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
def test_three_dp_peers_report_the_simulators_epsilon_and_stop_at_the_target(tmp_path, caplog):
    """Three peers with DP-SGD (tests/p2p/network.py: built as `shoal peer` builds them, in one
    event loop), gossip.rounds = 3: each one's final record has the epsilon the simulator's
    accountant gives that peer (same shard, schedule and noise) for its trainings. Peer 2 also has
    privacy.target_epsilon between its epsilon after 2 and after 3 trainings: it stops by itself
    after 2."""
    sim = GossipSimulation.from_config(load_config(None, [*DP, 'simulation.mode="gossip"', "output.plots=false"]))
    target = (_simulated_epsilon(sim, 2, 2) + _simulated_epsilon(sim, 2, 3)) / 2
    cfg = load_config(None, [*DP, "gossip.rounds=3"])
    capped = load_config(None, [*DP, "gossip.rounds=3", f"privacy.target_epsilon={target}"])

    async def main() -> None:
        async with LocalNetwork(cfg, 3, tmp_path) as net:
            for i in range(3):
                net.start(i, [(i + 1) % 3], capped if i == 2 else None)
            _, pending = await asyncio.wait(net.runs.values(), timeout=180)
            assert not pending, f"the peers did not finish their 3 rounds in 180 s; {net.summary()}"
            for run in net.runs.values():
                run.result()  # none crashed
            assert all(p.errors == 0 for p in net.peers.values())

    with caplog.at_level(logging.WARNING, logger="shoal.accounting"):
        asyncio.run(main())
    for i, trainings in enumerate([3, 3, 2]):
        records = [json.loads(x) for x in (tmp_path / f"peer{i}" / "metrics.jsonl").read_text().splitlines()]
        last = records[-1]
        assert last["round"] == last["dp_trainings"] == trainings and last["delta"] == 1e-5, (i, last)
        assert last["epsilon"] == pytest.approx(_simulated_epsilon(sim, i, trainings), rel=1e-12), i
        assert last["epsilon"] > 0 and last["final"] is True and torch.isfinite(torch.tensor(last["test_loss"]))
    assert records[-1]["epsilon"] <= target
    assert "privacy budget reached" in caplog.text
