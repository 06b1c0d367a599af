"""Secure aggregation in the in-process simulator (``[secure_aggregation] enabled = true``).

Each round the selected clients train as usual, run their client steps (DP noise,
compression, ... come before masking), encode ``[w_k * clip(delta_k), w_k]`` in fixed
point and run the whole protocol of :mod:`shoal.aggregation.secagg` in memory, with
dropouts injected at each stage. The strategy then receives only the unmasked
weighted mean ``sum_k w_k delta_k / sum_k w_k``, once per included client with that
client's example count, so its own weighting reproduces the same mean. A round the
protocol aborts (too few survivors) applies nothing: the global model and version stay.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch

from shoal.aggregation.secagg import SecAggAborted, SecAggParams
from shoal.aggregation.secagg_encoding import FixedPoint, example_weight
from shoal.aggregation.secagg_group import secure_weighted_mean
from shoal.aggregation.secagg_memory import STAGES, injected_dropouts
from shoal.errors import NonFinite, WireError
from shoal.rounds import RoundSummary, Assignment
from shoal.seeding import derive_seed, rng
from shoal.update import Update

log = logging.getLogger(__name__)


class SecureAggregationRounds:
    """Installed on an InProcessSimulation by :func:`install`; keeps the last round's
    protocol outcome in ``last`` (included, dropped, server/client CPU seconds)."""

    def __init__(self, sim):
        self.sim = sim
        self.cfg = sim.cfg.secure_aggregation
        # distributed DP's server divides the plain sum by K: every client weighs the same
        self.weighting = "uniform" if sim.cfg.privacy.mode == "distributed" else sim.cfg.strategy.weighting
        k = sim.rounds.sample_size(len(sim.client_ids))
        self.values = FixedPoint(self.cfg.clip, self.cfg.bits, k)   # raises if k x 2^bits > 2^32
        self.weights = FixedPoint(1.0, self.cfg.bits, k)
        self.max_weight = self.cfg.max_weight or max(sim.shards.size(i) for i in range(len(sim.shards)))
        lost = 1 - math.prod(1 - getattr(self.cfg, f"dropout_{s}") for s in STAGES[:3])
        self.expected_dropout = min(max(lost, 0.1), 0.99)  # sizes an automatic secagg+ degree
        self._train = sim.train_clients
        self._steps = sim.client_steps
        self.last: dict = {}

    def _drop_at(self, ids: list[str], round_: int) -> dict[str, str]:
        """Which client drops at which stage: at each stage it is still in, a client
        drops with that stage's configured probability."""
        rates = [getattr(self.cfg, f"dropout_{s}") for s in STAGES]
        draws = rng(self.cfg.seed, self.sim.cfg.simulation.seed, round_, 1).random((len(ids), len(STAGES)))
        return injected_dropouts(ids, rates, draws)

    def train_clients(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        trained = []
        for task, update in self._train(tasks, global_params):
            try:
                for step in self._steps:
                    update = step(task, update)
            except WireError as e:  # validation refused the payload: counted, never masked in
                self.sim.rounds.rejected[e.code] = self.sim.rounds.rejected.get(e.code, 0) + 1
                continue
            if not bool(torch.isfinite(update.delta).all()):  # as a node does: never mask a NaN into the sum
                log.warning("round %d: %s's update has NaN/Inf entries; it is left out of the secure sum",
                            task.round, task.client_id)
                self.sim.rounds.rejected[NonFinite.code] = self.sim.rounds.rejected.get(NonFinite.code, 0) + 1
                continue
            trained.append((task, update))
        if not trained:
            return
        round_ = trained[0][0].round
        seed = derive_seed(self.cfg.seed, self.sim.cfg.simulation.seed, round_)
        inputs, weights = {}, {}
        for task, u in trained:
            weights[task.client_id] = example_weight(u.num_examples, self.max_weight, self.weighting)
            inputs[task.client_id] = u.delta.detach().cpu().numpy()
        params = SecAggParams(
            session=f"shoal-sim/{seed}".encode(), vector_size=self.sim.spec.numel + 1, graph=self.cfg.graph,
            degree=self.cfg.degree, threshold_fraction=self.cfg.threshold, graph_seed=seed,
            expected_dropout=self.expected_dropout, malicious=self.cfg.malicious_server,
        )
        drop_at = self._drop_at(sorted(inputs), round_)
        out = secure_weighted_mean(inputs, weights, params, self.values, self.weights, drop_at, seed)
        mean = torch.from_numpy(out.mean).to(torch.float32).to(global_params.device)
        cost = out.cost
        self.last = {
            "included": len(out.included), "dropped": len(drop_at),
            "server_cpu_s": cost.server_s, "client_cpu_s": max(cost.client_s.values(), default=0.0),
        }
        log.info("round %d: secure sum of %d clients (%d dropped)", round_, len(out.included), len(drop_at))
        included = set(out.included)
        for task, u in trained:
            if task.client_id in included:
                yield task, Update(mean, u.num_examples, u.base_version, u.sender, u.metrics)

    def run_round(self, run_round) -> RoundSummary:
        try:
            return run_round()
        except SecAggAborted as e:
            log.warning("round %d aborted, model unchanged: %s", self.sim.rounds.round, e)
            self.last = {"aborted": str(e)}
            return self.sim.rounds.abort_round()


def install(sim) -> SecureAggregationRounds:
    """Route ``sim``'s rounds through secure aggregation: its client steps run before
    masking (inside the secure ``train_clients``), and an aborted round is closed
    without touching the model."""
    secure = SecureAggregationRounds(sim)
    sim.client_steps = []
    sim.train_clients = secure.train_clients
    plain_round = sim.run_round
    sim.run_round = lambda: secure.run_round(plain_round)
    sim.secure_aggregation = secure
    return secure
