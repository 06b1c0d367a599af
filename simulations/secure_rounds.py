"""Secure aggregation in the in-process simulator (``[secure_aggregation] enabled = true``).

Each round the selected clients train as usual, run their client steps (DP noise,
compression, ... come before masking), encode ``[w_k * clip(delta_k), w_k]`` in fixed
point and run the whole protocol of :mod:`shoal.aggregation.secagg` in memory, with
dropouts injected at each stage. The strategy then receives only the unmasked
weighted mean ``sum_k w_k delta_k / sum_k w_k``, once per included client with that
client's example count, so its own weighting reproduces the same mean. What each client masks
for SCAFFOLD and FedNova (its control-variate delta; its update over its step weight) is
aggregation/secagg/payload.py's, shared with the server and the nodes. A round the
protocol aborts (too few survivors) applies no sum: under distributed DP with Poisson sampling it
releases an empty round's noise, else the global model and version stay.

The sizing (t, K_max, the discrete Gaussian's parameters) is shoal/secure_sizing.py's, done when
shoal.assembly builds the simulation's parts; this runner only reads it (``sim.parts.secure``).

Distributed DP (docs/privacy.md): every noise share has variance z²C²/t with t = the fewest
survivors secure aggregation accepts for a round of K clients (K = the expected round size;
raised to ceil(privacy.min_survivors K) when set, e.g. for SecAgg+ whose threshold counts one
neighbourhood),
and a round whose survivors number fewer than t is aborted before its sum is used, so every
applied sum carries at least N(0, z²C²). The fixed-point range is checked against the share's
std (aggregation.secagg.encoding.check_noise_range). Aborted rounds are charged by the
accountant like any other, and under Poisson sampling that a round aborts depends on the sample:
the aborted round is released as an empty one (InProcessSimulation) and each round priced as a
mixture of sensitivities (shoal.accounting_aborts, SecureSizing.abort_branches).
The DP mean tops the sum of n survivors' shares up to K_max = the most summands a round is encoded
for (a round with more aborts), so the released noise is K_max z²C²/t whatever n is and does not
tell a recipient how many took part.

With ``privacy.mechanism = "discrete_gaussian"`` the clients add no continuous noise: each encodes
its update with the distributed discrete Gaussian (aggregation/discrete_gaussian.py: clip, scale,
rotate, round, integer noise of variance sigma^2/gamma^2 with sigma^2 = z^2 C^2 / t, modulo 2^bits),
the protocol sums those integers and the sum is decoded; the accountant is the mechanism's own
(shoal.accounting_rounds.DdgRoundAccountant). Its noise comes from shoal.noise's CSPRNG.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator

import numpy as np
import torch

from shoal.aggregation.discrete_gaussian import DdgCodec, DdgParams
from shoal.aggregation.dp import share_std
from shoal.aggregation.secagg import SecAggAborted, SecAggParams, SecAggResult
from shoal.aggregation.secagg.encoding import FixedPoint, example_weight
from shoal.aggregation.secagg.group import SecureMean
from shoal.aggregation.secagg.memory import STAGES, SecAggCost, injected_dropouts, run_in_memory
from shoal.aggregation.secagg.payload import SecurePayload, SecureSums
from shoal.errors import NonFinite
from shoal.noise import NoiseSource
from shoal.privacy_plan import plan_of
from shoal.rounds import Assignment
from shoal.seeding import derive_seed, rng
from shoal.update import Update

from .round_runner import RunnerHost

log = logging.getLogger(__name__)


class SecureAggregationRounds:
    """The round runner of an InProcessSimulation with ``[secure_aggregation]``: the clients'
    steps run before masking, the aggregator receives only the unmasked mean; keeps the last
    round's protocol outcome in ``last`` (included, dropped, server/client CPU seconds)."""

    def __init__(self, sim: RunnerHost) -> None:
        self.sim = sim
        self.cfg = sim.cfg.secure_aggregation
        sizing = sim.parts.secure  # t, K_max and the discrete Gaussian, sized when the parts were built
        if sizing is None:
            raise TypeError("SecureAggregationRounds runs parts built with [secure_aggregation] enabled = true")
        self.sizing = sizing
        # distributed DP's server divides the plain sum by K: every client weighs the same
        self.weighting = "uniform" if plan_of(sim.cfg).client_shares else sim.cfg.strategy.weighting
        self.values = FixedPoint(self.cfg.clip, self.cfg.bits, self.max_summands)
        self.weights = FixedPoint(1.0, self.cfg.bits, self.max_summands)
        self.max_weight = self.cfg.max_weight or sim.shards.max_size()
        self.payload = SecurePayload(sim.cfg.algorithm.name, sim.spec.numel)  # what each client masks
        self.last: dict = {}
        # how one aggregation's messages move: all in this process, or through virtual edges
        # (simulations/hierarchy.py sets aggregation.secagg.tiers.run_through_edges)
        self.transport: Callable[..., tuple[SecAggResult, SecAggCost]] = run_in_memory
        p, k = sim.cfg.privacy, sizing.sample_size
        if self.ddg is not None:
            log.info(
                "distributed discrete Gaussian with secure aggregation: %d clients per round, each adds integer "
                "noise of variance %d at granularity gamma = %.4g (sigma = %.4g, t = %d survivors at least), "
                "modulus 2^%d",
                k,
                self.ddg.variance,
                self.ddg.gamma,
                self.ddg.client_std,
                self.noise_shares,
                self.ddg.bits,
            )
        elif self.noise_shares:
            log.info(
                "distributed DP with secure aggregation: %d clients per round, each adds N(0, %.4g^2) "
                "(t = %d survivors at least)",
                k,
                share_std(p.clip_norm, p.noise_multiplier, self.noise_shares),
                self.noise_shares,
            )

    @property
    def max_summands(self) -> int:
        """K_max: the most clients a round is encoded for (a round with more aborts)."""
        return self.sizing.max_summands

    @property
    def noise_shares(self) -> int:
        """Distributed DP: t, the fewest survivors a round may complete with (0 without)."""
        return self.sizing.noise_shares

    @property
    def ddg(self) -> DdgParams | None:
        """The distributed discrete Gaussian's parameters (None: not the mechanism)."""
        return self.sizing.ddg

    @property
    def expected_dropout(self) -> float:
        """What an automatic SecAgg+ degree is sized to survive."""
        return self.sizing.expected_dropout

    def _drop_at(self, ids: list[str], round_: int) -> dict[str, str]:
        """Which client drops at which stage: at each stage it is still in, a client
        drops with that stage's configured probability."""
        rates = [getattr(self.cfg, f"dropout_{s}") for s in STAGES]
        draws = rng(self.cfg.seed, self.sim.cfg.simulation.seed, round_, 1).random((len(ids), len(STAGES)))
        return injected_dropouts(ids, rates, draws)

    def updates(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        """Train, apply the client steps, mask, run the protocol; the unmasked mean per included
        client. Raises SecAggAborted when too few survive (the simulation keeps the model)."""
        self._expect_shares(self.sim.rounds.round)
        trained = []
        for task, update in self.sim.train_clients(tasks, global_params):
            sent = self.sim.apply_client_steps(task, update)  # a payload validation refuses is counted
            if sent is None:
                continue
            if not bool(torch.isfinite(sent.delta).all()):  # as a node does: never mask a NaN into the sum
                log.warning(
                    "round %d: %s's update has NaN/Inf entries; it is left out of the secure sum",
                    task.round,
                    task.client_id,
                )
                self.sim.rounds.rejected[NonFinite.code] = self.sim.rounds.rejected.get(NonFinite.code, 0) + 1
                continue
            trained.append((task, sent))
        if not trained:
            return
        if len(trained) > self.max_summands:
            raise SecAggAborted(
                f"{len(trained)} clients exceed the fixed-point encoding's headroom of "
                f"{self.max_summands} summands (a Poisson draw that far above K)"
            )
        round_ = trained[0][0].round
        seed = derive_seed(self.cfg.seed, self.sim.cfg.simulation.seed, round_)
        params = SecAggParams(
            session=f"shoal-sim/{seed}".encode(),
            vector_size=self.payload.vector_size,  # [update, weight] under DP: its algorithms mask nothing more
            graph=self.cfg.graph,
            degree=self.cfg.degree,
            threshold_fraction=self.cfg.threshold,
            graph_seed=seed,
            expected_dropout=self.expected_dropout,
            malicious=self.cfg.malicious_server,
            min_inputs=self.cfg.min_inputs,
        )
        drop_at = self._drop_at(sorted(task.client_id for task, _ in trained), round_)
        if self.ddg is not None:
            inputs = {task.client_id: u.delta.detach().cpu().numpy() for task, u in trained}
            out = self._discrete_gaussian_mean(inputs, params, drop_at, seed, round_)
            sums = SecureSums(out.mean, out.total_weight, len(out.included))
        else:
            noise = np.random.default_rng(seed)  # stochastic rounding
            encoded = {
                task.client_id: self.payload.encode(
                    dataclasses.replace(u, to_server=self.sim.held_to_server(task.client_id)),
                    example_weight(u.num_examples, self.max_weight, self.weighting), self.values, self.weights, noise,
                )
                for task, u in trained
            }  # fmt: skip
            result, cost = self.transport(params, encoded, drop_at, seed=seed)
            sums = self.payload.decode(result.total, len(result.included), self.values, self.weights)
            out = SecureMean(sums.mean, result.included, sums.total_weight, cost)
        if len(out.included) < self.noise_shares:
            # Fewer than t noise shares in the sum: it must not be used. A deployment checks this
            # before it asks for the unmasking shares; the simulator drops the sum it computed.
            raise SecAggAborted(
                f"{len(out.included)} clients survived, fewer than the t = {self.noise_shares} "
                "noise shares distributed DP needs for N(0, z^2 C^2) on the sum"
            )
        cost = out.cost
        self.last = {
            "included": len(out.included),
            "dropped": len(drop_at),
            "server_cpu_s": cost.server_s,
            "client_cpu_s": max(cost.client_s.values(), default=0.0),
        }
        log.info("round %d: secure sum of %d clients (%d dropped)", round_, len(out.included), len(drop_at))
        included = {task.client_id: (task, u) for task, u in trained if task.client_id in set(out.included)}
        members = {cid: (u.num_examples, u.metrics) for cid, (_, u) in included.items()}
        for cid, agg in zip(members, self.payload.updates(sums, members, 0), strict=True):
            task, u = included[cid]
            held = self.sim.held_to_server(cid)  # SCAFFOLD: the server's step sees only the sum of the dc
            held.update({k: v.to(global_params.device) for k, v in agg.to_server.items()})
            yield (
                task,
                Update(agg.delta.to(global_params.device), agg.num_examples, u.base_version, u.sender, agg.metrics),
            )

    def _codec(self, round_: int) -> DdgCodec:
        """The round's discrete Gaussian codec: its rotation's seed is public, derived from the round."""
        assert self.ddg is not None
        seed = derive_seed(self.cfg.seed, self.sim.cfg.simulation.seed, round_)
        return DdgCodec(self.ddg, derive_seed(seed, 0x40D))

    def _server_noise(self, round_: int) -> NoiseSource:
        """The server's own draws of the round (the top-up, or an empty round's noise)."""
        return NoiseSource.for_run(self.sim.cfg.privacy.reproducible, self.sim.cfg.simulation.seed, round_, -1)

    def _expect_shares(self, round_: int) -> None:
        """Tell the DP mean, before the round's sum or its absence, what the release carries: t shares
        sized for the fewest survivors, topped up to K_max; with the discrete Gaussian the top-up is in
        the integers and an empty round releases K_max integer shares in the round's rotation (the
        mechanism at n = 0: continuous noise would be off the lattice of every other release)."""
        agg = getattr(self.sim.rounds.strategy, "aggregator", None)
        if not self.noise_shares or agg is None or not hasattr(agg, "expect_shares"):
            return
        if self.ddg is None:
            agg.expect_shares(self.noise_shares, self.max_summands)
            return
        codec, k_max = self._codec(round_), self.max_summands

        def empty() -> torch.Tensor:
            return torch.from_numpy(codec.noise_only(k_max, self._server_noise(round_)))

        agg.expect_shares(self.noise_shares, k_max, in_sum=True, empty_release=empty)

    def _discrete_gaussian_mean(
        self, inputs: dict, params: SecAggParams, drop_at: dict[str, str], seed: int, round_: int
    ) -> SecureMean:
        """Encode each client's update with the distributed discrete Gaussian (and a 0 in the weight
        entry: every client weighs the same), securely sum, decode the sum; its mean over the included."""
        codec = self._codec(round_)  # the rotation's seed is public
        reproducible = self.sim.cfg.privacy.reproducible
        encoded = {}
        for cid, x in inputs.items():
            src = NoiseSource.for_run(reproducible, self.sim.cfg.simulation.seed, round_, int.from_bytes(cid.encode()))
            encoded[cid] = np.concatenate([codec.encode(x, src), np.zeros(1, dtype=np.uint32)])
        result, cost = self.transport(params, encoded, drop_at, seed=seed)
        # topped up here, in the integers, to K_max shares (the DP mean was told so: _expect_shares)
        topped = codec.top_up(result.total[:-1], self.max_summands - len(result.included), self._server_noise(round_))
        total = codec.decode(topped)
        n = max(len(result.included), 1)
        return SecureMean(total / n, result.included, float(n), cost)
