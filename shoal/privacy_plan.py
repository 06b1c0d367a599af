"""One privacy plan per run: what ``[privacy]`` makes every part of shoal do (docs/privacy.md).

:class:`PrivacyPlan` is built from the validated config (frozen, cheap: :func:`plan_of`) and
consulted by the simulator, the Ray workers, the server, the node and the gossip peer instead
of comparing ``privacy.mode`` strings: who adds the noise (:attr:`server_noise`, :attr:`client_shares`, :attr:`dp_sgd`),
the noise multiplier the accountant charges (:attr:`accounted_z`), and what a run may write or
send beside the model (:meth:`release_record`, :meth:`release_summary`, :meth:`noisy_round`).

The release policy (``privacy.release``) covers every figure a DP run writes or a node sends
besides the protected model:

* ``withhold`` (default): a metrics record keeps only figures that are not data-dependent or
  are post-processing of what the mechanism releases (round and version, the evaluation of
  the released model on the server's own held-out data, the privacy figures, protocol
  counters of gossip peers); the per-round train loss, example and result counts, bytes,
  rejections and the clients' evaluations on their own data are left out.
* ``noised``: as withhold, plus ``num_results_noisy`` (the round's result count + N(0, σ²),
  sensitivity 1 client) and ``train_loss_noisy`` (the sum of each result's train loss clipped
  to [0, L], + N(0, σ² L²), divided by the noisy count), σ = ``release_noise_multiplier``.
  Both are computed on the same sampled clients as the model, so the round is one Gaussian
  query on a vector with three blocks; its multiplier (for sensitivity 1 in the Mahalanobis
  norm) is z_eff = (z⁻² + 2 σ⁻²)^(-1/2), and the accountant charges every round at z_eff. With the
  distributed discrete Gaussian the round's unsampled RDP curve is the paper's bound for the sum
  plus α/σ² for the two figures, and the Poisson amplification bounds that whole curve.
* ``clear``: everything un-noised, as without DP. The epsilon then covers only the models; the
  records say ``release = "clear"``.

Local-DP nodes and peers send their noisy update and nothing data-dependent under any policy
(an example count of :data:`LOCAL_UPLOAD_EXAMPLES` and no metrics: client/node.py
``NodePrivacy.protect``, p2p/peer.py); under distributed DP with secure aggregation the example count travels
inside the masked vector (client/secure_node.py) and the train loss is not sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shoal.accounting_dpsgd import LocalDpSgdAccountant
from shoal.accounting_rounds import DdgRoundAccountant, RoundAccountant
from shoal.accounting_server import ServerViewAccountant
from shoal.noise import NoiseSource

#: privacy.release's choices
RELEASES = ("withhold", "noised", "clear")

#: figures of a metrics record that every policy keeps: not computed from the clients' data, or
#: post-processing of what the mechanism releases (the models) on data that is not the clients'
_KEPT = frozenset(
    {
        "round",
        "version",
        "elapsed_s",
        "virtual_time_s",
        "failed",  # the version not moving says as much
        "aborted",
        "stopped",
        "evaluation",
        # the privacy figures themselves
        "epsilon",
        "epsilon_server",  # against the server, which chose and saw the sample (no amplification)
        "server_accountant",
        "delta",
        "sampling",
        "sampling_rate",
        "accountant",
        "clip_norm",  # adaptive clipping moves C by a noisy, accounted count
        "privacy_mode",
        "rounds_charged",
        "target_epsilon",
        "nodes_reporting",
        "epsilon_node",
        "release",
        # gossip under local DP: every peer's model is a DP release; these are computed from
        # the released models or count protocol messages, never a peer's data
        "consensus_distance",
        "bytes_sent_per_peer",
        "bytes_sent_per_peer_per_round",
        "attackers",
        "rejected_messages",
        "bounded_merges",
        "online_peers",
        "aborted_groups",
        "messages_lost",
        "mean_age",
        "mean_view_size",
    }
)
#: prefixes of kept figures: the released model(s) evaluated on the server's (or simulator's)
#: own held-out test set
_KEPT_PREFIXES = ("test_", "average_model_", "peer_accuracy_")
#: the noised release's own fields
NOISY_FIELDS = ("num_results_noisy", "train_loss_noisy")
#: wall-clock figures of a deployed server's records: how long a round took depends on who was
#: sampled and what they hold (a round that sampled nobody closes at once, an aborted secure round
#: at its stage's deadline, a node's training time grows with its data), which no accountant covers
SERVED_TIMING = frozenset({"elapsed_s", "server_round_s", "server_cpu_s", "server_rss_mb"})

#: summary.json figures that are totals of per-round data-dependent counts
_SUMMARY_WITHHELD = frozenset(
    {
        "bytes_up_total",
        "bytes_down_total",
        "updates_accepted",
        "updates_rejected",
        "updates_rejected_total",
        "failed_rounds",
        "dropouts",
        "staleness",
    }
)
#: what a local-DP upload header may carry besides the update itself: its example count is
#: sent as 1 (the server weighs local-DP updates uniformly) and its metrics are empty
LOCAL_UPLOAD_EXAMPLES = 1


def combined_multiplier(z: float, release_z: float) -> float:
    """z_eff of the model's Gaussian (multiplier z) and the two noisy round figures (multiplier
    ``release_z`` each) released on the same sample: (z⁻² + 2 release_z⁻²)^(-1/2)."""
    if z <= 0 or release_z <= 0:
        return 0.0
    return (z**-2 + 2 * release_z**-2) ** -0.5


@dataclass(frozen=True)
class PrivacyPlan:
    """What ``[privacy]`` means for every part of a run (the module doc)."""

    mode: str = "none"
    noise_multiplier: float = 0.0
    clip_norm: float = 1.0
    delta: float = 1e-5
    sampling: str = "poisson"
    accountant: str = "rdp"
    release: str = "withhold"
    release_noise_multiplier: float = 5.0
    release_loss_clip: float = 5.0
    adaptive_clipping: bool = False
    secure: bool = False
    local_sampling_rate: float = 0.0

    @classmethod
    def from_config(cls, cfg: Any) -> PrivacyPlan:
        """The plan of a full Config (its ``privacy`` and ``secure_aggregation`` sections)."""
        p = cfg.privacy
        return cls(
            mode=p.mode,
            noise_multiplier=float(p.noise_multiplier),
            clip_norm=float(p.clip_norm),
            delta=float(p.delta),
            sampling=p.sampling,
            accountant=p.accountant,
            release=p.release,
            release_noise_multiplier=float(p.release_noise_multiplier),
            release_loss_clip=float(p.release_loss_clip),
            adaptive_clipping=bool(p.adaptive_clipping),
            secure=bool(cfg.secure_aggregation.enabled),
            local_sampling_rate=float(p.local_sampling_rate),
        )

    # --- who adds the noise ------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def user_level(self) -> bool:
        """Central or distributed DP: one client is the unit, rounds are charged by the sampling."""
        return self.mode in ("central", "distributed")

    @property
    def server_noise(self) -> bool:
        """Central DP: the server clips each update and adds the noise."""
        return self.mode == "central"

    @property
    def client_shares(self) -> bool:
        """Distributed DP: each client clips and adds its share of the noise."""
        return self.mode == "distributed"

    @property
    def dp_sgd(self) -> bool:
        """Local DP: each client (or peer) trains with DP-SGD and accounts per example."""
        return self.mode == "local"

    @property
    def round_sampling(self) -> str:
        """How sync rounds pick clients: the accountant's sampling for user-level DP, else K of N."""
        return self.sampling if self.user_level else "fixed"

    @property
    def accounted_z(self) -> float:
        """The multiplier every user-level round is charged at: z, or z_eff with noised figures."""
        if self.release == "noised" and self.user_level:
            return combined_multiplier(self.noise_multiplier, self.release_noise_multiplier)
        return self.noise_multiplier

    # --- the accountants ----------------------------------------------------------------

    def round_accountant(
        self,
        q: float,
        *,
        sampling: str | None = None,
        num_clients: int | None = None,
        sample_size: int | None = None,
        clip: float | str | None = None,
    ) -> RoundAccountant:
        """User-level DP's accountant (simulator and server): one event per round at
        :attr:`accounted_z`, for ``sampling`` (default: the config's)."""
        return RoundAccountant(
            q,
            self.accounted_z,
            self.delta,
            self.accountant,
            sampling=sampling or self.sampling,
            num_clients=num_clients,
            sample_size=sample_size,
            clip=clip,
        )

    @property
    def guards_against_server(self) -> bool:
        """Whether any noise protects against the server itself: distributed DP under secure
        aggregation (the server sees only the sum of at least t noisy shares)."""
        return self.client_shares and self.secure

    def server_view_accountant(self, ddg: dict | None = None) -> ServerViewAccountant | None:
        """The accountant of epsilon against the server (no amplification by the sample it chose and
        saw), or None where nothing protects against it (central DP, distributed DP in the clear).
        ``ddg``: the distributed discrete Gaussian's parameters when that is the mechanism."""
        if not self.guards_against_server:
            return None
        acc = ServerViewAccountant(self.delta, self.accountant, replace_one=self.sampling == "fixed")
        acc.set_mechanism(self.noise_multiplier, ddg)
        return acc

    def server_view_fields(self, acc: ServerViewAccountant | None) -> dict[str, Any]:
        """``epsilon_server`` and ``server_accountant`` of a user-level record ({} otherwise): the
        worst node's epsilon against the server, or None with the reason where nothing protects
        against it."""
        if not self.user_level:
            return {}
        if acc is not None:
            return {"epsilon_server": acc.epsilon, "server_accountant": acc.describe()}
        if self.server_noise:
            why = "none: the server sees each clipped update in the clear and adds the noise (central DP trusts it)"
        else:
            why = (
                "none: without secure aggregation the server sees each update, which carries only its share "
                "z C / sqrt(t) of the noise"
            )
        return {"epsilon_server": None, "server_accountant": why}

    @property
    def release_z(self) -> float:
        """The multiplier of the noised round figures when they are released (0 otherwise)."""
        return self.release_noise_multiplier if self.release == "noised" and self.user_level else 0.0

    def ddg_accountant(self, q: float, ddg: dict) -> DdgRoundAccountant:
        """The distributed discrete Gaussian's accountant (simulator and server): its paper's bound per
        round, plus the noised round figures' Gaussian (:attr:`release_z`) composed on the same sample."""
        return DdgRoundAccountant(q, ddg, self.delta, self.release_z, self.accountant)

    def local_accountant(self, schedules: dict[str, tuple[float, int]]) -> LocalDpSgdAccountant:
        """Local DP-SGD's accountant (simulator, node, peer): per client over its participations."""
        return LocalDpSgdAccountant(schedules, self.noise_multiplier, self.delta, self.accountant)

    # --- what a run releases -------------------------------------------------------------

    @property
    def node_reports(self) -> bool:
        """Local DP: whether a node sends its privacy report {epsilon, epsilon_next, delta, rounds}
        with its update. Only when the report says nothing of the node's data: with
        ``local_sampling_rate`` the schedule, and so the report, is the config's (the server checks
        it); with q = B / n_k the report reveals roughly n_k, so it is sent only under ``release =
        "clear"``. Otherwise each node keeps its epsilon and enforces ``target_epsilon`` itself."""
        return self.dp_sgd and (self.local_sampling_rate > 0 or self.release == "clear")

    @property
    def withholds(self) -> bool:
        """Whether data-dependent figures are left out of records (DP on, release not clear)."""
        return self.enabled and self.release != "clear"

    @property
    def client_evaluations(self) -> bool:
        """Whether clients may evaluate models on their own data and report it (not under DP
        unless the release is clear: the figures are of the clients' data and un-noised)."""
        return not self.withholds

    def release_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """The part of a metrics record this policy lets out (a new dict)."""
        if not self.enabled:
            return dict(record)
        if self.release == "clear":
            return {**record, "release": "clear"}
        out = {
            k: v
            for k, v in record.items()
            if k in _KEPT or k.startswith(_KEPT_PREFIXES) or (self.release == "noised" and k in NOISY_FIELDS)
        }
        out["release"] = self.release
        return out

    def release_served_record(self, record: dict[str, Any]) -> dict[str, Any]:
        """What of a deployed server's metrics record (``shoal server``, a federation's run) this
        policy lets out: :meth:`release_record` without the wall-clock figures (:data:`SERVED_TIMING`)
        whenever it withholds, so a record's fields and values do not tell an aborted round from an
        empty one, nor time who was sampled. The operator's log and views keep the timing."""
        out = self.release_record(record)
        if not self.withholds:
            return out
        return {k: v for k, v in out.items() if k not in SERVED_TIMING}

    def release_summary(self, figures: dict[str, Any]) -> dict[str, Any]:
        """summary.json figures without the totals of withheld per-round counts."""
        if not self.withholds:
            return dict(figures)
        return {k: v for k, v in figures.items() if k not in _SUMMARY_WITHHELD}

    def noisy_round(
        self, num_results: int, client_losses: list[float] | None, noise: NoiseSource | None = None
    ) -> dict[str, float | None]:
        """``noised``: the round's result count and mean train loss with Gaussian noise (the
        module doc); {} under any other policy. Every loss is clipped to [0, L], a non-finite or
        missing one (NaN) to L, so no branch looks at the clients' values: the loss is left out (None)
        only for reasons that hold whatever the data, when the losses were summed where they trained
        (``client_losses`` None, Ray workers) or are never sent (distributed DP under secure
        aggregation), and when the noisy count is below 1 (post-processing). It is charged all the same.
        ``noise``: a fresh OS-keyed CSPRNG by default (shoal.noise: draws that resist the
        floating-point attack, like every other noise a guarantee rests on)."""
        if self.release != "noised" or not self.user_level:
            return {}
        unit = (noise or NoiseSource()).gaussian(2, 1.0)
        s, cap = self.release_noise_multiplier, self.release_loss_clip
        count = num_results + s * float(unit[0])
        sent = client_losses is not None and not (self.client_shares and self.secure)
        clipped = (cap if math.isnan(x) else min(max(x, 0.0), cap) for x in client_losses or [])
        loss_sum = sum(clipped) + s * cap * float(unit[1])
        return {"num_results_noisy": count, "train_loss_noisy": loss_sum / count if sent and count >= 1 else None}

    def describe_release(self) -> str:
        """One line for logs and summaries."""
        if not self.enabled:
            return "no DP: every figure is released"
        if self.release == "clear":
            return "release = clear: per-round figures un-noised, NOT covered by the epsilon"
        if self.release == "noised":
            return (
                f"release = noised: result count and train loss (clipped to [0, {self.release_loss_clip:g}]) with "
                f"noise multiplier {self.release_noise_multiplier:g}; rounds charged at z_eff = {self.accounted_z:.4g}"
            )
        return "release = withhold: no data-dependent per-round figure is written"


def plan_of(cfg: Any) -> PrivacyPlan:
    """The plan of ``cfg``; configs are plain dataclasses, so this is cheap enough to call at set-up."""
    return PrivacyPlan.from_config(cfg)
