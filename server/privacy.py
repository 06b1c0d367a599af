"""``[privacy]`` in `shoal server`: differential privacy in a deployment (docs/privacy.md).

:class:`ServerPrivacy` is everything DP adds to the service, in one place and without I/O
(the service calls it when a round opens or closes, when an update or a node's report
arrives, and when it writes records, status and checkpoints). It is built from the
objects the simulator runs, not a second implementation: the DP strategy of
aggregation.dp (``make_dp_strategy``), the accountants of shoal.accounting, SyncRounds'
Poisson sampling, and for secure aggregation the protocol's own threshold and the
fixed-point range check of aggregation.secagg.encoding.

* ``central``: DP-FedAvg. Each round selects every connected node independently with
  probability q = K / N, where K = ``server.clients_per_round`` and N = the registered
  (enabled) nodes when the server starts. N is the population the accountant needs:
  add/remove-one-node DP amplified by Poisson sampling holds when every node that could
  ever contribute joins a round with probability at most q, independently of the others
  and of the data. Registered nodes are that population (a node must be registered to
  send anything); the connected ones are a subset that changes with the network, so a
  rate q = K / connected could exceed the q the accountant uses. A node not connected is
  selected with probability 0 <= q, which only helps. The server clips each update to C
  and adds N(0, z²C²) to the sum (fixed or adaptive clipping), divided by K.
* ``distributed``: each node clips and adds N(0, z²C²/t). With secure aggregation t is
  the fewest survivors the protocol accepts for a round of K (raised by
  ``privacy.min_survivors``), and the round is aborted before any unmasking share is
  asked for when fewer than t masked inputs arrived (:meth:`ServerPrivacy.check_survivors`),
  or more than K_max (``aggregation.dp.cohort_cap``: a Poisson draw that far above K); the DP
  mean tops the sum up to K_max shares, so the released noise does not tell the count;
  in the clear t is the number the round selected and the server adds what a missing
  share lacked (``DPMean.missing_share_std``).
* ``local``: each node trains with DP-SGD and reports its own epsilon with its update
  (:func:`parse_report`); the server shows them and stops when the worst node's next
  round would pass ``privacy.target_epsilon``.

Randomness the server's adversaries could know is not used where privacy depends on it
(the config, and so ``simulation.seed``, is given to every node): the Poisson draws and the
task seeds come from a keyed BLAKE2b of a 256-bit secret drawn from the OS when the run
binds (shoal.seeding.secret_rng / secret_seed), so nobody can recompute which rounds a node
was sampled in, nor another node's task seed from its own; the central noise generator is
seeded from the OS (torch's generator takes 63 bits).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from typing import Any

import torch

from shoal.accounting import check_delta_against
from shoal.accounting import epsilon as dp_epsilon
from shoal.accounting_aborts import bounded_branches, flip_probability
from shoal.accounting_dpsgd import dp_sgd_schedule
from shoal.accounting_rounds import DdgRoundAccountant, LedgerMismatch, RoundAccountant
from shoal.accounting_server import ServerViewAccountant
from shoal.aggregation.discrete_gaussian import DdgCodec, DdgParams, plan, rotation_seed
from shoal.aggregation.dp import DPMean, cohort_cap, make_dp_strategy, share_std
from shoal.aggregation.secagg import SecAggAborted
from shoal.aggregation.secagg.encoding import FixedPoint, check_noise_range
from shoal.aggregation.strategy import Strategy
from shoal.config import Config
from shoal.errors import ConfigError, Malformed, short_repr
from shoal.noise import NoiseSource
from shoal.privacy_plan import LOCAL_UPLOAD_EXAMPLES, plan_of
from shoal.rounds import RoundSummary, SyncRounds
from shoal.secure_sizing import min_survivors

log = logging.getLogger(__name__)

#: what a secagg+ degree is sized for in server rounds (server/secure_round.py uses the same)
EXPECTED_DROPOUT = 0.1
#: the fields of a node's local-DP report (header field ``privacy`` of an update, or the
#: ``privacy`` meta of its secure-aggregation keys)
REPORT_FIELDS = ("epsilon", "epsilon_next", "delta", "rounds")
MAX_NODE_EPSILONS = 10_000  # nodes shown one by one in status / Prometheus


def secret_session(round_: int) -> bytes:
    """A secure round's session: fresh per aggregation (16 bytes from the OS), so a round re-run after
    a restart never reuses keys or masks, and the discrete Gaussian's rotation (derived from it) is
    secret."""
    return f"shoal-server/{round_}/".encode() + secrets.token_bytes(16)


def secret_rotation(round_: int) -> int:
    """A rotation seed drawn as a secure round's is (from a :func:`secret_session`), for a
    discrete-Gaussian round that releases noise alone (it selected nobody, or it aborted): a seed
    anyone could derive would let them read that release on its lattice and tell such a round from
    one with updates, whose rotation is secret."""
    return rotation_seed(secret_session(round_))


def check_deployable(cfg: Config) -> None:
    """Refuse (ConfigError naming the key and the fix) a [privacy] config `shoal server`
    cannot run with the guarantee it would report."""
    p, s, a = cfg.privacy, cfg.server, cfg.asynchronous
    mode = p.mode
    if s.mode != "sync":
        raise ConfigError(
            f"privacy.mode = {mode!r} needs server.mode = 'sync' (it is {s.mode!r}): the accountant "
            "counts sampled synchronous rounds"
        )
    if p.noise_multiplier <= 0:
        raise ConfigError(
            f"privacy.mode = {mode!r} with privacy.noise_multiplier = 0 adds no noise (epsilon is "
            "infinite); set a noise multiplier > 0, or privacy.mode = 'none'"
        )
    if plan_of(cfg).dp_sgd:
        return
    if not s.clients_per_round:
        raise ConfigError(
            f"privacy.mode = {mode!r} in shoal server needs server.clients_per_round = K > 0: each "
            "connected node joins a round with probability q = K / N (N = the registered nodes), "
            "and the noisy sum is divided by K (server.fraction of the connected nodes would make "
            "q change with the network)"
        )
    if p.sampling != "poisson":
        raise ConfigError(
            "privacy.sampling = 'fixed' in shoal server: the server can only pick among the "
            "connected nodes, so a node's chance K / connected can exceed the K / N that the "
            "fixed-size accountant assumes; use privacy.sampling = 'poisson'"
        )
    if a.over_selection:
        raise ConfigError(
            f"asynchronous.over_selection = {a.over_selection} with privacy.mode = {mode!r}: Poisson "
            "sampling decides each node alone; set it to 0"
        )
    if a.late != "drop":
        raise ConfigError(
            f"asynchronous.late = {a.late!r} with privacy.mode = {mode!r}: a late update would join a "
            "round it was not sampled for, which the accountant does not cover; set late = 'drop'"
        )


def secure_noise_shares(cfg: Config, k: int) -> int:
    """t for distributed DP with secure aggregation: the fewest survivors the protocol accepts
    in a round of ``k`` nodes (its threshold), raised to ceil(privacy.min_survivors k)."""
    threshold = min_survivors(cfg.secure_aggregation, k, EXPECTED_DROPOUT)
    return max(threshold, math.ceil(cfg.privacy.min_survivors * k - 1e-9))


def _number(obj: dict, key: str, low: float, high: float = math.inf) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and low <= v <= high):
        raise Malformed(
            f"privacy report field {key!r} must be a finite number in [{low:g}, {high:g}], got {short_repr(v)}"
        )
    return float(v)


def parse_report(obj: Any, delta: float) -> dict[str, float | int]:
    """A node's local-DP report ``{epsilon, epsilon_next, delta, rounds}``, checked; Malformed if it is not one."""
    if not isinstance(obj, dict):
        raise Malformed(
            "privacy.mode = 'local': the update must carry its node's privacy report, an object "
            f"{{{', '.join(REPORT_FIELDS)}}} (header field 'privacy')"
        )
    unknown = sorted(str(k)[:40] for k in set(obj) - set(REPORT_FIELDS))
    if unknown:
        raise Malformed(f"privacy report has unknown fields {unknown[:5]}; expected {', '.join(REPORT_FIELDS)}")
    eps = _number(obj, "epsilon", 0.0)
    nxt = _number(obj, "epsilon_next", eps)
    d = _number(obj, "delta", 0.0, 1.0)
    if not math.isclose(d, delta, rel_tol=1e-9):
        raise Malformed(
            f"privacy report is at delta = {d:g}, the server's privacy.delta is {delta:g}: run the node "
            "with the server's [privacy] table"
        )
    rounds = obj.get("rounds")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or not 1 <= rounds <= 2**31:
        raise Malformed(f"privacy report field 'rounds' must be an integer >= 1, got {short_repr(rounds)}")
    return {"epsilon": eps, "epsilon_next": nxt, "delta": d, "rounds": rounds}


class ServerPrivacy:
    """The DP state of one server (see the module doc). ``strategy`` is the round strategy for
    central and distributed DP (None for local: the plain strategy averages DP-SGD updates)."""

    def __init__(self, cfg: Config, numel: int, device: str = "cpu"):
        check_deployable(cfg)
        self.cfg, self.p = cfg, cfg.privacy
        self.plan = plan_of(cfg)  # what the run may write beside the models (privacy.release)
        self.mode = self.p.mode  # for records and the ledger; decisions ask self.plan
        self.user_level = self.plan.user_level
        self.secure = cfg.secure_aggregation.enabled
        self.k = cfg.server.clients_per_round
        self.strategy: Strategy | None = None
        if self.user_level:  # the same strategy the simulator builds, its noise from the OS (seed=None)
            self.strategy = make_dp_strategy(cfg.strategy, self.p, numel, self.k, device, seed=None)
        self.noise_shares = 0  # t of distributed DP with secure aggregation
        if self.plan.client_shares and self.secure:
            self.noise_shares = secure_noise_shares(cfg, self.k)
        self.round_shares = 0  # t of the open round (in the clear: the nodes it selected)
        self.cohort = 0  # secure distributed DP: K_max, the shares the released sum is topped up to (bind)
        self.registered: int | None = None
        self.q: float | None = None
        self.accountant: RoundAccountant | DdgRoundAccountant | None = None
        self.numel = numel
        self.ddg: DdgParams | None = None  # the distributed discrete Gaussian's parameters (bind)
        self.rounds_charged = 0
        self.reports: dict[str, dict] = {}  # local: node -> its last report
        self.stopped: str | None = None
        self._saved_q: float | None = None
        self._saved_ledger: dict | None = None
        # epsilon against the server itself (distributed DP under secure aggregation; bind)
        self.server_view: ServerViewAccountant | None = None
        self._saved_server_view: dict | None = None
        self.empty_rotation = 0  # the secret rotation seed of the open round's noise-only release (DDG)

    # --- set-up ----------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return not self.user_level or self.accountant is not None

    def bind(self, registered: int, rounds: SyncRounds) -> None:
        """N is known (the registry's enabled nodes): fix q = K / N for the run, build the
        accountant, and check what can be checked before any round (ConfigError)."""
        if not self.user_level or self.accountant is not None:
            return
        p, sa = self.p, self.cfg.secure_aggregation
        if registered < self.k:
            raise ConfigError(
                f"privacy.mode = {self.mode!r}: server.clients_per_round = {self.k} is more than the "
                f"{registered} registered nodes (N); q = K / N must be <= 1: register more nodes "
                "(`shoal server nodes add`) or lower clients_per_round"
            )
        try:  # N = the registered nodes: the population a user-level guarantee is about
            check_delta_against(p.delta, registered, "registered nodes")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.registered = registered
        if self.noise_shares:
            self.cohort = max(cohort_cap(registered, self.k), self.noise_shares)
        q = self.k / registered
        if self._saved_q is not None and not math.isclose(self._saved_q, q):
            log.warning(
                "privacy: this run samples at q = %.4g (K / N when it started); the registry now gives "
                "%d / %d = %.4g: keeping q = %.4g, which every charged round used",
                self._saved_q,
                self.k,
                registered,
                q,
                self._saved_q,
            )
            q = self._saved_q
        self.q = q
        clip: float | str = "adaptive" if p.adaptive_clipping else float(p.clip_norm)
        ddg: dict | None = None
        if p.mechanism == "discrete_gaussian":  # nodes add integer noise while encoding, sized for t
            self.ddg = plan(
                self.numel, p.clip_norm, p.noise_multiplier, self.noise_shares, max(registered, self.noise_shares),
                p.bits, p.beta, p.gamma, p.rotation,
            )  # fmt: skip
            ddg = {**self.ddg.as_dict(), "sensitivity_sq": self.ddg.sensitivity_sq()}
            self.accountant = self.plan.ddg_accountant(q, ddg)  # with the noised figures' cost, if released
        else:
            # z_eff when the rounds' figures are released noised too (PrivacyPlan.accounted_z)
            self.accountant = self.plan.round_accountant(q, sampling="poisson", clip=clip)
        self.server_view = self.plan.server_view_accountant(ddg)
        if self.noise_shares:  # secure distributed DP: what its aborts cost
            self._charge_aborts(registered, q)
        self._restore_ledger()  # a restart: earlier rounds as they ran, whatever z is now
        if self.accountant.rounds != self.rounds_charged:
            raise ConfigError(
                f"the privacy ledger in server.checkpoint_dir counts {self.rounds_charged} charged rounds but records "
                f"the noise of {self.accountant.rounds}: it was written by an older shoal and cannot be priced "
                "soundly at today's settings; start the run anew (another server.checkpoint_dir, or --fresh)"
            )
        if self.secure:  # any round size up to N must fit the modulus; the noise must fit the range
            FixedPoint(sa.clip, sa.bits, registered)
            if self.plan.client_shares and self.ddg is None:
                check_noise_range(FixedPoint(sa.clip, sa.bits, 1), p.clip_norm, self.share_std, self.noise_shares)
        if p.target_epsilon and self.rounds_charged == 0 and self.accountant.next_epsilon() > p.target_epsilon:
            raise ConfigError(
                f"privacy.target_epsilon = {p.target_epsilon:g} is below the epsilon of a single round "
                f"({self.accountant.next_epsilon():.3g} at delta = {p.delta:g}); raise it or raise "
                "privacy.noise_multiplier"
            )
        rounds.poisson_rate = q
        # Poisson draws and task seeds from a keyed hash of 256 bits from the OS: nobody can
        # recompute them from the config, nor from the task seeds the nodes see
        rounds.secret = secrets.token_bytes(32)
        log.info(
            "privacy: %s; N = %d registered nodes, K = %d%s",
            self.accountant.describe(),
            registered,
            self.k,
            f"; each node adds N(0, {self.share_std:.4g}^2) for t = {self.noise_shares} survivors at least"
            if self.noise_shares
            else "",
        )

    def _charge_aborts(self, registered: int, q: float) -> None:
        """Secure distributed DP: an aborted round releases what an empty round does (SecureRound.close),
        and whether a round aborts depends on who was sampled; the accountant prices each round as the
        mixture of shoal.accounting_aborts.bounded_branches: with probability privacy.abort_bound (never
        below the chance without dropouts) a node's presence decides the abort, at sensitivity K_max C."""
        assert self.accountant is not None
        t, k_max = self.noise_shares, max(self.cohort, self.noise_shares)
        least = flip_probability(registered, q, t, k_max)
        bound = self.p.abort_bound
        if bound < least:
            raise ConfigError(
                f"privacy.abort_bound = {bound:g} is below {least:.3g}, the chance that a sampled node's presence "
                f"decides whether a round aborts even without dropouts (t = {t}, K_max = {k_max}, N = {registered}, "
                f"q = {q:.4g}); raise it"
            )
        self.accountant.abort_branches = bounded_branches(bound, k_max)
        log.log(
            logging.WARNING if bound >= 1 else logging.INFO,
            "privacy: a secure round that aborts (fewer than t = %d or more than K_max = %d survivors) is released "
            "as an empty round; each round is charged as a node deciding the abort with probability %.3g (%s), "
            "at sensitivity K_max C (docs/privacy.md, 'Aborted rounds')",
            t,
            k_max,
            bound,
            "privacy.abort_bound: the worst case, which makes epsilon large" if bound >= 1 else "privacy.abort_bound",
        )

    @property
    def share_std(self) -> float:
        return share_std(self.p.clip_norm, self.p.noise_multiplier, max(self.noise_shares or self.round_shares, 1))

    @property
    def aggregator(self) -> DPMean:
        """The DP mean of central and distributed DP (local DP adds its noise on the nodes)."""
        agg = self.strategy.aggregator if self.strategy is not None else None
        if not isinstance(agg, DPMean):
            raise RuntimeError(f"privacy.mode = {self.mode!r} has no server-side DP mean")
        return agg

    @property
    def clip_norm(self) -> float:
        """C now (it moves with adaptive clipping)."""
        c = self.aggregator.clip_norm
        return float(c) if c is not None else float(self.p.clip_norm)

    # --- rounds ----------------------------------------------------------------------

    def allows_next_round(self) -> bool:
        """False once one more round would take epsilon past ``privacy.target_epsilon``
        (then :attr:`stopped` says why, and a log line said so)."""
        if self.stopped is not None:
            return False
        target = self.p.target_epsilon
        if not target:
            return True
        now, nxt = self.epsilon, self.next_epsilon
        if nxt is None or nxt <= target:
            return True
        who = "" if self.user_level else f" (the worst node, {self.worst_node()})"
        self.stopped = (
            f"privacy budget reached: epsilon = {now:.4g} now, {nxt:.4g} after one more round{who} > "
            f"privacy.target_epsilon = {target:g} at delta = {self.p.delta:g}"
        )
        log.warning("stopping: %s", self.stopped)
        return False

    def round_started(self, selected: list[str], round_: int = 0) -> None:
        """A round opened: it is charged now (every round that starts is, also one that selects
        nobody or aborts), and a distributed-DP mean learns t."""
        if self.user_level:
            assert self.accountant is not None, "bind() before the first round"
            self.rounds_charged += 1
            self.accountant.record_round(selected)
            if self.server_view is not None:  # the server chose these: against it, no amplification
                self.server_view.record_round(selected)
        if self.plan.client_shares:
            self.round_shares = self.noise_shares or max(1, len(selected))
            # the discrete Gaussian's secure sum arrives topped up to K_max in the integers (secure_round);
            # a round without updates releases K_max integer shares, decoded like a sum (the mechanism at n = 0)
            self.aggregator.expect_shares(
                self.round_shares, self.cohort, in_sum=self.ddg is not None, empty_release=self._empty_release(round_)
            )

    def _empty_release(self, round_: int) -> Callable[[], torch.Tensor] | None:
        """The discrete Gaussian's release of a round without updates: K_max integer shares from the OS
        CSPRNG, decoded in a secret rotation of the round (:func:`secret_rotation`), like a secure
        round's sum (None: not the mechanism)."""
        if self.ddg is None:
            return None
        self.empty_rotation = secret_rotation(round_)
        codec = DdgCodec(self.ddg, self.empty_rotation)
        shares = self.cohort

        def release() -> torch.Tensor:
            return torch.from_numpy(codec.noise_only(shares, NoiseSource()))

        return release

    def check_survivors(self, survivors: int, round_: int) -> None:
        """Secure distributed DP: before any unmasking share is asked for, the sum must hold
        at least t noise shares; SecAggAborted otherwise (nothing is released)."""
        if self.noise_shares and survivors < self.noise_shares:
            raise SecAggAborted(
                f"round {round_}: {survivors} masked inputs, fewer than the t = {self.noise_shares} "
                "noise shares distributed DP needs for N(0, z^2 C^2) on the sum; not unmasking"
            )
        if self.cohort and survivors > self.cohort:
            raise SecAggAborted(
                f"round {round_}: {survivors} masked inputs, more than the K_max = {self.cohort} shares the "
                "released noise is topped up to (the count would show in it); not unmasking"
            )

    def task_info(self) -> dict[str, Any]:
        """What a node's task says about privacy (the node checks it against its own config)."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "noise_multiplier": self.p.noise_multiplier,
            "clip_norm": self.p.clip_norm,
            "delta": self.p.delta,
        }
        if self.plan.client_shares:
            out["noise_shares"] = self.round_shares
            if self.ddg is not None:  # each node re-derives these from its own config and refuses a mismatch
                out["mechanism"] = self.p.mechanism
                out["ddg"] = self.ddg.as_dict()
        return out

    # --- local DP: the nodes' reports ------------------------------------------------

    def check_local_upload(self, num_examples: int, metrics: dict) -> None:
        """Local DP: an upload carries its noisy update and nothing data-dependent (num_examples 1,
        no metrics: NodePrivacy.protect); Malformed otherwise. So every local-DP update weighs the same."""
        if num_examples != LOCAL_UPLOAD_EXAMPLES or metrics:
            raise Malformed(
                f"privacy.mode = 'local': an upload carries num_examples = {LOCAL_UPLOAD_EXAMPLES} and no metrics "
                f"(got {num_examples} and {sorted(metrics)[:5]}): its data-dependent figures are not noised; "
                "update the node"
            )

    def upload_report(self, value: Any) -> dict | None:
        """Local DP: the report an upload's header (or a keys message's meta) carries, checked
        before anything changes. When the run's nodes send reports (PrivacyPlan.node_reports) it
        must be a well-formed one (:meth:`check_report`); otherwise it must be absent, because
        with q = B / n_k the report tells the server roughly how many examples the node holds
        (Malformed either way, nothing taken). None outside local DP and when withheld."""
        if not self.plan.dp_sgd:
            return None
        if self.plan.node_reports:
            return self.check_report(parse_report(value, self.p.delta))
        if value is not None:
            raise Malformed(
                "privacy.mode = 'local' withholds the nodes' privacy reports (each node's epsilon, at q = B / n_k, "
                "reveals roughly its example count; the node enforces privacy.target_epsilon itself): the upload "
                "must not carry one. Run the node with the server's [privacy] table, or set "
                "privacy.local_sampling_rate on both to publish reports the server can check"
            )
        return None

    @property
    def reports_withheld(self) -> bool:
        """Local DP whose nodes keep their epsilons (PrivacyPlan.node_reports): the server knows none."""
        return self.plan.dp_sgd and not self.plan.node_reports

    def public_report(self, rounds: int) -> dict[str, float | int] | None:
        """privacy.local_sampling_rate set: the report every node owes after ``rounds`` rounds, computed
        here from the config alone (the schedule is the same for every node, whatever its data);
        None when each node's rate is B / n_k (then only the node can compute its epsilon)."""
        p = self.p
        if not self.plan.dp_sgd or not p.local_sampling_rate:
            return None
        epochs = self.cfg.train.epochs
        q, steps = dp_sgd_schedule(1, 1, epochs, p.local_sampling_rate, p.round_steps(epochs))
        return {
            "epsilon": dp_epsilon(q, p.noise_multiplier, steps * rounds, p.delta, p.accountant),
            "epsilon_next": dp_epsilon(q, p.noise_multiplier, steps * (rounds + 1), p.delta, p.accountant),
            "delta": p.delta,
            "rounds": rounds,
        }

    def check_report(self, report: dict) -> dict:
        """A parsed report, checked against :meth:`public_report` when the schedule is public
        (Malformed if it claims another epsilon: the node runs another schedule, or lies); the
        figures shown are then the server's own. Unchanged otherwise."""
        public = self.public_report(int(report["rounds"]))
        if public is None:
            return report
        for key in ("epsilon", "epsilon_next"):
            if not math.isclose(float(report[key]), float(public[key]), rel_tol=1e-6, abs_tol=1e-9):
                raise Malformed(
                    f"privacy report: {key} = {report[key]:.6g} after {report['rounds']} rounds, but "
                    f"privacy.local_sampling_rate = {self.p.local_sampling_rate:g} with "
                    f"{self.p.round_steps(self.cfg.train.epochs)} steps a round gives {public[key]:.6g} for every "
                    "node: run the node with the server's [privacy] and [train] tables"
                )
        return public

    def take_report(self, node: str, report: dict) -> None:
        try:
            report = self.check_report(report)
        except Malformed as e:  # a path that could not refuse it before: shown as the schedule gives it
            log.warning("node %s: %s; showing the public schedule's figures", node, e)
            report = self.public_report(int(report["rounds"])) or report
        if node in self.reports or len(self.reports) < MAX_NODE_EPSILONS:
            self.reports[node] = report
        log.info(
            "node %s: local DP epsilon = %.4g after %d rounds (%.4g after one more)",
            node,
            report["epsilon"],
            report["rounds"],
            report["epsilon_next"],
        )

    def worst_node(self) -> str | None:
        return max(self.reports, key=lambda n: (self.reports[n]["epsilon_next"], n), default=None)

    # --- what is reported ------------------------------------------------------------

    @property
    def epsilon(self) -> float | None:
        """Epsilon spent so far: the accountant's, or the worst node's report; None when the nodes
        keep their reports (:attr:`reports_withheld`: no figure the server could stand behind)."""
        if self.user_level:
            return self.accountant.epsilon if self.accountant is not None else 0.0
        if self.reports_withheld:
            return None
        return max((r["epsilon"] for r in self.reports.values()), default=0.0)

    @property
    def next_epsilon(self) -> float | None:
        if self.user_level:
            return self.accountant.next_epsilon() if self.accountant is not None else None
        return max((r["epsilon_next"] for r in self.reports.values()), default=None)

    def describe(self) -> str:
        if self.accountant is not None:
            return self.accountant.describe()
        if self.user_level:
            return "not bound to the registry yet"
        if self.p.local_sampling_rate:
            return (
                f"example-level DP-SGD on each node at the run's sampling rate q = {self.p.local_sampling_rate:g}, "
                f"{self.p.round_steps(self.cfg.train.epochs)} steps a round (whatever a node's data size), over the "
                "rounds it took part in; every node's report is checked "
                "against that public schedule and the worst node's is shown"
            )
        if self.reports_withheld:
            return (
                "example-level DP-SGD on each node, accounted by the node over its own data size, batch, steps "
                "a round and the rounds it took part in; each node enforces privacy.target_epsilon itself and keeps "
                "its epsilon (at q = B / n_k it would reveal roughly the node's example count; set "
                "privacy.local_sampling_rate to have reports the server checks and shows)"
            )
        return (
            "example-level DP-SGD on each node, accounted by the node over its own data size, batch, steps "
            "a round and the rounds it took part in; the worst node's report is shown (privacy.release = 'clear': "
            "not checked, and it reveals roughly each node's example count)"
        )

    def released(self, record: dict[str, Any], summary: RoundSummary | None = None) -> dict[str, Any]:
        """What of a metrics record ``privacy.release`` lets out, with this round's noisy figures
        (``noised``, from ``summary``) and the privacy fields; no wall-clock timing while it
        withholds (``PrivacyPlan.release_served_record``)."""
        noisy = self.plan.noisy_round(summary.num_results, summary.client_losses) if summary is not None else {}
        return self.plan.release_served_record({**record, **noisy, **self.record()})

    def record(self) -> dict[str, Any]:
        """The privacy fields of a metrics.jsonl record (as the simulator writes them)."""
        out: dict[str, Any] = {
            "epsilon": self.epsilon,
            "delta": self.p.delta,
            "privacy_mode": self.mode,
            "accountant": self.describe(),
        }
        if self.user_level:
            out.update(sampling="poisson", sampling_rate=self.q, rounds_charged=self.rounds_charged)
            out.update(self.plan.server_view_fields(self.server_view))
            if self.p.adaptive_clipping:
                out["clip_norm"] = self.clip_norm
        elif not self.reports_withheld:
            out.update(nodes_reporting=len(self.reports), epsilon_node=self.worst_node())
        if self.p.target_epsilon:
            out["target_epsilon"] = self.p.target_epsilon
        return out

    def status(self) -> dict[str, Any]:
        out = {
            **self.record(),
            "epsilon_next": self.next_epsilon,
            "stopped": self.stopped,
            "registered_nodes": self.registered,
        }
        if self.plan.client_shares:
            out["noise_shares"] = self.noise_shares or self.round_shares
        if not self.user_level and not self.reports_withheld:
            out["node_epsilon"] = {n: dict(r) for n, r in sorted(self.reports.items())}
        return out

    def prometheus(self) -> list[str]:
        lines = []
        if self.epsilon is not None:  # local DP with withheld reports: the server knows no epsilon
            lines += [
                "# HELP shoal_privacy_epsilon Epsilon spent so far at shoal_privacy_delta "
                "(local DP: the worst node's).",
                "# TYPE shoal_privacy_epsilon gauge",
                f"shoal_privacy_epsilon {self.epsilon}",
            ]
        lines += [
            "# TYPE shoal_privacy_delta gauge",
            f"shoal_privacy_delta {self.p.delta}",
            "# HELP shoal_privacy_budget_exhausted 1 once privacy.target_epsilon stopped the run.",
            "# TYPE shoal_privacy_budget_exhausted gauge",
            f"shoal_privacy_budget_exhausted {int(self.stopped is not None)}",
        ]
        if self.p.target_epsilon:
            lines += [
                "# TYPE shoal_privacy_target_epsilon gauge",
                f"shoal_privacy_target_epsilon {self.p.target_epsilon}",
            ]
        if self.server_view is not None:
            lines += [
                "# HELP shoal_privacy_epsilon_server Epsilon against the server itself (no amplification by the "
                "sample it chose; the worst node's).",
                "# TYPE shoal_privacy_epsilon_server gauge",
                f"shoal_privacy_epsilon_server {self.server_view.epsilon}",
            ]
        if self.user_level:
            lines += [
                "# HELP shoal_privacy_rounds_charged_total Rounds the accountant charged (every round that started).",
                "# TYPE shoal_privacy_rounds_charged_total counter",
                f"shoal_privacy_rounds_charged_total {self.rounds_charged}",
            ]
            if self.p.adaptive_clipping:
                lines += [
                    "# TYPE shoal_privacy_clip_norm gauge",
                    f"shoal_privacy_clip_norm {self.clip_norm}",
                ]
        else:
            lines += [
                "# HELP shoal_privacy_node_epsilon A node's own reported local-DP epsilon.",
                "# TYPE shoal_privacy_node_epsilon gauge",
            ]
            lines += [
                f'shoal_privacy_node_epsilon{{node="{n}"}} {r["epsilon"]}' for n, r in sorted(self.reports.items())
            ]
        return lines

    # --- restart ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The privacy ledger: charged rounds, q, the adaptive clip norm, the nodes' reports."""
        out: dict[str, Any] = {
            "mode": self.mode,
            "rounds_charged": self.rounds_charged,
            "q": self.q,
            "reports": self.reports,
        }
        if self.user_level and self.p.adaptive_clipping:
            out["clip_norm"] = self.clip_norm
        if self.accountant is not None:  # every charged round with its z, q, C: never re-priced
            out["accountant"] = self.accountant.state_dict()
        elif self._saved_ledger is not None:
            out["accountant"] = self._saved_ledger
        if self.server_view is not None:
            out["server_view"] = self.server_view.state_dict()
        elif self._saved_server_view is not None:
            out["server_view"] = self._saved_server_view
        return out

    def _restore_ledger(self) -> None:
        """Charged rounds of a saved ledger into the accountant, once both exist (ConfigError if damaged,
        or charged with another mechanism: then the message says what it recorded and what to do)."""
        if self.server_view is not None and self._saved_server_view is not None:
            try:
                self.server_view.load_state_dict(self._saved_server_view)
            except (ValueError, TypeError, AttributeError) as e:
                raise ConfigError(f"the privacy ledger in server.checkpoint_dir is damaged: {e}") from None
        if self.accountant is None or self._saved_ledger is None:
            return
        try:
            self.accountant.load_state_dict(self._saved_ledger)
        except LedgerMismatch as e:
            raise ConfigError(f"server.checkpoint_dir: {e}") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"the privacy ledger in server.checkpoint_dir is damaged: {e}") from None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ConfigError(
                f"the privacy ledger is of a privacy.mode = {state.get('mode')!r} run, this config is "
                f"{self.mode!r}: use the config it was made with, or another server.checkpoint_dir"
            )
        self.rounds_charged = int(state.get("rounds_charged", 0))
        self._saved_q = state.get("q")
        self.reports = {str(n): dict(r) for n, r in state.get("reports", {}).items()}
        if state.get("clip_norm") is not None and self.user_level:
            self.aggregator.clip_norm = float(state["clip_norm"])
        self._saved_ledger = state.get("accountant")
        self._saved_server_view = state.get("server_view")
        self._restore_ledger()
