"""A network of gossip peers in one event loop: each a real p2p.peer.Peer serving on its own
loopback port (``Peer.run``), built from a config and a task as `shoal peer` builds it, so a
test of a whole network costs one torch import, not one per peer. Killing a peer cancels its
run: its site closes and its port refuses, as a SIGKILLed process's would. Every wait is bounded
and leaving the ``async with`` stops every peer still running (torch runs on one thread inside it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from shoal import assembly
from shoal.assembly import task_from_config
from shoal.config import Config
from shoal.p2p.cli import load_peer_data
from shoal.p2p.peer import Peer, PeerSettings
from tests.ports import free_ports

T = TypeVar("T")
TOKEN = "local-network-token"


class LocalNetwork:
    """``n`` peers of ``cfg`` (plain HTTP, one network token); peer ``i`` reads ``data[i]`` as
    ``--data`` (default: ``client:<i>``, client ``i`` of the task's simulation split) and writes
    to ``tmp/peer<i>``."""

    def __init__(self, cfg: Config, n: int, tmp: Path, data: Sequence[str] | None = None):
        self.cfg, self.n, self.tmp = cfg, n, tmp
        self.task = task_from_config(cfg)
        self.data = list(data) if data is not None else [f"client:{i}" for i in range(n)]
        self.ports = free_ports(n)
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.peers: dict[int, Peer] = {}
        self.runs: dict[int, asyncio.Task] = {}
        self.stop = asyncio.Event()

    def build(self, i: int, bootstrap: Sequence[int], cfg: Config | None = None) -> Peer:
        """Peer ``i`` as run_peer (p2p/cli.py) builds it: the task's model seeded by
        simulation.seed, its data, the trainer (DP-SGD under privacy.mode = "local"); ``cfg``
        (default: the network's) may name another task or other task arguments."""
        task = self.task if cfg is None else task_from_config(cfg)
        cfg = cfg or self.cfg
        data = load_peer_data(self.data[i], cfg, task, torch.device("cpu"))
        trainer = assembly.build(cfg, task, "client", device="cpu", example=data.train).trainer
        boot = tuple(self.urls[b] for b in bootstrap)
        return Peer(cfg, trainer, data, PeerSettings(self.urls[i], boot, TOKEN, True, out_dir=self.tmp / f"peer{i}"))

    def start(self, i: int, bootstrap: Sequence[int], cfg: Config | None = None) -> Peer:
        """Build peer ``i`` (a fresh model and view, as a restarted process has) and run it."""
        peer = self.peers[i] = self.build(i, bootstrap, cfg)
        self.runs[i] = asyncio.get_running_loop().create_task(peer.run("127.0.0.1", self.ports[i], self.stop))
        return peer

    def live(self) -> list[int]:
        return sorted(i for i, t in self.runs.items() if not t.done())

    async def kill(self, i: int) -> None:
        """Cancel peer ``i``'s run mid-step: it answers nothing more and its port refuses."""
        run = self.runs[i]
        run.cancel()
        await asyncio.wait({run}, timeout=30)
        assert run.done(), f"peer {i} did not stop within 30 s of being cancelled"

    async def wait_for(self, pred: Callable[[], T | None], seconds: float, what: str) -> T:
        """Poll ``pred`` until it returns something truthy; fail after ``seconds``, or at once
        when a peer that was not killed has stopped (its exception, if any, is raised)."""
        deadline = time.monotonic() + seconds
        while True:
            for i, run in self.runs.items():
                if run.done() and not run.cancelled():
                    run.result()  # a crash raises here
                    pytest.fail(f"peer {i} stopped by itself while waiting for {what}")
            got = pred()
            if got:
                return got
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {seconds} s waiting for {what}; {self.summary()}")
            await asyncio.sleep(0.2)

    def summary(self) -> str:
        """Each peer's steps, accuracy on the central test set and view size, for a failure message."""
        out = []
        for i, p in sorted(self.peers.items()):
            acc = p.runtime.shown_metrics().get("test_accuracy", float("nan"))
            out.append(f"{i}: {p.steps} steps, acc {acc:.3f}, view {len(p.node.membership.view)}")
        return "; ".join(out)

    def statuses(self, idx: Sequence[int]) -> dict[int, dict[str, Any]]:
        """``GET /status`` of each peer in ``idx``, read in-process."""
        return {i: self.peers[i].status() for i in idx}

    async def __aenter__(self) -> LocalNetwork:
        # one intra-op thread, as each `shoal peer` process of the process tests has
        # (OMP_NUM_THREADS=1): ten peers' small steps on two threads each starve a loaded machine
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        runs = [t for t in self.runs.values() if not t.done()]
        if runs:
            _, pending = await asyncio.wait(runs, timeout=30)
            for t in pending:
                t.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        torch.set_num_threads(self._threads)
