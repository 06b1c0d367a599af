"""How ``[privacy]`` plugs into the in-process simulator: trainer, strategy, client steps, budget.

* central: the server strategy clips and adds the noise (aggregation.dp.DPMean);
* distributed: a client step clips and adds the client's noise share, the server only
  divides by the expected number of clients (secure aggregation, issue 6, would hide
  the individual noisy updates; the simulator sums them in the clear);
* local: the trainer is DP-SGD (client.dp_sgd.DpSgdTrainer).

:class:`PrivacyBudget` counts epsilon after every round and tells the run loop to stop
before ``privacy.target_epsilon`` would be exceeded.
"""

from __future__ import annotations

import logging

from shoal.accounting import LocalDpSgdAccountant, RoundAccountant, dp_sgd_schedule
from shoal.aggregation import Strategy
from shoal.aggregation.dp import clip_to_norm, make_generator, noise_share
from shoal.assembly import expected_clients
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.rounds import Assignment
from shoal.seeding import derive_seed
from shoal.update import Update

log = logging.getLogger(__name__)


def distributed_noise_step(cfg: Config, num_clients: int):
    """The client step of distributed DP: clip to C, add N(0, z² C² / K) (seeded per task)."""
    p = cfg.privacy
    k = expected_clients(cfg, num_clients)

    def step(task: Assignment, update: Update) -> Update:
        gen = make_generator(update.delta.device, derive_seed(task.seed, 0xD9))
        clipped, _ = clip_to_norm(update.delta, p.clip_norm)
        update.delta = noise_share(clipped, p.clip_norm, p.noise_multiplier, k, gen)
        return update

    return step


class PrivacyBudget:
    """epsilon so far, and whether one more round stays within ``target_epsilon``."""

    def __init__(self, cfg: Config, client_sizes: dict[str, int], strategy: Strategy | None = None):
        p = cfg.privacy
        self._aggregator = strategy.aggregator if strategy is not None and p.adaptive_clipping else None
        self.target = p.target_epsilon
        self.delta = p.delta
        if p.mode == "local":
            schedules = {c: dp_sgd_schedule(n, cfg.train.batch(n), cfg.train.epochs) for c, n in client_sizes.items()}
            self.accountant = LocalDpSgdAccountant(schedules, p.noise_multiplier, p.delta, p.accountant)
        else:
            q = expected_clients(cfg, len(client_sizes)) / len(client_sizes)
            self.accountant = RoundAccountant(q, p.noise_multiplier, p.delta, p.accountant)
        if self.target and self.accountant.next_epsilon() > self.target:
            raise ConfigError(
                f"privacy.target_epsilon = {self.target:g} is below the epsilon of a single round "
                f"({self.accountant.next_epsilon():.3g} at delta = {self.delta:g}); raise it or "
                "raise privacy.noise_multiplier"
            )

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon

    def metrics(self) -> dict[str, float]:
        """What a metrics.jsonl record gets: ``epsilon``, and ``clip_norm`` when it adapts."""
        out = {"epsilon": self.epsilon}
        if self._aggregator is not None:
            out["clip_norm"] = float(self._aggregator.clip_norm)
        return out

    def record_round(self, tasks: list[Assignment]) -> None:
        self.accountant.record_round([t.client_id for t in tasks])

    def allows_next_round(self) -> bool:
        """False (with a message) when one more round would take epsilon past the target."""
        if not self.target:
            return True
        nxt = self.accountant.next_epsilon()
        if nxt <= self.target:
            return True
        log.warning(
            "stopping: privacy budget reached (epsilon = %.4g now, %.4g after one more round > "
            "privacy.target_epsilon = %g at delta = %g)", self.epsilon, nxt, self.target, self.delta,
        )
        return False
