"""How ``[privacy]`` plugs into the in-process simulator: trainer, strategy, client steps, budget.

* central: the server strategy clips and adds the noise (aggregation.dp.DPMean);
* distributed: a client step clips and adds the client's noise share N(0, z²C²/t), the
  server only divides by the expected number of clients. t is the number of clients the
  round selected when the simulator sums in the clear, and the fewest survivors secure
  aggregation accepts when it is on (simulations/secure_rounds.py sets it); either way a
  completed round's sum carries at least N(0, z²C²);
* local: the trainer is DP-SGD (client.dp_sgd.DpSgdTrainer).

Sampling (``privacy.sampling``): central and distributed rounds sample clients the way the
accountant assumes: Poisson with q = K/N by default, or exactly K of N with the fixed-size
(replace-one) accountant. Local DP-SGD is accounted per client over its realised
participation, which holds for any data-independent selection; its rounds pick exactly K.

:class:`PrivacyBudget` counts epsilon after every round and tells the run loop to stop
before ``privacy.target_epsilon`` would be exceeded.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from shoal.accounting import Accountant, budget_allows, check_delta_against
from shoal.accounting_dpsgd import dp_sgd_schedule
from shoal.accounting_rounds import DdgRoundAccountant
from shoal.aggregation import Strategy
from shoal.aggregation.dp import DPMean, clip_to_norm, make_generator, noise_share
from shoal.assembly import expected_clients
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.noise import describe as describe_randomness
from shoal.privacy_plan import plan_of
from shoal.rounds import Assignment, RoundSummary
from shoal.seeding import derive_seed
from shoal.update import Update

log = logging.getLogger(__name__)


def round_sampling(cfg: Config) -> str:
    """How SyncRounds picks clients under this config: ``poisson`` or ``fixed``."""
    return plan_of(cfg).round_sampling


class DistributedNoise:
    """The client step of distributed DP: clip to C, add N(0, z²C²/t) (from the CSPRNG; seeded per
    assignment with ``privacy.reproducible``).

    ``shares`` gives t for the current round (by default: how many clients the round selected,
    read from ``rounds``); secure aggregation replaces it with its own minimum of survivors.
    Each call also tells the server's DP mean which t its shares were drawn for."""

    def __init__(self, cfg: Config, rounds=None, shares: Callable[[], int] | None = None):
        self.p = cfg.privacy
        self.rounds = rounds
        if shares is None:
            fallback = expected_clients(cfg, cfg.simulation.num_clients)
            shares = (lambda: max(1, len(rounds.selected))) if rounds is not None else (lambda: fallback)
        self.shares = shares
        self.cohort = 0  # secure aggregation: K_max, the shares the released sum is topped up to

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


def distributed_noise_step(cfg: Config, num_clients: int, rounds=None) -> DistributedNoise:
    """The distributed-DP client step (``num_clients`` kept for callers of the old signature)."""
    return DistributedNoise(cfg, rounds)


def selection_secret(cfg: Config) -> bytes | None:
    """The key of a DP run's client selection and task seeds (SyncRounds.secret): 256 bits from the
    OS, so nobody who knows the config can recompute who was sampled; None (selection seeded from
    simulation.seed) without DP or with ``privacy.reproducible``."""
    if not plan_of(cfg).enabled or cfg.privacy.reproducible:
        return None
    return secrets.token_bytes(32)


def check_delta(delta: float, mode: str, client_sizes: dict[str, int]) -> None:
    """Refuse delta >= 1/N (ConfigError), N the clients (central and distributed DP protect a
    whole client) or the smallest client's examples (local DP-SGD protects one example); warn
    above 1/(10 N). The rule is shoal.accounting.check_delta_against, which the server and the
    nodes apply too."""
    if mode == "local":
        n, unit = min(client_sizes.values(), default=0), "examples of the smallest client"
    else:
        n, unit = len(client_sizes), "clients"
    try:
        check_delta_against(delta, n, unit)
    except ValueError as e:
        raise ConfigError(str(e)) from None


class PrivacyBudget:
    """epsilon so far, and whether one more round stays within ``target_epsilon``."""

    def __init__(
        self,
        cfg: Config,
        client_sizes: dict[str, int],
        strategy: Strategy | None = None,
        sampling: str | None = None,
    ):
        """``sampling``: how the engine picks who trains, for records (default: the sync rounds'
        sampling, :func:`round_sampling`; gossip says ``online``: every online peer trains)."""
        p = cfg.privacy
        self.plan = plan_of(cfg)
        agg = strategy.aggregator if strategy is not None else None
        # adaptive clipping is central DP's (config rules), whose strategy aggregates with a DPMean
        self._aggregator = agg if isinstance(agg, DPMean) and p.adaptive_clipping else None
        self.target = p.target_epsilon
        self.delta = p.delta
        self.sampling = sampling or round_sampling(cfg)
        self.accountant: Accountant
        if self.plan.dp_sgd:
            rate = cfg.privacy.local_sampling_rate
            schedules = {
                c: dp_sgd_schedule(n, cfg.train.batch(n), cfg.train.epochs, rate) for c, n in client_sizes.items()
            }
            self.accountant = self.plan.local_accountant(schedules)
        else:
            n = len(client_sizes)
            k = expected_clients(cfg, n)
            # at z_eff when the round's figures are released noised too (PrivacyPlan.accounted_z)
            self.accountant = self.plan.round_accountant(k / n, sampling=self.sampling, num_clients=n, sample_size=k)
        # epsilon against the server (distributed DP under secure aggregation; None elsewhere)
        self.server_view = self.plan.server_view_accountant()
        check_delta(p.delta, p.mode, client_sizes)
        self.reproducible = p.reproducible
        log.info("privacy accounting: %s; %s", self.accountant.describe(), self.plan.describe_release())
        (log.warning if p.reproducible else log.info)("privacy randomness: %s", describe_randomness(p.reproducible))
        if self.target and self.accountant.next_epsilon() > self.target:
            raise ConfigError(
                f"privacy.target_epsilon = {self.target:g} is below the epsilon of a single round "
                f"({self.accountant.next_epsilon():.3g} at delta = {self.delta:g}); raise it or "
                "raise privacy.noise_multiplier"
            )

    def use_accountant(self, accountant: DdgRoundAccountant) -> None:
        """Account with another mechanism's analysis (the distributed discrete Gaussian's, which
        secure aggregation sizes); the target is checked again."""
        self.accountant = accountant
        if self.server_view is not None:
            self.server_view.set_mechanism(ddg=accountant.ddg)
        log.info("privacy accounting: %s", accountant.describe())
        if self.target and accountant.next_epsilon() > self.target:
            raise ConfigError(
                f"privacy.target_epsilon = {self.target:g} is below the epsilon of a single round "
                f"({accountant.next_epsilon():.3g} at delta = {self.delta:g}); raise it or raise "
                "privacy.noise_multiplier"
            )

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon

    def metrics(self) -> dict:
        """What a metrics.jsonl record gets: ``epsilon``, the client ``sampling`` and the ``accountant``
        it assumes, and ``clip_norm`` when it adapts."""
        out = {"epsilon": self.epsilon, "sampling": self.sampling, "accountant": self.accountant.describe()}
        out.update(self.plan.server_view_fields(self.server_view))
        if self._aggregator is not None and self._aggregator.clip_norm is not None:
            out["clip_norm"] = float(self._aggregator.clip_norm)
        return out

    def summary(self) -> dict:
        """What summary.json gets."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "sampling": self.sampling,
            "accountant": self.accountant.describe(),
            **self.plan.server_view_fields(self.server_view),
            "release": self.plan.describe_release(),
            "randomness": describe_randomness(self.reproducible),
        }

    def round_figures(self, summary: RoundSummary) -> dict:
        """privacy.release = "noised": the round's noisy result count and train loss ({} otherwise)."""
        return self.plan.noisy_round(summary.num_results, summary.client_losses)

    def record_round(self, tasks: list[Assignment]) -> None:
        self.record_participants([t.client_id for t in tasks])

    def record_participants(self, client_ids: list[str]) -> None:
        """One round in which these clients (or gossip peers) trained; one listed twice trained twice."""
        self.accountant.record_round(client_ids)
        if self.server_view is not None:
            self.server_view.record_round(client_ids)

    def state_dict(self) -> dict:
        """What was charged so far (the accountant's ledger), as the server keeps its own."""
        out = self.accountant.state_dict()
        if self.server_view is not None:
            out["server_view"] = self.server_view.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.accountant.load_state_dict(state)
        if self.server_view is not None and "server_view" in state:
            self.server_view.load_state_dict(state["server_view"])

    def allows_next_round(self) -> bool:
        """False (with a message) when one more round would take epsilon past the target."""
        return budget_allows(self.accountant, self.target, self.delta)
