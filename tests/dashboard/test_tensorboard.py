"""[output] tensorboard = true: event files beside metrics.jsonl with the same numbers, read back
with tensorboard's EventAccumulator, for the virtual-clock (async) and gossip simulations, a gossip
peer process and the server (the in-process, Ray and Flower engines: tests/ray, tests/flower)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.simulations.experiment import run_simulation
from shoal.tensorboard import TensorBoardLog

from .events import assert_events_match_metrics

SMALL = [
    "simulation.num_clients=8",
    "simulation.clients_per_round=4",
    "simulation.rounds=4",
    "simulation.progress=false",
    "output.plots=false",
    "output.tensorboard=true",
]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_virtual_clock_async_run(tmp_path):
    cfg = load_config(
        None,
        [*SMALL, 'simulation.mode="async"', "asynchronous.buffer_size=2", "asynchronous.concurrency=4"],
    )
    run_simulation(cfg, tmp_path)
    got = assert_events_match_metrics(tmp_path, ("test_accuracy", "virtual_time_s", "staleness_mean"))
    assert [s for s, _ in got["test_accuracy"]] == [0, 1, 2, 3, 4]  # at each version


def test_gossip_simulation(tmp_path):
    cfg = load_config(
        None,
        [*SMALL, 'simulation.mode="gossip"', "gossip.view_size=4", "gossip.shuffle_length=2", "train.batch_size=20"],
    )
    run_simulation(cfg, tmp_path)
    assert_events_match_metrics(tmp_path, ("test_accuracy",))


def test_server_run(tmp_path):
    """Two nodes and the server's clock run 3 real rounds over HTTP (the server evaluates centrally)."""
    from shoal.client.node import Node
    from shoal.shards import Shard

    from ..server.live import live_server

    async def scenario():
        sections = {"output": {"tensorboard": True}}
        async with live_server(tmp_path, ["n0", "n1"], clock=True, sections=sections, min_nodes=2, rounds=3) as live:
            cfg = live.service.cfg
            nodes = [
                Node.from_config(
                    live.url,
                    live.tokens[n],
                    Shard(n, torch.randn(30, 60), torch.randint(0, 10, (30,)), 10),
                    cfg,
                    torch.device("cpu"),
                    poll_s=1.0,
                )
                for n in ("n0", "n1")
            ]
            assert await asyncio.gather(*(n.run() for n in nodes)) == [0, 0]

    asyncio.run(asyncio.wait_for(scenario(), 60))
    got = assert_events_match_metrics(tmp_path / "run", ("train_loss", "num_results"))
    assert [s for s, _ in got["train_loss"]] == [1, 2, 3]


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"pip install 'shoal\[tensorboard\]'"):
        TensorBoardLog(tmp_path)
