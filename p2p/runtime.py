"""A gossip peer's own work, apart from the protocol: local training, evaluation and, under local
DP, the privacy ledger. No network and no protocol state: p2p/service.py holds the model the
peer exchanges, this module trains and evaluates it when the transport (p2p/peer.py) says so.

With ``privacy.mode = "local"`` the trainer runs DP-SGD on a seed only this peer knows, and the
peer keeps its own epsilon over its trainings (NodePrivacy, the simulator's accountant),
stopping before a training that would pass ``privacy.target_epsilon``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from shoal.client.pipeline import local_step
from shoal.config import Config
from shoal.params import ParamSpec
from shoal.privacy_plan import LOCAL_UPLOAD_EXAMPLES, plan_of
from shoal.privacy_state import NodePrivacy
from shoal.seeding import derive_seed
from shoal.task import ClientData, Task, num_examples, task_name
from shoal.update import Update


@dataclass
class PeerData:
    """A peer's own data: what it trains on, its own test data (optional) and, in a
    simulation-style run (``--data client:<i>``), the split's central test set (optional).
    Each is an (x, y) tensor pair or a torch Dataset (shoal.task.ClientData)."""

    train: ClientData
    test: ClientData | None = None
    central_test: ClientData | None = None


class Trainer(Protocol):
    """What a peer needs of the trainer ``assembly.build(cfg, task, "client")`` gives."""

    spec: ParamSpec
    flat: torch.Tensor
    task: Task
    device: torch.device

    def fit(self, global_flat: torch.Tensor, data: ClientData, seed: int) -> Update: ...

    def evaluate_data(self, params: torch.Tensor, data: ClientData) -> dict[str, float]: ...


class PeerRuntime:
    """Training, evaluation and the privacy ledger of one peer."""

    def __init__(self, cfg: Config, trainer: Trainer, data: PeerData, me: str, ledger: Path | None = None):
        self.cfg, self.trainer, self.data, self.me = cfg, trainer, data, me
        self.spec = trainer.spec
        self.plan = plan_of(cfg)
        # what this peer tells others of its data: its example count weighs its model in merges and
        # group averages; under local DP it is data-dependent and not noised, so it says 1 (uniform)
        self.shared_examples = LOCAL_UPLOAD_EXAMPLES if self.plan.dp_sgd else num_examples(data.train)
        self.steps = 0
        self.train_loss: float | None = None
        self.last_eval: dict[str, float] = {}  # the latest evaluation's metrics (GET /status)
        # local DP: this peer's epsilon over its own trainings, kept in a ledger so a restarted peer
        # goes on from it
        self.privacy = NodePrivacy(cfg, me, num_examples(data.train), ledger) if self.plan.dp_sgd else None

    @property
    def task_name(self) -> str:
        return task_name(self.trainer.task)

    def initial_params(self) -> torch.Tensor:
        return self.trainer.flat.detach().clone()

    def train(self, params: torch.Tensor) -> torch.Tensor | None:
        """One round of local training from ``params``; the trained model (the trainer's buffer),
        or None (nothing trained) when local DP's budget is spent: one more training would take
        epsilon past ``privacy.target_epsilon``."""
        if self.privacy is not None and not self.privacy.allows_next_round():
            return None
        seed = derive_seed(self.cfg.simulation.seed, self.steps, zlib.crc32(self.me.encode()))
        if self.privacy is not None:
            seed = self.privacy.training_seed(seed)  # DP-SGD's noise and sampling on a seed only we know
        update = local_step(self.trainer, params, self.data.train, seed)  # the client pipeline's step
        self.train_loss = update.metrics.get("train_loss")
        self.steps += 1
        if self.privacy is not None:  # the model leaves this peer with its next message
            self.privacy.spend(self.steps)
        return self.trainer.flat

    def evaluate(self, params: torch.Tensor) -> dict[str, float]:
        """Every metric the task gives for ``params``: ``test_<metric>`` on the central test set,
        ``local_test_<metric>`` (+ ``local_test_num_examples``) on the peer's own test data; empty
        when the peer has neither. Kept as ``last_eval``."""
        out: dict[str, float] = {}
        if self.data.central_test is not None:
            ev = self.trainer.evaluate_data(params, self.data.central_test)
            out.update({f"test_{k}": v for k, v in ev.items() if k != "num_examples"})
        if self.data.test is not None:
            ev = self.trainer.evaluate_data(params, self.data.test)
            out.update({f"local_test_{k}": v for k, v in ev.items() if k != "num_examples"})
            out["local_test_num_examples"] = int(ev["num_examples"])
        self.last_eval = out
        return out

    def shown_metrics(self) -> dict[str, float]:
        """What GET /status shows of the latest evaluation: under DP (privacy.release not clear) only
        the model on the central test set, not the figures of this peer's own test data."""
        if not self.plan.withholds:
            return self.last_eval
        return {k: v for k, v in self.last_eval.items() if k.startswith("test_")}

    def privacy_fields(self, public: bool = False) -> dict[str, Any]:
        """Local DP: this peer's epsilon so far (over its trainings), delta, trainings, the accountant.
        ``public`` (GET /status, which answers anyone): the epsilon only where it says nothing of the
        peer's data (PrivacyPlan.node_reports: at q = B / n_k it would reveal roughly how many
        examples the peer holds); the peer's own log and metrics.jsonl have it either way."""
        if self.privacy is None or self.privacy.accountant is None:
            return {}
        if public and not self.plan.node_reports:
            return {
                "delta": self.cfg.privacy.delta,
                "dp_trainings": self.privacy.rounds,
                "accountant": "withheld: this peer's epsilon, at q = B / n_k, would reveal roughly its example "
                "count (its log and metrics.jsonl have it; privacy.local_sampling_rate or release = 'clear' "
                "shows it here)",
            }
        return {
            "epsilon": self.privacy.epsilon,
            "delta": self.cfg.privacy.delta,
            "dp_trainings": self.privacy.rounds,
            "accountant": self.privacy.accountant.describe(),
        }
