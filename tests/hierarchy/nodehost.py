"""A node host: many nodes in one process, each the real node (client/node.py's ``Node``: its own
model, trainer and HTTP session, its list of servers to re-attach through), all on one event loop.
A `shoal client` process per node imports torch once each (~370 MB): 100 of them do not fit a test
machine, 100 nodes in 4 hosts do.

    python -m tests.hierarchy.nodehost SPEC.json

SPEC: ``{"config": path, "nodes": [{"name", "shard", "token_file", "servers"}], "dropout": p,
"seed": s, "silent": [names], "events": path}``. With ``dropout`` p > 0 a node drops out of a round
with probability p (decided from seed, its name and the round, so a run can be replayed): it trains,
sends nothing, and does not train that task again (in a secure round it leaves the protocol after
sharing its keys, before its masked input: the drop-out the protocol recovers from); a node named
in ``silent`` drops out of every round. Every upload's outcome goes to ``events`` (one JSON line:
node, round, version, the server it went to, ``accepted`` / ``refused`` / ``dropped``; in secure
rounds ``masked`` when its masked input was taken): the robustness bench checks the root's counts
against it. SIGTERM/SIGINT stop every node; the host exits 0 when
every node ended (the servers said done)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import sys
from pathlib import Path

import torch

from shoal.client.node import Node
from shoal.client.task_message import TaskMessage
from shoal.config import load_config
from shoal.errors import ShoalError
from shoal.pki import read_secret
from shoal.shards import load_shard


class DroppedOut(ShoalError):
    """This node's coin: it leaves the round here."""

    code = "dropped_out"


class HostedNode(Node):
    """The real node, with a drop-out coin per round and its uploads written down."""

    dropout = 0.0
    seed = 0
    silent: set[str] = set()
    events: Path | None = None

    def note(self, event: dict) -> None:
        if self.events is not None:
            with self.events.open("a") as f:  # at once: a host killed mid-run keeps what happened
                f.write(json.dumps(event) + "\n")

    task_now: TaskMessage | None = None

    def drops(self, round_: object) -> bool:
        return self.name in self.silent or (
            self.dropout > 0 and random.Random(f"{self.seed}:{self.name}:{round_}").random() < self.dropout
        )

    async def _work(self, task: TaskMessage) -> None:
        self.task_now = task
        await super()._work(task)

    async def _request(self, method: str, path: str, **kw) -> dict:
        """Secure rounds: the coin makes the node vanish before its masked input (after its keys)."""
        task = self.task_now or TaskMessage("none")
        event = {"node": self.name, "round": task.round, "version": task.version, "server": self.url}
        if path == "/v1/secagg/masked" and self.drops(task.round):
            self.failed_tasks.add(task.key)
            self.note({**event, "outcome": "dropped"})
            raise DroppedOut("dropped out before its masked input")
        answer = await super()._request(method, path, **kw)
        if path == "/v1/secagg/masked":
            self.note({**event, "outcome": "masked"})
        return answer

    async def _upload(self, task: TaskMessage, body) -> bool:  # type: ignore[no-untyped-def]
        event = {"node": self.name, "round": task.round, "version": task.version, "server": self.url}
        if self.drops(task.round):
            self.failed_tasks.add(task.key)  # gone for this round
            self.note({**event, "outcome": "dropped"})
            return False
        accepted = await super()._upload(task, body)
        self.note({**event, "outcome": "accepted" if accepted else "refused"})
        return accepted


async def main(spec: dict) -> int:
    torch.set_num_threads(1)
    cfg = load_config(Path(spec["config"]))
    HostedNode.dropout = float(spec.get("dropout", 0.0))
    HostedNode.seed = int(spec.get("seed", 0))
    HostedNode.silent = set(spec.get("silent", []))
    HostedNode.events = Path(spec["events"]) if spec.get("events") else None
    nodes = [
        HostedNode.from_config(
            n["servers"],
            read_secret(Path(n["token_file"]), "token_file"),
            load_shard(Path(n["shard"])),
            cfg,
            torch.device("cpu"),
            poll_s=cfg.server.poll_s,
            name=n["name"],
        )
        for n in spec["nodes"]
    ]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: [n.stop.set() for n in nodes])
    codes = await asyncio.gather(*(n.run(signals=False) for n in nodes), return_exceptions=True)
    failed = [(n.name, c) for n, c in zip(nodes, codes) if c != 0]
    for name, c in failed:
        logging.error("node %s ended with %r", name, c)
    return 1 if failed else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(asyncio.run(main(json.loads(Path(sys.argv[1]).read_text()))))
