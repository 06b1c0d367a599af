"""The Ray engine's worker side: a long-lived actor that trains many clients per call.

A :class:`RayWorker` holds one model replica, the trainer and the batched trainer, built by
shoal.assembly with the in-process engine's rules, and runs each client through the same client
pipeline (client/pipeline.py) as the in-process engine; the task is rebuilt from the config's
``[task] app`` (a task object does not travel) and the clients' data are loaded once per worker
(:class:`WorkerData`), never shipped per call. Each client trains with its assignment's seed (its
batches and its dropout draws alike), so its update does not depend on the worker that trains it.
A client's state travels with its assignment (the driver keeps the store) and the new state comes
back with the update. The driver side is simulations/ray_engine.py.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shoal import assembly
from shoal.assembly import Batching, task_from_config
from shoal.client.algorithms import ClientResult
from shoal.client.device import select_device
from shoal.client.pipeline import ClientPipeline
from shoal.config import Config
from shoal.errors import WireError
from shoal.rounds import Assignment
from shoal.task import ClientData

from .attacks import choose_attackers
from .client_data import ClientShards, PopulationShards, client_id, load_population, load_simulation_data
from .gossip.network import peer_id
from .wire_step import WireStep

if TYPE_CHECKING:
    from shoal.task import Task


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker builds itself from; sent with every call (small), so a restarted worker
    (or one that served another run) rebuilds when the ``key`` it holds differs."""

    key: str
    cfg: Config
    sample_size: int  # K: bounds the batched trainer's chunk, as in-process
    max_client_size: int  # the largest client: sizes that chunk, as in-process


@dataclass(frozen=True)
class WorkItem:
    """One assignment as a worker receives it: the client's index in the task's data, the
    assignment, and the client's state (client/state.py) when the algorithm keeps one."""

    index: int
    task: Assignment
    state: dict[str, torch.Tensor] | None = None


class WorkerData:
    """Where a worker gets its clients' training data: the one place that knows how.

    A task with a ``population()`` gives its clients one at a time: the worker loads only the
    clients it is asked to train, when it trains them (simulations/client_data.py's
    PopulationShards). Otherwise the task's ``simulation_data()`` is loaded once when the worker
    is set up (never per call) and client i is a slice. Label-flip attackers' labels are flipped
    exactly as the in-process engine does (simulations/attacks.py)."""

    def __init__(self, task: Task, cfg: Config, device: torch.device):
        gossip = cfg.simulation.mode == "gossip"  # gossip peers come from simulation_data() (network.py)
        population = None if gossip else load_population(task, cfg)
        self.shards: ClientShards | PopulationShards
        if population is not None:
            self.shards = PopulationShards(task, population, device)
            self.client_ids = list(self.shards.client_ids)
        else:
            data = load_simulation_data(task, cfg)
            self.shards = ClientShards(data.train, device)
            ids = data.client_ids
            n = len(self.shards)
            self.client_ids = [str(c) for c in ids] if ids is not None else [client_id(i) for i in range(n)]
        a = cfg.attack
        if a.kind == "label_flip" and a.fraction > 0:
            classes = int(getattr(task, "num_classes", 0) or 0)
            # gossip chooses its attackers among peer names (simulations/gossip/network.py)
            names = [peer_id(i) for i in range(len(self.client_ids))] if gossip else self.client_ids
            index = {c: i for i, c in enumerate(names)}
            attackers = choose_attackers(names, a.fraction, cfg.simulation.seed)
            self.shards.flip_labels(sorted(index[c] for c in attackers), classes)

    def __len__(self) -> int:
        return len(self.shards)

    def size(self, i: int) -> int:
        return self.shards.size(i)

    def client(self, i: int) -> ClientData:
        """Client i's training data, as LocalTrainer.fit takes it."""
        return self.shards.data(i)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """(x, y, starts, sizes) of these clients for the batched trainer (loaded now for a population)."""
        return self.shards.gather(indices)

    def digest(self) -> str:
        return clients_digest(self.shards, self.client_ids)


def clients_digest(shards: ClientShards | PopulationShards, ids: list[str]) -> str:
    """A fingerprint of the clients' ids and sizes: the driver checks that workers see its data."""
    sizes = np.asarray([shards.size(i) for i in range(len(shards))], dtype=np.int64).tobytes()
    return hashlib.blake2b(sizes + "\0".join(ids).encode(), digest_size=8).hexdigest()


class RayWorker:
    """A long-lived worker (a Ray actor): one model replica, the trainer and the batched trainer,
    its clients' data; trains many clients per call and returns their updates or their sum."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, threads)
        os.environ["OMP_NUM_THREADS"] = str(self.threads)
        torch.set_num_threads(self.threads)
        self.key: str | None = None

    def _ensure(self, setup: WorkerSetup) -> None:
        if self.key == setup.key:
            return
        cfg = setup.cfg
        task = task_from_config(cfg)
        self.device = worker_device(cfg)
        self.data = WorkerData(task, cfg, self.device)
        # the driver checked the task's loss; gossip peers train one by one, as GossipNetwork's LocalPeers
        shards = self.data.shards
        batching = (
            None
            if cfg.simulation.mode == "gossip"
            else Batching(
                shards.in_memory,
                shards.example if shards.in_memory else None,  # a Dataset is never batched
                setup.sample_size,
                setup.max_client_size,
                say_why=False,  # the driver said it
            )
        )
        parts = assembly.build(cfg, task, "client", device=self.device, example=None, batching=batching)
        self.trainer, self.program, self.batched = parts.trainer, parts.program, parts.batched
        self.pipeline = ClientPipeline(self.program, batched=self.batched)
        self.wire = WireStep(cfg.compression, self.trainer.spec)
        self.weighting = cfg.strategy.weighting
        self.key = setup.key

    def prepare(self, setup: WorkerSetup) -> dict[str, Any]:
        """Build for ``setup``; what the driver checks (model size, the clients' fingerprint)."""
        self._ensure(setup)
        return {
            "pid": os.getpid(),
            "node": _node_id(),
            "device": str(self.device),
            "numel": self.trainer.spec.numel,
            "num_clients": len(self.data),
            "digest": self.data.digest(),
            "batched": self.batched.max_clients if self.batched is not None else 1,
        }

    def train_peers(self, setup: WorkerSetup, items: list[tuple[int, np.ndarray, int]]) -> list[np.ndarray]:
        """Gossip: one round of local work for each (peer, its model row, seed), in order."""
        self._ensure(setup)
        out = []
        for i, row, seed in items:
            start = torch.from_numpy(np.array(row)).to(self.device)
            self.pipeline.local_step(start, self.data.client(i), seed)
            out.append(self.trainer.flat.detach().cpu().numpy().copy())
        return out

    def _train(
        self, items: list[WorkItem], global_flat: torch.Tensor, broadcast: dict[str, torch.Tensor] | None = None
    ) -> list[ClientResult]:
        """Each item's result (update, new state, what the server needs), in ``items`` order: the
        client pipeline's training step, with the states the driver sent (it keeps the store)."""
        out: list[ClientResult | None] = [None] * len(items)
        tasks, states = [it.task for it in items], [it.state or {} for it in items]
        trained = self.pipeline.train(
            tasks,
            global_flat,
            broadcast or {},
            lambda j: self.data.client(items[j].index),
            lambda: self.data.batch([it.index for it in items]),
            states,
        )
        for j, result in trained:
            out[j] = result
        return [r for r in out if r is not None]

    def _state_back(self, result: ClientResult) -> dict[str, torch.Tensor] | None:
        """The new state as it travels back (on the CPU); None when the algorithm keeps none."""
        if not self.program.keeps_state:
            return None
        return {k: v.detach().cpu() for k, v in result.state.items()}

    def train(
        self,
        setup: WorkerSetup,
        global_np: np.ndarray,
        items: list[WorkItem],
        broadcast: dict[str, torch.Tensor] | None = None,
    ) -> list[tuple]:
        """Train ``items``; each one's (delta as float32 numpy, num_examples, metrics, new state, to_server)."""
        self._ensure(setup)
        g = torch.from_numpy(np.array(global_np, dtype=np.float32)).to(self.device)
        return [
            (
                r.update.delta.detach().float().cpu().numpy(),
                r.update.num_examples,
                r.update.metrics,
                self._state_back(r),
                {k: v.detach().cpu() for k, v in r.to_server.items()},
            )
            for r in self._train(items, g, broadcast)
        ]

    def train_sum(self, setup: WorkerSetup, global_np: np.ndarray, items: list[WorkItem]) -> dict[str, Any]:
        """Train ``items`` and return their sum (PartialSum's fields): each update takes the wire
        round trip first (encode, decode, validate), as in-process, and a refused one is counted."""
        self._ensure(setup)
        g = torch.from_numpy(np.array(global_np, dtype=np.float32)).to(self.device)
        acc = torch.zeros(g.numel(), dtype=torch.float64, device=self.device)
        weight, senders, examples, loss_sum = 0.0, [], 0, 0.0
        rejected: dict[str, int] = {}
        locals_: dict[str, dict] = {}
        up0 = self.wire.total_up
        for it, result in zip(items, self._train(items, g)):
            update, local = result.update, self._state_back(result)
            if local is not None:
                locals_[it.task.client_id] = local
            try:
                sent = self.wire(it.task, update)
            except WireError as e:
                rejected[e.code] = rejected.get(e.code, 0) + 1
                continue
            self.wire.accepted(it.task.client_id)  # dense: nothing in flight to settle
            w = float(sent.num_examples) if self.weighting == "examples" else 1.0
            acc.add_(sent.delta.to(self.device), alpha=w)  # as WeightedMean.add: the product in float64
            weight += w
            senders.append(it.task.client_id)
            examples += sent.num_examples
            loss_sum += sent.metrics.get("train_loss", 0.0) * sent.num_examples
        return {
            "weighted_sum": acc.cpu().numpy(),
            "total_weight": weight,
            "senders": senders,
            "num_examples": examples,
            "loss_sum": loss_sum,
            "bytes_up": self.wire.total_up - up0,
            "rejected": rejected,
            "local_states": locals_,
        }

    def stats(self) -> dict[str, Any]:
        """This worker process's peak resident memory (MiB) and where it runs."""
        import resource

        return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "pid": os.getpid()}


def worker_device(cfg: Config) -> torch.device:
    """``simulation.device``, where ``auto`` means a GPU only for workers that reserved a share of one
    (``ray_gpus_per_worker``): a worker must not train on a GPU Ray did not give it."""
    sim = cfg.simulation
    if sim.device == "auto" and sim.ray_gpus_per_worker == 0:
        return torch.device("cpu")
    return select_device(sim.device)


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
