"""How a simulation's secure aggregation is sized, from the config and the population alone.

:func:`size_secure_rounds` answers, before any round runs, what shoal.assembly needs to build the
simulation's parts final (the round runner, the client steps and the accountant read them; nothing
re-wires a part after the build):

* ``max_summands`` (K_max): the most clients a round is encoded for: K under fixed-size sampling, the
  Poisson cap (aggregation.dp.cohort_cap) under Poisson sampling; a round that draws more aborts;
* ``noise_shares`` (t, distributed DP only): the fewest survivors secure aggregation accepts in a round
  of K clients (its threshold), raised to ceil(privacy.min_survivors K); each client's noise share
  is sized for t, so every applied sum carries at least N(0, z²C²);
* ``ddg`` (``privacy.mechanism = "discrete_gaussian"``): the distributed discrete Gaussian's
  parameters for t shares and K_max summands (aggregation/discrete_gaussian.py), whose own bound
  the accountant then uses.

The fixed-point range is checked here too (it raises ConfigError for a modulus too small for
K_max summands, or a range that would clip the Gaussian noise shares). The deployed server sizes
its rounds in server/privacy.py, on the registered nodes instead of the simulated population.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.accounting_aborts import simulated_branches
from shoal.accounting_mixture import Branches
from shoal.aggregation.discrete_gaussian import DdgParams, plan
from shoal.aggregation.dp import cohort_cap, share_std
from shoal.aggregation.secagg import SecAggParams, SecAggServer
from shoal.aggregation.secagg.encoding import FixedPoint, check_noise_range
from shoal.aggregation.secagg.memory import STAGES
from shoal.config import Config, SecureAggregationConfig
from shoal.privacy_plan import plan_of
from shoal.privacy_state import expected_clients, round_sampling


@dataclass(frozen=True)
class SecureSizing:
    """What a simulation's secure aggregation is sized for (see the module doc). ``sample_size``: K,
    the clients a round selects (on average under Poisson sampling); ``expected_dropout``: the
    dropout an automatic SecAgg+ degree is sized to survive (from the injected dropout rates)."""

    sample_size: int
    max_summands: int
    expected_dropout: float
    noise_shares: int = 0
    ddg: DdgParams | None = None
    # distributed DP: what a round costs, its aborts released as empty rounds (accounting_aborts); None: nothing
    abort_branches: Branches | None = None

    def ddg_accounting(self) -> dict | None:
        """The discrete Gaussian's parameters as its accountant takes them (None: not the mechanism)."""
        if self.ddg is None:
            return None
        return {**self.ddg.as_dict(), "sensitivity_sq": self.ddg.sensitivity_sq()}


def expected_dropout(sa: SecureAggregationConfig) -> float:
    """The dropout an automatic SecAgg+ degree is sized to survive: the chance a client is lost before
    unmasking under the injected rates, kept within [0.1, 0.99]."""
    lost = 1 - math.prod(1 - getattr(sa, f"dropout_{s}") for s in STAGES[:3])
    return min(max(lost, 0.1), 0.99)


def min_survivors(sa: SecureAggregationConfig, n: int, dropout: float) -> int:
    """The fewest survivors secure aggregation accepts in a round of ``n`` clients (its threshold)."""
    params = SecAggParams(
        session=b"threshold",
        vector_size=1,
        graph=sa.graph,
        degree=sa.degree,
        threshold_fraction=sa.threshold,
        expected_dropout=dropout,
    )
    return SecAggServer(params, [f"c{i}" for i in range(max(n, 1))]).threshold


def size_secure_rounds(cfg: Config, num_clients: int, numel: int) -> SecureSizing | None:
    """The sizing of ``cfg``'s secure aggregation over ``num_clients`` clients and a model of ``numel``
    exchanged parameters (None without secure aggregation). Raises ConfigError (or the discrete
    Gaussian's DdgConfigError) where the encoding cannot hold the sum or its noise."""
    sa, p = cfg.secure_aggregation, cfg.privacy
    if not sa.enabled:
        return None
    n = num_clients
    k = expected_clients(cfg, n)
    most = cohort_cap(n, k) if round_sampling(cfg) == "poisson" else k
    values = FixedPoint(sa.clip, sa.bits, most)  # raises if K_max summands overflow 2^bits
    FixedPoint(1.0, sa.bits, most)  # the weights' entry
    dropout = expected_dropout(sa)
    if not plan_of(cfg).client_shares:
        return SecureSizing(k, most, dropout)
    t = max(min_survivors(sa, k, dropout), math.ceil(p.min_survivors * k - 1e-9))
    aborts = simulated_branches(cfg, n, k / n, t, most)  # whether a round aborts depends on the sample
    if p.mechanism == "discrete_gaussian":
        ddg = plan(numel, p.clip_norm, p.noise_multiplier, t, most, p.bits, p.beta, p.gamma, p.rotation)
        return SecureSizing(k, most, dropout, t, ddg, aborts)
    if p.noise_multiplier > 0:
        check_noise_range(values, p.clip_norm, share_std(p.clip_norm, p.noise_multiplier, t), t)
    return SecureSizing(k, most, dropout, t, abort_branches=aborts)
