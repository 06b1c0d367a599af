"""The privacy state a run keeps, below shoal.assembly so that it imports none of its consumers.

* :class:`PrivacyBudget`: the simulator's epsilon so far (central, distributed or local DP), and
  whether one more round stays within ``privacy.target_epsilon``; the run loop stops before it would.
* :class:`NodePrivacy`: a deployed node's (or a gossip peer's) side of ``[privacy]``: what it adds
  before an update leaves it, and its own epsilon in a ledger file.
* :func:`sum_dtype`: the dtype the plain weighted mean sums in (``server.sum_dtype``).
* :func:`expected_clients`, :func:`round_sampling`, :func:`selection_secret`, :func:`check_delta`: the
  figures the accountants and the round sampling share.

Sampling (``privacy.sampling``): central and distributed rounds sample clients the way the
accountant assumes: Poisson with q = K/N by default, or exactly K of N with the fixed-size
(replace-one) accountant. Local DP-SGD is accounted per client over its realised
participation, which holds for any data-independent selection; its rounds pick exactly K.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from pathlib import Path

import torch

from shoal.accounting import Accountant, budget_allows, check_delta_against
from shoal.accounting_dpsgd import LocalDpSgdAccountant, local_schedule
from shoal.accounting_mixture import Branches
from shoal.accounting_rounds import RoundLedger
from shoal.aggregation import Strategy
from shoal.aggregation.dp import DPMean, clip_to_norm, make_generator, noise_share, share_std
from shoal.client.http import NodeError
from shoal.config import Config
from shoal.errors import ConfigError, short_repr
from shoal.noise import describe as describe_randomness
from shoal.privacy_plan import LOCAL_UPLOAD_EXAMPLES, plan_of
from shoal.rounds import Assignment, RoundSummary
from shoal.update import Update

log = logging.getLogger(__name__)

#: From this many parameters (a 512 MiB float32 model) up, ``server.sum_dtype = "auto"`` sums in float32.
LARGE_MODEL_NUMEL = 1 << 27


def sum_dtype(choice: str, numel: int) -> torch.dtype:
    """The dtype of the plain weighted mean's sum that ``server.sum_dtype`` asks for a model of ``numel``."""
    if choice == "auto":
        return torch.float32 if numel >= LARGE_MODEL_NUMEL else torch.float64
    return torch.float32 if choice == "float32" else torch.float64


def expected_clients(cfg: Config, num_clients: int) -> int:
    """K, the number of clients a round selects (as SyncRounds.sample_size): the DP mean's
    fixed denominator, the number of noise shares, and q = K / N for the accountant."""
    sim = cfg.simulation
    return min(sim.clients_per_round or max(1, round(sim.fraction * num_clients)), num_clients)


def round_sampling(cfg: Config) -> str:
    """How SyncRounds picks clients under this config: ``poisson`` or ``fixed``."""
    return plan_of(cfg).round_sampling


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
        ddg: dict | None = None,
        abort_branches: Branches | None = None,
    ):
        """``sampling``: how the engine picks who trains, for records (default: the sync rounds'
        sampling, :func:`round_sampling`; gossip says ``online``: every online peer trains).
        ``ddg``: the distributed discrete Gaussian's parameters when that is the mechanism
        (shoal.secure_sizing sizes them; SecureSizing.ddg_accounting), accounted with its own bound.
        ``abort_branches``: what each round costs when secure aggregation's aborts are released as empty
        rounds (shoal.accounting_aborts: a mixture of sensitivities by the others' sample), recorded
        in the ledger and priced by the accountant."""
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
            schedules = {c: local_schedule(n, cfg.train, cfg.privacy) for c, n in client_sizes.items()}
            self.accountant = self.plan.local_accountant(schedules)
        elif ddg is not None:
            n = len(client_sizes)
            self.accountant = self.plan.ddg_accountant(expected_clients(cfg, n) / n, ddg)
        else:
            n = len(client_sizes)
            k = expected_clients(cfg, n)
            # at z_eff when the round's figures are released noised too (PrivacyPlan.accounted_z)
            self.accountant = self.plan.round_accountant(k / n, sampling=self.sampling, num_clients=n, sample_size=k)
        # epsilon against the server (distributed DP under secure aggregation; None elsewhere)
        self.server_view = self.plan.server_view_accountant(ddg)
        check_delta(p.delta, p.mode, client_sizes)
        # an aborted round is released as an empty one (InProcessSimulation), priced as these branches
        self.aborts_released = False
        if abort_branches is not None and isinstance(self.accountant, RoundLedger):
            self.aborts_released = True
            self.accountant.abort_branches = abort_branches
            log.info(
                "privacy: an aborted secure round is released as an empty one; each round is charged as the "
                "mixture (sensitivity x C, probability) %s (shoal.accounting_aborts)",
                ", ".join(f"({s:g}, {q:.3g})" for s, q in abort_branches),
            )
        self.reproducible = p.reproducible
        log.info("privacy accounting: %s; %s", self.accountant.describe(), self.plan.describe_release())
        (log.warning if p.reproducible else log.info)("privacy randomness: %s", describe_randomness(p.reproducible))
        if self.target and self.accountant.next_epsilon() > self.target:
            raise ConfigError(
                f"privacy.target_epsilon = {self.target:g} is below the epsilon of a single round "
                f"({self.accountant.next_epsilon():.3g} at delta = {self.delta:g}); raise it or "
                "raise privacy.noise_multiplier"
            )

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon

    def metrics(self) -> dict:
        """What a metrics.jsonl record gets: ``epsilon``, the client ``sampling`` and the ``accountant``
        it assumes, and ``clip_norm`` when it adapts."""
        out = {"epsilon": self.epsilon, "sampling": self.sampling, "accountant": self.accountant.describe()}
        out.update(self.delta_fields())
        out.update(self.plan.server_view_fields(self.server_view))
        if self._aggregator is not None and self._aggregator.clip_norm is not None:
            out["clip_norm"] = float(self._aggregator.clip_norm)
        return out

    def summary(self) -> dict:
        """What summary.json gets."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            **self.delta_fields(),
            "sampling": self.sampling,
            "accountant": self.accountant.describe(),
            **self.plan.server_view_fields(self.server_view),
            "release": self.plan.describe_release(),
            "randomness": describe_randomness(self.reproducible),
        }

    def delta_fields(self) -> dict:
        """With aborts charged: ``delta``, the delta the epsilon holds at (privacy.delta plus the charged
        rounds' abort failure probability), and ``abort_delta``, that sum ({} without the charge)."""
        acc = self.accountant
        if not isinstance(acc, RoundLedger) or not any(float(e.get("abort_delta", 0)) for e in acc.ledger):
            return {}
        composed = acc.composed_delta()
        return {"delta": composed, "abort_delta": composed - acc.delta}

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


def diverged(update: Update) -> str | None:
    """What is wrong with a trained update that must not be uploaded (None if nothing): a
    non-finite training loss, or NaN/Inf entries in the update itself."""
    loss = update.metrics.get("train_loss")
    if loss is not None and not math.isfinite(loss):
        return f"loss {loss}"
    delta = update.delta
    if delta.numel() and all(math.isfinite(float(v)) for v in torch.aminmax(delta)):  # one pass, no temporary
        return None
    bad = int((~torch.isfinite(delta)).sum())
    if bad:
        return f"the update has {bad} NaN/Inf entries of {delta.numel()}"
    return None


class NodePrivacy:
    """This node's side of ``[privacy]``; the node's own config is its promise to its data.

    * ``central``: nothing is added here (the server clips and adds the noise, which is
      what central DP trusts it to do); the node checks that the server runs central DP
      with its z and C.
    * ``distributed``: clip to C and add N(0, z²C²/t) before the update leaves the node; the
      noise comes from the OS, never from the server's seed. In the clear t is the task's; with
      secure aggregation the share is added after the key directory, and t must be one this node
      can hold the server to (no more than its checked neighbourhood, and it unmasks no sum of
      fewer survivors): a task that asks for more is refused (client/secure_node.py).
    * ``local``: DP-SGD (the trainer) on a seed only this node knows (with the server's
      seed the server could redraw the noise and the example samples), and the node's own
      epsilon over its data size, batch, steps a round and the rounds it took part in. That count
      is kept in a ledger file, so a restarted node goes on from it; the node takes no work
      that would pass ``privacy.target_epsilon``, and reports its epsilon with each update only
      where the report reveals nothing of its data (PrivacyPlan.node_reports).
    """

    def __init__(self, cfg: Config, name: str, num_train: int, ledger: Path | None = None):
        p = cfg.privacy
        if p.noise_multiplier <= 0:
            raise ConfigError(
                f"privacy.mode = {p.mode!r} with privacy.noise_multiplier = 0 adds no noise (epsilon "
                "is infinite); set a noise multiplier > 0, or privacy.mode = 'none'"
            )
        self.plan = plan_of(cfg)
        self.p, self.mode, self.name, self.ledger = p, p.mode, name, ledger
        self.accountant: LocalDpSgdAccountant | None = None
        if self.plan.dp_sgd:
            try:  # DP-SGD protects one of this node's examples
                check_delta_against(p.delta, num_train, "examples on this node")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self.schedule = local_schedule(num_train, cfg.train, p)
            self.accountant = self.plan.local_accountant({name: self.schedule})
            self.accountant.load_state_dict({**self.accountant.state_dict(), "participations": {name: self._load()}})
            if p.target_epsilon and self.rounds == 0 and self.accountant.next_epsilon() > p.target_epsilon:
                raise ConfigError(
                    f"privacy.target_epsilon = {p.target_epsilon:g} is below the epsilon of one round of DP-SGD on "
                    f"this node's {num_train} examples ({self.accountant.next_epsilon():.3g} at delta = "
                    f"{p.delta:g}); raise it or raise privacy.noise_multiplier"
                )
            q, steps = self.schedule
            log.info(
                "local DP: DP-SGD on %d examples, sampling rate %.4g, %d steps a round, z = %g; epsilon = %.4g "
                "after %d rounds so far",
                num_train,
                q,
                steps,
                p.noise_multiplier,
                self.epsilon,
                self.rounds,
            )

    @property
    def rounds(self) -> int:
        return self.accountant.rounds_of(self.name) if self.accountant is not None else 0

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon if self.accountant is not None else 0.0

    def _ledger_entry(self) -> dict:
        return {
            "node": self.name,
            "schedule": list(self.schedule),
            "noise_multiplier": self.p.noise_multiplier,
            "accountant": self.p.accountant,
            "rounds": self.rounds,
        }

    def _load(self) -> int:
        """The rounds this node already spent on its data (0 without a ledger)."""
        if self.ledger is None or not self.ledger.exists():
            return 0
        try:
            saved = json.loads(self.ledger.read_text())
            rounds = int(saved["rounds"])
            same = (
                saved["node"],
                [float(v) for v in saved["schedule"]],
                float(saved["noise_multiplier"]),
                saved["accountant"],
            ) == (self.name, [float(v) for v in self.schedule], self.p.noise_multiplier, self.p.accountant)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"the privacy ledger {self.ledger} cannot be read ({type(e).__name__}: {e}); without "
                "it the rounds already spent are unknown: restore it, or give --privacy-ledger another "
                "file if this node's data was never trained on"
            ) from None
        if not same:
            raise ConfigError(
                f"the privacy ledger {self.ledger} was written for node {saved['node']!r} with DP-SGD schedule "
                f"{saved['schedule']} (sampling rate, steps a round), z = {saved['noise_multiplier']} and the "
                f"{saved['accountant']} accountant; this node now runs {list(self.schedule)}, z = "
                f"{self.p.noise_multiplier}, {self.p.accountant}: its {rounds} earlier rounds cannot be composed "
                "with these; keep the earlier settings, or use another ledger only for other data"
            )
        return rounds

    def _save(self) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.ledger.with_name(self.ledger.name + ".tmp")
            tmp.write_text(json.dumps(self._ledger_entry()))
            tmp.replace(self.ledger)
        except OSError as e:  # without its ledger the node cannot keep its own account: it stops
            raise ConfigError(
                f"the privacy ledger {self.ledger} cannot be written ({e}); give --privacy-ledger a writable file"
            ) from None

    def check_task(self, task: dict) -> None:
        """NodeError unless the server's task runs this node's privacy mode (and, where the
        server adds or divides the noise, with this node's z and C)."""
        info = task.get("privacy")
        if not isinstance(info, dict) or info.get("mode") != self.mode:
            theirs = info.get("mode") if isinstance(info, dict) else "none"
            raise NodeError(
                f"the server runs privacy.mode = {short_repr(theirs)}, this node's config says "
                f"{self.mode!r}: no update leaves this node with another privacy than its own config's"
            )
        if self.plan.dp_sgd:
            return
        for key in ("noise_multiplier", "clip_norm"):
            v, mine = info.get(key), getattr(self.p, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isclose(v, mine, rel_tol=1e-9):
                raise NodeError(
                    f"the server runs privacy.{key} = {short_repr(v)}, this node's config says {mine:g}: "
                    "run the node with the server's [privacy] table"
                )
        if self.plan.client_shares:
            t = info.get("noise_shares")
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise NodeError(f"the task's privacy.noise_shares = {short_repr(t)} must be an integer >= 1")
            if self.p.mechanism == "discrete_gaussian" and not isinstance(task.get("secure_aggregation"), dict):
                raise NodeError(
                    "this node adds its discrete-Gaussian noise while encoding for secure aggregation, and the "
                    "task runs none: refusing to send the update in the clear"
                )

    def allows_next_round(self) -> bool:
        """Local DP: False (with a log line) when one more round would pass privacy.target_epsilon."""
        return self.accountant is None or budget_allows(self.accountant, self.p.target_epsilon, self.p.delta)

    def training_seed(self, task_seed: int) -> int:
        """Local DP trains on a seed only this node knows; otherwise the task's (reproducible runs)."""
        return secrets.randbits(63) if self.plan.dp_sgd else task_seed

    def protect(self, update: Update, task: dict) -> Update:
        """What leaves the node. Distributed DP: clip to C, add this node's share N(0, z²C²/t).
        Local DP: the DP-SGD update and nothing data-dependent beside it (no train loss, local
        steps or example count: it says 1 example, and the server weighs local-DP updates alike)."""
        if self.plan.dp_sgd:
            return Update(update.delta, LOCAL_UPLOAD_EXAMPLES, update.base_version, update.sender, {})
        if not self.plan.client_shares or "secure_aggregation" in task:  # secure: after the key directory
            return update
        return self.add_share(update, int(task["privacy"]["noise_shares"]), task.get("round"))

    def release(self, update: Update, task: dict) -> tuple[Update, dict | None, str | None]:
        """What leaves the node for a trained update, without I/O: the protected update
        (:meth:`protect`), the report sent with it (:meth:`spend`: the round is counted first) and
        what is wrong with what the mechanism released (:meth:`released_problem`; then the node sends
        a notice without a reason instead of the update)."""
        update = self.protect(update, task)
        report = self.spend(int(task["round"]))  # counted before anything leaves the node
        return update, report, self.released_problem(update, task)

    def released_problem(self, update: Update, task: dict) -> str | None:
        """Local and distributed DP: what is wrong with the update the mechanism released (NaN/Inf in
        the noised delta; its loss is never looked at), or None. With secure aggregation the share is
        added later, after the key directory (client/secure_node.py): nothing is judged here. The clip
        maps a non-finite update to 0 and DP-SGD drops a non-finite example's gradient, so a noised
        update is finite; this is the last guard, on released values only."""
        if self.plan.server_noise or (self.plan.client_shares and "secure_aggregation" in task):
            return None
        return diverged(Update(update.delta, update.num_examples, update.base_version, update.sender, {}))

    def add_share(self, update: Update, t: int, round_) -> Update:
        """Distributed DP: clip to C and add N(0, z²C²/t) from the OS's entropy. With secure
        aggregation t is one this node checked against the key directory (client/secure_node.py)."""
        clipped, norm = clip_to_norm(update.delta, self.p.clip_norm)
        update.delta = noise_share(
            clipped, self.p.clip_norm, self.p.noise_multiplier, t, make_generator(update.delta.device, None)
        )  # OS entropy
        log.info(
            "round %s: update of norm %.4g clipped to C = %g, noise share N(0, %.4g^2) added (t = %d)",
            round_,
            norm,
            self.p.clip_norm,
            share_std(self.p.clip_norm, self.p.noise_multiplier, t),
            t,
        )
        return update

    def spend(self, round_: int) -> dict | None:
        """Local DP: count this round (the update is about to leave), save the ledger, log and
        return the report sent with the update: {epsilon, epsilon_next, delta, rounds}; None when
        the run withholds reports (PrivacyPlan.node_reports: the epsilon at q = B / n_k would tell
        the server roughly how many examples this node holds). The node's own budget check
        (:meth:`allows_next_round`) does not depend on it."""
        if self.accountant is None:
            return None
        self.accountant.record_round([self.name])
        self._save()
        report = {
            "epsilon": self.epsilon,
            "epsilon_next": self.accountant.next_epsilon(),
            "delta": self.p.delta,
            "rounds": self.rounds,
        }
        log.info(
            "round %d: local DP epsilon = %.4g at delta = %g after %d rounds (%.4g after one more%s)",
            round_,
            report["epsilon"],
            self.p.delta,
            self.rounds,
            report["epsilon_next"],
            f"; target {self.p.target_epsilon:g}" if self.p.target_epsilon else "",
        )
        return report if self.plan.node_reports else None
