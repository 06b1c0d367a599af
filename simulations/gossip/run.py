"""The gossip simulation (``simulation.mode = "gossip"``): the shared virtual network plus the
algorithm ``gossip.algorithm`` names, driven through the run loop like every engine.

With ``privacy.mode = "local"`` every peer trains with DP-SGD (the network's trainer) and
:class:`~shoal.privacy_state.PrivacyBudget` accounts each peer's example-level epsilon
over the local trainings it actually ran (``GossipNetwork.trained``, round by round): whatever
a peer sends is post-processing of its DP-SGD outputs and of other peers' independent data.
Records and the summary get ``epsilon`` (the worst peer), ``delta`` and the ``accountant``; the
run stops before a round that could take epsilon past ``privacy.target_epsilon``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from shoal.assembly import GossipParts
from shoal.config import Config
from shoal.privacy_plan import plan_of
from shoal.privacy_state import PrivacyBudget
from shoal.rounds import evaluation_due

from ..run_loop import OnRecord, Report, Step, run_engine
from .dpsgd import DPSGD
from .group_average import GroupAverage
from .network import GossipNetwork, PeerPool
from .push_pull import PushPullGossip
from .secure_groups import SecureGroups


class GossipAlgorithm(Protocol):
    """One round of an algorithm on the network it was built with."""

    leave_mid_round: bool  # churn's leavers stay to vanish during the round (GossipNetwork.churn)

    def run_round(self) -> None: ...

    def metrics(self) -> dict[str, float]:
        """The algorithm's own counters, added to the network's metrics."""
        ...


ALGORITHMS: dict[str, Callable[[GossipNetwork], GossipAlgorithm]] = {
    "gossip": PushPullGossip,
    "dpsgd": DPSGD,
    "group_average": GroupAverage,
    "secure_groups": SecureGroups,
}


class GossipSimulation(GossipNetwork):
    """The network with its algorithm; ``run_round`` advances one round. ``peers`` makes the
    pool that runs local training (default: LocalPeers, here), as ``clients`` does for
    InProcessSimulation."""

    def __init__(self, parts: GossipParts, peers: Callable[[GossipNetwork], PeerPool] | None = None):
        super().__init__(parts, peers)
        cfg = parts.cfg
        self.algorithm = ALGORITHMS[cfg.gossip.algorithm](self)
        # local DP-SGD (config rules refuse the other modes in gossip); refuses a target below one round
        self.privacy = (
            None
            if not plan_of(cfg).enabled
            else PrivacyBudget(cfg, {p: self.shards.size(i) for i, p in enumerate(self.ids)}, sampling="online")
        )

    def run_round(self) -> None:
        self.round += 1
        self.trained = []
        self.churn(leave_mid_round=self.algorithm.leave_mid_round)
        self.algorithm.run_round()
        if self.privacy is not None:
            self.privacy.record_participants([self.ids[i] for i in self.trained])

    # --- the Engine the run loop drives (simulations/run_loop.py) ---------------------------

    x_axis = "round"

    @property
    def label(self) -> str:
        return self.task_label

    @property
    def title(self) -> str:
        return f"{self.task_label} / {self.cfg.gossip.algorithm}"

    def drive(self, report: Report) -> None:
        """``simulation.rounds`` rounds (fewer when the privacy budget runs out); the round that
        exhausts the budget is evaluated."""
        sim_cfg = self.cfg.simulation
        for r in range(1, sim_cfg.rounds + 1):
            self.run_round()
            stop = not self.allows_next_round()
            due = evaluation_due(r, sim_cfg.eval_every, sim_cfg.rounds, stop)
            report(Step(1, {"round": r, **self.evaluate()} if due else None))
            if stop:
                break

    def figures(self, last: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "final_average_model_accuracy": last.get("average_model_accuracy"),
            "final_consensus_distance": last.get("consensus_distance"),
            "bytes_sent_per_peer": last.get("bytes_sent_per_peer"),
            "bytes_sent_per_peer_per_round": last.get("bytes_sent_per_peer_per_round"),
            "rounds": self.round,
            "num_clients": self.n,
            "num_parameters": self.spec.numel,
            "device": str(self.device),
            **self.pool_figures(),
        }
        if self.privacy is not None:
            out.update(self.privacy.summary())  # epsilon, delta, sampling, accountant
        return out

    def close(self) -> None:
        """Nothing to free: a pool of workers belongs to whoever passed it (the Ray engine)."""

    def pool_figures(self) -> dict[str, Any]:
        """What the peer pool says of itself for summary.json (the Ray engine: its workers)."""
        figures = getattr(self.peers, "figures", None)
        return figures() if callable(figures) else {}

    def allows_next_round(self) -> bool:
        """False (with a message) when one more round could take epsilon past privacy.target_epsilon."""
        return self.privacy is None or self.privacy.allows_next_round()

    def evaluate(self) -> dict[str, Any]:
        """Metrics over the honest peers (all peers when there is no attack); with DP, the epsilon
        so far (the worst peer's), delta, who trains (``sampling``) and the accountant."""
        out: dict[str, Any] = self.peer_metrics(self.algorithm.metrics())
        if self.privacy is not None:
            out.update(self.privacy.summary())
        return out


def run_gossip_simulation(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: OnRecord | None = None,
    peers: Callable[[GossipNetwork], PeerPool] | None = None,
) -> dict[str, Any]:
    """Run ``simulation.rounds`` gossip rounds (fewer when the privacy budget runs out) through the
    run loop (metrics.jsonl, summary.json, plots); the round that exhausts the budget is evaluated.
    ``peers``: who trains the peers (default here; the Ray engine passes its workers)."""
    return run_engine(lambda: GossipSimulation.from_config(cfg, peers=peers), cfg, out_dir, progress, on_record)
