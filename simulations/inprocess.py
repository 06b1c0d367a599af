"""The in-process engine: many simulated clients in one Python process.

Clients are data (a contiguous slice of one device-resident training tensor) plus a
seed, not model copies: one LocalTrainer trains each selected client in turn, so
10,000 clients cost the dataset's memory once. The round logic is shoal.rounds'
SyncRounds, the same object the HTTP server drives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from shoal.client.batched import make_batched_trainer
from shoal.client.device import select_device
from shoal.config import Config
from shoal.datasets import FederatedData, load_federated
from shoal.errors import WireError
from shoal.models import build_model
from shoal.rounds import RoundSummary, SyncRounds, Task
from shoal.update import Update

from .attacks import attack_steps
from .dp_hooks import PrivacyBudget, distributed_noise_step, make_round_strategy, make_trainer
from .wire_step import WireStep

log = logging.getLogger(__name__)


def client_id(i: int) -> str:
    return f"client-{i:05d}"


class ClientShards:
    """All clients' training data in one tensor, reordered so each client is a slice."""

    def __init__(self, data: FederatedData, device: torch.device):
        order = np.concatenate(data.client_indices) if data.client_indices else np.zeros(0, np.int64)
        idx = torch.as_tensor(order, dtype=torch.long)
        self.x = data.train.x[idx].to(device)
        self.y = data.train.y[idx].to(device)
        sizes = [len(ix) for ix in data.client_indices]
        self.bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def get(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.bounds[i]), int(self.bounds[i + 1])
        return self.x[a:b], self.y[a:b]

    def size(self, i: int) -> int:
        return int(self.bounds[i + 1] - self.bounds[i])


# A step between a client's training and the aggregator (an attack, local DP noise,
# compression...). Each feature adds its own in ``InProcessSimulation._client_steps``.
ClientStep = Callable[[Task, Update], Update]


class InProcessSimulation:
    """Builds data, model, trainer, strategy and rounds from a Config; runs rounds.

    Extension points, so features stay in their own modules:
    ``train_clients`` (how the selected clients train: one by one here, batched
    elsewhere) and ``client_steps`` (what happens to each update before it is sent).
    """

    def __init__(self, cfg: Config, data: FederatedData | None = None):
        self.cfg = cfg
        sim = cfg.simulation
        self.device = select_device(sim.device)
        self.data = data if data is not None else load_federated(cfg.data, sim.num_clients, sim.seed)
        torch.manual_seed(sim.seed)  # model initialisation
        model = build_model(cfg.model.name, self.data.input_shape, self.data.num_classes)
        self.trainer = make_trainer(cfg, model, self.device)
        self.spec = self.trainer.spec
        self.shards = ClientShards(self.data, self.device)
        self.test_x = self.data.test.x.to(self.device)
        self.test_y = self.data.test.y.to(self.device)
        self.client_ids = [client_id(i) for i in range(len(self.shards))]
        self._index = {cid: i for i, cid in enumerate(self.client_ids)}
        strategy = make_round_strategy(cfg, self.spec.numel, self.device, len(self.client_ids))
        self.rounds = SyncRounds(
            strategy, self.trainer.flat.detach().clone(), sim.clients_per_round, sim.fraction, sim.seed
        )
        self.privacy = None if cfg.privacy.mode == "none" else PrivacyBudget(
            cfg, {c: self.shards.size(i) for i, c in enumerate(self.client_ids)}, strategy
        )
        self.wire = WireStep(cfg.compression, self.spec)
        self.client_steps: list[ClientStep] = self._client_steps()
        # DP-SGD (privacy.mode = "local") clips per sample with Opacus: never batched across clients
        self.batched = None if cfg.privacy.mode == "local" else make_batched_trainer(
            sim.batch_clients, self.trainer.model, self.spec, cfg.train, self.device, self.data.input_shape,
            self.rounds.sample_size(len(self.client_ids)), max(map(self.shards.size, range(len(self.shards))), default=0),
        )
        if cfg.secure_aggregation.enabled:  # last: it wraps train_clients and the client steps
            from shoal.simulations.secure_rounds import install

            install(self)
        log.info(
            "simulation: %d clients, %d train / %d test samples, model %s (%d parameters) on %s",
            len(self.client_ids), len(self.data.train), len(self.data.test), cfg.model.name,
            self.spec.numel, self.device,
        )

    @property
    def global_params(self) -> torch.Tensor:
        return self.rounds.global_params

    def _client_steps(self) -> list[ClientStep]:
        """The client-side steps the config asks for, in pipeline order (DESIGN.md)."""
        steps: list[ClientStep] = [*attack_steps(self)]
        if self.cfg.privacy.mode == "distributed":
            steps.append(distributed_noise_step(self.cfg, len(self.client_ids)))
        return [*steps, self.wire]

    def train_clients(self, tasks: list[Task], global_params: torch.Tensor) -> Iterator[tuple[Task, Update]]:
        """Local training of each task's client from ``global_params`` (batched: client/batched.py)."""
        if self.batched is not None:
            idx = [self._index[t.client_id] for t in tasks]
            starts = [int(self.shards.bounds[i]) for i in idx]
            sizes = [self.shards.size(i) for i in idx]
            for j, update in self.batched.train(global_params, self.shards.x, self.shards.y, starts, sizes,
                                                [t.seed for t in tasks]):
                task = tasks[j]
                update.base_version, update.sender = task.version, task.client_id
                yield task, update
            return
        for task in tasks:
            x, y = self.shards.get(self._index[task.client_id])
            yield task, self.trainer.train(global_params, x, y, task.seed, task.version, task.client_id)

    def run_round(self) -> RoundSummary:
        """One synchronous round: select, train each selected client, aggregate."""
        tasks = self.rounds.start_round(self.client_ids)
        self.wire.broadcast(self.rounds.global_params, self.rounds.version, len(tasks))
        for task, update in self.train_clients(tasks, self.rounds.global_params):
            try:
                for step in self.client_steps:
                    update = step(task, update)
            except WireError as e:  # validation rejected the payload: counted, not aggregated
                self.rounds.rejected[e.code] = self.rounds.rejected.get(e.code, 0) + 1
                log.debug("update of %s rejected: %s", task.client_id, e)
                continue
            self.rounds.submit(task.client_id, update)
        summary = self.rounds.finish_round()
        if self.privacy is not None:
            self.privacy.record_round(tasks)
        return summary

    def evaluate(self) -> dict[str, float]:
        return self.trainer.evaluate(self.rounds.global_params, self.test_x, self.test_y)
