"""How ``[privacy]`` plugs into the in-process simulator: trainer, strategy, client steps, budget.

* central: the server strategy clips and adds the noise (aggregation.dp.DPMean);
* distributed: a client step clips and adds the client's noise share N(0, z²C²/t), the
  server only divides by the expected number of clients. t is the number of clients the
  round selected when the simulator sums in the clear, and the fewest survivors secure
  aggregation accepts when it is on (shoal.secure_sizing sizes it, shoal.assembly builds the
  step with it); either way a completed round's sum carries at least N(0, z²C²);
* local: the trainer is DP-SGD (client.dp_sgd.DpSgdTrainer).

The sampling, the budget (:class:`~shoal.privacy_state.PrivacyBudget`) and the delta check live in
shoal/privacy_state.py, below shoal.assembly.
"""

from __future__ import annotations

import logging

from shoal.aggregation.dp import clip_to_norm, make_generator, noise_share
from shoal.config import Config
from shoal.privacy_state import expected_clients
from shoal.rounds import Assignment
from shoal.seeding import derive_seed
from shoal.update import Update

log = logging.getLogger(__name__)


class DistributedNoise:
    """The client step of distributed DP: clip to C, add N(0, z²C²/t) (from the CSPRNG; seeded per
    assignment with ``privacy.reproducible``).

    ``shares``: t, fixed for the run (secure aggregation's fewest survivors, sized by
    shoal.secure_sizing); 0: each round's t is how many clients it selected, read from ``rounds``
    (or, without rounds, the expected K). ``cohort``: secure aggregation's K_max, the shares the
    released sum is topped up to (0 in the clear). Both are set when shoal.assembly builds the step.
    Each call also tells the server's DP mean which t its shares were drawn for."""

    def __init__(self, cfg: Config, rounds=None, shares: int = 0, cohort: int = 0):
        self.p = cfg.privacy
        self.rounds = rounds
        self.fixed_shares = shares
        self.fallback = expected_clients(cfg, cfg.simulation.num_clients)
        self.cohort = cohort

    def shares(self) -> int:
        """t for the current round."""
        if self.fixed_shares:
            return self.fixed_shares
        return max(1, len(self.rounds.selected)) if self.rounds is not None else self.fallback

    def __call__(self, task: Assignment, update: Update) -> Update:
        t = self.shares()
        agg = getattr(getattr(self.rounds, "strategy", None), "aggregator", None)
        if agg is not None and hasattr(agg, "expect_shares"):
            agg.expect_shares(t, self.cohort)
        # the CSPRNG, or (privacy.reproducible) a generator seeded from the task's seed
        gen = make_generator(update.delta.device, derive_seed(task.seed, 0xD9) if self.p.reproducible else None)
        clipped, _ = clip_to_norm(update.delta, self.p.clip_norm)
        update.delta = noise_share(clipped, self.p.clip_norm, self.p.noise_multiplier, t, gen)
        return update
