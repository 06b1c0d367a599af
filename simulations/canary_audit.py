"""A one-shot empirical estimate of client-level epsilon from canary clients.

The method of Andrew et al. 2024 ("One-shot Empirical Privacy Estimation for Federated
Learning", ICLR 2024), final-model variant:

1. ``k`` canary clients join the population. Each has a secret random unit direction u_j in
   parameter space and, whenever it is selected, sends 4 C u_j (C = privacy.clip_norm) as its
   update: four times what the clipping lets through, in a direction nothing else in
   training shares, so the clipping itself is under test (clipping at 4C with noise for C
   shows).
2. After one training run, the final model delta D = theta_T - theta_0 is compared with each
   inserted direction (cos(D, u_j)) and with ``m`` unseen directions v_i drawn the same way
   but never inserted (cos(D, v_i)).

   Local mode audits what local DP protects, each client's update, at the example level. A
   canary client holds B examples of real data (so each step samples its examples at rate 1)
   and trains with the real DP-SGD trainer plus one canary example whose per-example gradient
   is -4 C u_j: sampled, clipped and noised with the others by the trainer (client/dp_sgd.py),
   so a bug there shows. Its first update is projected on u_j (inserted) and on a direction
   v_j of its own that was never inserted (unseen), and the estimate is compared with the
   accounted epsilon of one such update: the audit is tight there, so missing noise shows.
3. Each set of cosines is fitted with a Gaussian; the estimate is the epsilon at delta of
   telling the two Gaussians apart (the larger of the two directions), computed exactly from
   normal tails.

Confidence: the estimate is a point estimate under a Gaussian model of the cosines, not a
provable lower bound; :func:`estimate` reports a bootstrap interval (resampling both sets of
cosines) so the spread from ``k`` canaries is visible. The verdict uses the interval's lower
end: a run is flagged only when even that exceeds the accounted epsilon (the point estimate
alone flagged about 2 of 10 sound runs). Andrew et al. report that the
final-model estimate is far below the accounted epsilon (the accountant also covers an
attacker who sees every round); an estimate above the accounted epsilon would point at a
bug in the mechanism or the accountant.

The canaries are extra clients of a run of their own (:func:`run_canary_audit`): the population
grows from N to N + k with the per-client sampling rate kept at q = K/N, so the accounted
epsilon of the audit run (reported beside the estimate) is that of the same mechanism.

**The all-iterates audit against the run's own ledger** (central and distributed DP,
:func:`audit_iterates`). The final model cannot show an accountant or sampling bug: it hides
how often and with how much noise each round released. So the audit also keeps every round's
release (the change of the global model) and measures, from releases and canaries alone, each
parameter the accountant charges, then reads the run's own ledger (rounds, q, z):

* rounds released: every round the run ran, against the rounds the ledger charged (exact);
* sampling rate: the canaries know when they were selected, so q is estimated from k x T
  Bernoulli draws; its one-sided lower bound (Clopper-Pearson) must not exceed the ledger's q;
* noise per unit of sensitivity: the release projected on the unseen directions gives the
  noise std sigma (chi-square upper bound), the release projected on u_j in the rounds canary j
  was selected gives what one client moves the sum by, c (its mean; a normal lower bound); the
  run's effective multiplier sigma / c must not fall below the ledger's z. A canary sends 4C, so
  clipping at 4C shows as c = 4C, halved noise as sigma = zC/2.

Each bound holds with probability 1 - 1e-4 on a sound run, and the audit prices the measured
mechanism (q at its lower bound, sigma / c at its upper bound, the releases seen) with
dp-accounting as well: a run is flagged when any check fails. This is a parameter audit in the
spirit of Steinke, Nasr and Jagielski 2023 (one run, many canaries) that tests the mechanism the
accountant assumes rather than estimating epsilon from a statistic; it assumes a server step
that is linear in the mean (FedAvg, SGD without momentum), so a round's model change is its
noisy mean up to a constant that cancels in sigma / c.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy.special import log_ndtr

from shoal.accounting import epsilon
from shoal.accounting_dpsgd import LocalDpSgdAccountant, local_schedule
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.privacy_plan import plan_of
from shoal.rounds import Assignment
from shoal.seeding import derive_seed
from shoal.task import SimulationData, Task, num_examples
from shoal.task_data import Partitioned
from shoal.update import Update

from .client_data import client_id
from .experiment import run_simulation
from .inprocess import InProcessSimulation, LocalClients

log = logging.getLogger(__name__)

CANARY_PREFIX = "canary-"
DIMS_PER_CANARY = 20  # random directions overlap by ~1/sqrt(numel); k canaries add k/numel to each cosine's variance
CANARY_NORM = 4.0  # a canary's update (or per-example gradient) is this many times C: clipping is exercised


class AuditTooSmall(ValueError):
    """The model has too few parameters for the canaries asked: their directions would overlap."""


def check_dimension(numel: int, k: int) -> None:
    """Refuse an audit whose k canaries would interfere: the method needs numel >> k."""
    if numel < DIMS_PER_CANARY * k:
        raise AuditTooSmall(
            f"the canary audit needs a model of at least {DIMS_PER_CANARY} x privacy.canaries parameters: this one has "
            f"{numel}, and {k} canary directions would overlap (each cosine picks up the others' signal); lower "
            f"privacy.canaries to at most {numel // DIMS_PER_CANARY} (set 0 to skip the audit)"
        )


# --- epsilon of two Gaussians ----------------------------------------------------------------


def _log_mass(mu: float, sd: float, lo: float, hi: float) -> float:
    """log P(lo < X < hi) for X ~ N(mu, sd^2), stable in the tails."""
    a, b = (lo - mu) / sd, (hi - mu) / sd
    if b <= 0:
        la, lb = log_ndtr(a), log_ndtr(b)
    elif a >= 0:
        la, lb = log_ndtr(-b), log_ndtr(-a)
    else:
        return math.log1p(-math.exp(log_ndtr(a)) - math.exp(log_ndtr(-b)))
    return lb + math.log1p(-math.exp(la - lb)) if lb > la else -math.inf


def _delta_one_way(eps: float, p: tuple[float, float], q: tuple[float, float]) -> float:
    """sup_S P(S) - e^eps Q(S) for P = N(p), Q = N(q): the region where log p/q > eps, exactly."""
    (m1, s1), (m0, s0) = p, q
    a = 1 / (2 * s0**2) - 1 / (2 * s1**2)
    b = m1 / s1**2 - m0 / s0**2
    c = -(m1**2) / (2 * s1**2) + m0**2 / (2 * s0**2) + math.log(s0 / s1) - eps
    inf = math.inf
    if abs(a) < 1e-12 * (abs(b) + abs(c) + 1):
        if b == 0:
            regions = [(-inf, inf)] if c > 0 else []
        else:
            r = -c / b
            regions = [(r, inf)] if b > 0 else [(-inf, r)]
    else:
        disc = b * b - 4 * a * c
        if disc <= 0:
            regions = [(-inf, inf)] if a > 0 else []
        else:
            r1, r2 = sorted(((-b - math.sqrt(disc)) / (2 * a), (-b + math.sqrt(disc)) / (2 * a)))
            regions = [(-inf, r1), (r2, inf)] if a > 0 else [(r1, r2)]
    total = 0.0
    for lo, hi in regions:
        lp, lq = _log_mass(m1, s1, lo, hi), _log_mass(m0, s0, lo, hi)
        total += math.exp(lp) - math.exp(min(eps + lq, 700.0))
    return max(total, 0.0)


def gaussian_epsilon(inserted: tuple[float, float], unseen: tuple[float, float], delta: float) -> float:
    """The smallest epsilon at which N(inserted) and N(unseen) (mean, std) are (epsilon, delta)-close
    both ways: the privacy of a mechanism whose outputs on neighbouring data are these Gaussians."""

    def worst(eps: float) -> float:
        return max(_delta_one_way(eps, inserted, unseen), _delta_one_way(eps, unseen, inserted))

    if worst(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while worst(hi) > delta:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return math.inf
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if worst(mid) > delta else (lo, mid)
    return hi


def _fit(x: np.ndarray) -> tuple[float, float]:
    return float(np.mean(x)), max(float(np.std(x, ddof=1)), 1e-12)


@dataclass
class CanaryEstimate:
    epsilon: float  # the point estimate
    low: float  # basic bootstrap 95% interval (see _basic_interval)
    high: float
    inserted_mean: float
    inserted_std: float
    unseen_mean: float
    unseen_std: float
    inserted: int  # canaries inserted
    unseen: int
    cosines: dict[str, list[float]] = field(default_factory=dict, repr=False)


def _basic_interval(point: float, boot: list[float]) -> tuple[float, float]:
    """The basic (reverse-percentile) bootstrap 95% interval: [2 e - q97.5, 2 e - q2.5]. At small
    delta the estimate is biased upward (it is driven by the fitted tails), and its bootstrap
    replicates are biased up once more; the percentile interval's lower end then sits near the
    truth, so a sound run's was above the accounted epsilon 1 time in 10 (tight local audits),
    while the basic interval takes the bias off."""
    if not boot:
        return point, point
    q_lo, q_hi = (float(v) for v in np.percentile(boot, [2.5, 97.5]))
    if not math.isfinite(point):
        return q_lo, math.inf
    low = 2 * point - q_hi if math.isfinite(q_hi) else 0.0
    return max(0.0, min(point, low)), max(point, 2 * point - q_lo)


def estimate(
    inserted: np.ndarray, unseen: np.ndarray, delta: float, bootstrap: int = 200, seed: int = 0
) -> CanaryEstimate:
    """epsilon from the two sets of cosines, with a bootstrap interval."""
    inserted, unseen = np.asarray(inserted, float), np.asarray(unseen, float)
    if len(inserted) < 2 or len(unseen) < 2:
        raise ValueError("the canary estimate needs at least 2 inserted and 2 unseen cosines")
    point = gaussian_epsilon(_fit(inserted), _fit(unseen), delta)
    gen = np.random.default_rng(seed)
    boot = [
        gaussian_epsilon(_fit(gen.choice(inserted, len(inserted))), _fit(gen.choice(unseen, len(unseen))), delta)
        for _ in range(bootstrap)
    ]
    low, high = _basic_interval(point, boot)
    mi, si = _fit(inserted)
    mu, su = _fit(unseen)
    return CanaryEstimate(
        point,
        float(low),
        float(high),
        mi,
        si,
        mu,
        su,
        len(inserted),
        len(unseen),
        {"inserted": inserted.tolist(), "unseen": unseen.tolist()},
    )


# --- canary clients --------------------------------------------------------------------------


def direction(numel: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A uniformly random unit vector of ``numel`` entries (float64), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
    v = torch.randn(numel, generator=gen, dtype=torch.float64)
    return (v / torch.linalg.vector_norm(v)).to(device)


def with_canaries(data: SimulationData, k: int, rows: int | None = None) -> tuple[SimulationData, list[str]]:
    """``data`` plus ``k`` canary clients holding a copy of a typical client's rows (its first
    ``rows`` of them if given). Central and distributed canaries never train (their updates are
    made by :class:`CanaryClients`: the rows only set their size); local ones train on them."""
    train = data.train
    n = len(train)
    sizes = [train.size(i) if isinstance(train, Partitioned) else num_examples(train[i]) for i in range(n)]
    typical = int(np.argsort(sizes)[n // 2])
    ids = [str(c) for c in data.client_ids] if data.client_ids is not None else [client_id(i) for i in range(n)]
    canaries = [f"{CANARY_PREFIX}{j:04d}" for j in range(k)]
    if isinstance(train, Partitioned):
        part = train.parts[typical][:rows]
        new_train: Any = Partitioned(train.x, train.y, [*train.parts, *[part] * k])
    else:
        rows_of = train[typical]
        if rows is not None:
            if not (isinstance(rows_of, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in rows_of)):
                raise ConfigError("the local-DP canary audit needs clients' data as (x, y) tensors")
            new_train = [*train, *[tuple(t[:rows] for t in rows_of)] * k]
        else:
            new_train = [*train, *[rows_of] * k]
    client_test = None if data.client_test is None else [*data.client_test, *[None] * k]
    return SimulationData(new_train, data.test, client_test, [*ids, *canaries]), canaries


class CanaryClients:
    """The simulation's client pool: canary clients send their crafted update (see the module
    doc), every other client trains as usual (LocalClients)."""

    def __init__(self, sim: InProcessSimulation, canaries: list[str], seed: int):
        self.sim, self.seed = sim, seed
        self.inner = LocalClients(sim)
        self.canaries = set(canaries)
        self.index = {c: j for j, c in enumerate(canaries)}
        self.participated: set[str] = set()
        self.releases: dict[str, tuple[float, float]] = {}  # local: a canary's first update on (u_j, v_j)
        self.selected_in: dict[int, list[str]] = {}  # round -> the canaries selected in it (all-iterates audit)
        cfg = sim.cfg
        self.local = plan_of(cfg).dp_sgd
        self.clip = cfg.privacy.clip_norm
        if self.local and sim.batched is not None:
            raise RuntimeError("local-DP canaries train one by one with the DP-SGD trainer")

    def direction(self, cid: str) -> torch.Tensor:
        return direction(self.sim.spec.numel, derive_seed(self.seed, 0xCA7, self.index[cid]))

    def unseen(self, cid: str) -> torch.Tensor:
        """A direction of this canary's own that nothing inserts: the null of the local audit."""
        return direction(self.sim.spec.numel, derive_seed(self.seed, 0x0DD0, self.index[cid]))

    def train(self, tasks: list[Assignment], global_params: torch.Tensor):
        real = [t for t in tasks if t.client_id not in self.canaries]
        if real:
            yield from self.inner.train(real, global_params)
        for t in tasks:
            if t.client_id not in self.canaries:
                continue
            self.participated.add(t.client_id)
            self.selected_in.setdefault(t.round, []).append(t.client_id)
            u = self.direction(t.client_id)
            if self.local:  # the real DP-SGD trainer, with one canary example among the client's data
                from shoal.client.dp_sgd import DpSgdTrainer  # Opacus only in local mode

                trainer = self.sim.trainer
                assert isinstance(trainer, DpSgdTrainer)
                trainer.gradient_canary = (-CANARY_NORM * self.clip * u).to(torch.float32)
                try:
                    for task, update in self.inner.train([t], global_params):
                        if t.client_id not in self.releases:  # the release local DP protects: this update
                            d = update.delta.double().cpu()
                            self.releases[t.client_id] = (float(d @ u), float(d @ self.unseen(t.client_id)))
                        yield task, update
                finally:
                    trainer.gradient_canary = None
                continue
            n = self.sim.shards.size(self.sim._index[t.client_id])
            delta = (CANARY_NORM * self.clip * u).to(torch.float32).to(global_params.device)
            yield t, Update(delta, n, t.version, t.client_id, {"train_loss": 0.0})


def cosines(delta: torch.Tensor, dirs) -> np.ndarray:
    d = delta.double().cpu()
    norm = float(torch.linalg.vector_norm(d))
    return np.array([float(d @ u) / norm if norm > 0 else 0.0 for u in dirs])


def audit_config(cfg: Config, num_clients: int, k: int) -> Config:
    """The config of the audit run: N + k clients with the per-client sampling rate kept at K/N."""
    c = copy.deepcopy(cfg)
    q = c.simulation.clients_per_round / num_clients if c.simulation.clients_per_round else c.simulation.fraction
    c.simulation.clients_per_round = 0
    c.simulation.fraction = min(q, 1.0)
    c.simulation.num_clients = num_clients + k
    c.output.plots = False
    return c.validate()


def run_canary_audit(
    cfg: Config,
    data: SimulationData,
    task: Task | None,
    out_dir,
    canaries: int | None = None,
    unseen: int | None = None,
    prepare: Callable[[InProcessSimulation], None] | None = None,
) -> dict[str, Any]:
    """One training run with canary clients; the estimate and that run's accounted epsilon.
    ``prepare(sim)`` runs before training (e.g. to track participants, or to plant a bug)."""
    k = cfg.privacy.canaries if canaries is None else canaries
    m = cfg.privacy.canaries_unseen if unseen is None else unseen
    local = plan_of(cfg).dp_sgd
    b = cfg.train.batch_size
    if local and not isinstance(b, int):
        raise ConfigError(f"the local-DP canary audit needs train.batch_size as a number of examples (it is {b!r})")
    data_a, ids = with_canaries(data, k, rows=int(b) if local else None)
    c = audit_config(cfg, len(data.train), k)
    seed = derive_seed(c.simulation.seed, 0xA0D1)
    pool: list[CanaryClients] = []

    def canary_pool(s: InProcessSimulation) -> CanaryClients:
        pool.append(CanaryClients(s, ids, seed))
        return pool[0]

    sim = InProcessSimulation.from_config(c, data_a, task, clients=canary_pool)
    check_dimension(sim.spec.numel, k)
    clients = pool[0]
    if prepare is not None:
        prepare(sim)
    theta0 = sim.global_params.double().clone()
    iterates: dict[int, torch.Tensor] = {}  # round -> its release (the change of the global model)
    run_round = sim.run_round

    def kept_round():
        before = sim.global_params.double().clone()
        summary = run_round()
        iterates[summary.round] = sim.global_params.double() - before
        return summary

    sim.run_round = kept_round  # type: ignore[method-assign]
    summary = run_simulation(c, out_dir, progress=False, sim=sim)
    delta = sim.global_params.double() - theta0
    # Every inserted canary counts, selected or not: DP protects a client's presence in the
    # population, and with Poisson sampling a canary never selected is part of that mechanism.
    numel = sim.spec.numel
    user_level = not local and sim.privacy is not None and plan_of(c).user_level
    if local:  # each canary client's first update against one update's accounted epsilon
        ins = np.array([r[0] for r in clients.releases.values()])
        outs = np.array([r[1] for r in clients.releases.values()])
        # one participation of a canary client, priced by the run's own accountant (its schedule for that client)
        acc = sim.privacy.accountant if sim.privacy is not None else None
        if isinstance(acc, LocalDpSgdAccountant) and clients.releases:
            accounted = max(acc.epsilon_of(cid, 1) for cid in clients.releases)
        else:
            rate, steps = local_schedule(int(b), c.train, c.privacy)
            accounted = epsilon(rate, c.privacy.noise_multiplier, steps, c.privacy.delta, c.privacy.accountant)
        released = "each canary client's first update"
    else:
        inserted: Iterable[torch.Tensor] = (clients.direction(cid) for cid in ids)
        unseen_dirs: Iterable[torch.Tensor] = (direction(numel, derive_seed(seed, 0x0DD, i)) for i in range(m))
        if user_level:  # the all-iterates audit below needs them all again: each drawn once (a randn of numel)
            inserted, unseen_dirs = list(inserted), list(unseen_dirs)
        ins = cosines(delta, inserted)
        outs = cosines(delta, unseen_dirs)
        accounted = summary.get("epsilon", math.inf)
        released = "the final model"
    est = estimate(ins, outs, c.privacy.delta, seed=seed)
    flagged = est.low > accounted  # even the interval's lower end exceeds what is accounted
    parameters: IterateAudit | None = None
    if user_level and sim.privacy is not None:
        parameters = audit_iterates(
            iterates,
            clients.selected_in,
            list(inserted),
            list(unseen_dirs),
            ids,
            sim.privacy.accountant,
            c.privacy.delta,
        )
        flagged = flagged or parameters.flagged
        log.info("all-iterates audit against the run's ledger: %s", parameters.describe())
    log.info(
        "canary audit (%s): empirical epsilon %.3g [%.3g, %.3g] vs accounted %.3g: %s (%d canaries, %d selected at "
        "least once, %d unseen)",
        c.privacy.mode,
        est.epsilon,
        est.low,
        est.high,
        accounted,
        "EXCEEDS what is accounted: a bug in the mechanism or the accountant" if flagged else "consistent",
        est.inserted,
        len(clients.participated),
        est.unseen,
    )
    return {
        "canary_epsilon": est.epsilon,
        "canary_epsilon_low": est.low,
        "canary_epsilon_high": est.high,
        "canary_accounted_epsilon": accounted,
        "canaries": k,
        "canaries_unseen": est.unseen,
        "canaries_selected": len(clients.participated),
        "canary_cos_inserted": est.inserted_mean,
        "canary_cos_unseen_std": est.unseen_std,
        "canary_flagged": flagged,
        "canary_release": released,
        "canary_ledger_flagged": parameters.flagged if parameters is not None else None,
        "canary_ledger_audit": parameters.as_dict() if parameters is not None else None,
        "estimate": est,
    }


# --- the all-iterates audit against the run's own ledger (the module doc) ---------------------

#: each one-sided bound of the all-iterates audit fails on a sound run with at most this probability
AUDIT_ALPHA = 1e-4


@dataclass
class IterateAudit:
    """What the releases and the canaries measured, the ledger's figures, and which checks failed."""

    rounds_seen: int
    rounds_charged: int
    q_hat: float
    q_low: float
    q_charged: float
    sigma: float
    sigma_high: float
    c_hat: float
    c_low: float
    z_high: float  # sigma_high / c_low: the run's multiplier at its most generous
    z_charged: float
    epsilon_measured: float  # dp-accounting's price of (q_low, z_high, rounds_seen)
    epsilon_charged: float
    failed: list[str] = field(default_factory=list)
    aborted_seen: int = 0  # rounds that released nothing (secure aggregation aborted them)
    abort_delta_charged: float = 0.0  # the ledger's summed abort failure probability (accounting_aborts)

    @property
    def flagged(self) -> bool:
        return bool(self.failed)

    def describe(self) -> str:
        head = "FLAGGED: " + "; ".join(self.failed) if self.failed else "consistent"
        return (
            f"{head} (rounds {self.rounds_seen} seen / {self.rounds_charged} charged; q >= {self.q_low:.4g} measured "
            f"/ {self.q_charged:.4g} charged; z <= {self.z_high:.4g} measured (sigma {self.sigma:.4g}, c "
            f"{self.c_hat:.4g}) / {self.z_charged:.4g} charged; epsilon {self.epsilon_measured:.4g} measured / "
            f"{self.epsilon_charged:.4g} charged; {self.aborted_seen} rounds aborted, abort delta "
            f"{self.abort_delta_charged:.3g} charged)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"flagged": self.flagged}


def ledger_mechanism(accountant: Any) -> tuple[int, float, float]:
    """(rounds, the largest q, the smallest z) the run's ledger charged: what the audit holds the
    releases to. The discrete Gaussian's z is sqrt(t sigma^2) / C of its shares."""
    entries = [e for e in accountant.state_dict().get("ledger", []) if int(e.get("rounds", 0)) > 0]
    if not entries:
        return 0, 0.0, math.inf
    zs = []
    for e in entries:
        if e.get("mechanism") == "discrete_gaussian":
            zs.append(math.sqrt(int(e["shares"]) * float(e["gamma"]) ** 2 * int(e["variance"])) / float(e["clip"]))
        else:
            zs.append(float(e["z"]))
    return sum(int(e["rounds"]) for e in entries), max(float(e["q"]) for e in entries), min(zs)


def audit_iterates(
    iterates: dict[int, torch.Tensor],
    selected_in: dict[int, list[str]],
    inserted: list[torch.Tensor],
    unseen: list[torch.Tensor],
    canaries: list[str],
    accountant: Any,
    delta: float,
    alpha: float = AUDIT_ALPHA,
) -> IterateAudit:
    """Every round's release against the run's ledger (the module doc): rounds, sampling rate and noise
    per unit of sensitivity, each with a one-sided bound at level ``alpha``, and their dp-accounting price."""
    from scipy.stats import beta, chi2, norm

    rounds_charged, q_charged, z_charged = ledger_mechanism(accountant)
    rounds_seen = len(iterates)
    index = {cid: j for j, cid in enumerate(canaries)}
    k = len(canaries)
    picks = sum(len(v) for r, v in selected_in.items() if r in iterates)
    trials = k * rounds_seen
    q_hat = picks / trials if trials else 0.0
    q_low = float(beta.ppf(alpha, picks, trials - picks + 1)) if picks else 0.0
    released = [d for d in iterates.values() if bool(d.abs().sum() > 0)]  # an aborted round changed nothing
    U = torch.stack([u.double() for u in unseen]) if unseen else torch.zeros(0)
    noise = torch.cat([U @ d for d in released]) if released and len(unseen) else torch.zeros(0, dtype=torch.float64)
    n = int(noise.numel())
    sigma = float(noise.std()) if n > 1 else math.inf
    sigma_high = sigma * math.sqrt((n - 1) / float(chi2.ppf(alpha, n - 1))) if n > 1 else math.inf
    shifts = [
        float(inserted[index[cid]].double() @ iterates[r])
        for r, cids in selected_in.items()
        if r in iterates and bool(iterates[r].abs().sum() > 0)
        for cid in cids
    ]
    c_hat = float(np.mean(shifts)) if shifts else 0.0
    c_low = c_hat - float(norm.ppf(1 - alpha)) * sigma_high / math.sqrt(len(shifts)) if shifts else 0.0
    z_high = sigma_high / c_low if c_low > 0 else math.inf
    kind = getattr(accountant, "kind", "rdp")  # priced as the ledger is (PLD is below RDP at equal parameters)
    measured = epsilon(min(max(q_low, 1e-12), 1.0), z_high, rounds_seen, delta, kind) if math.isfinite(z_high) else 0.0
    charged = float(accountant.epsilon)
    failed = []
    if rounds_seen > rounds_charged:
        failed.append(f"{rounds_seen} rounds released, {rounds_charged} charged")
    if q_low > q_charged * (1 + 1e-9):
        failed.append(f"canaries selected at q >= {q_low:.4g}, the ledger charges q = {q_charged:.4g}")
    if z_high < z_charged * (1 - 1e-9):
        failed.append(f"noise per unit of sensitivity z <= {z_high:.4g}, the ledger charges z = {z_charged:.4g}")
    if measured > charged * (1 + 1e-6):
        failed.append(f"the measured mechanism costs epsilon >= {measured:.4g}, the ledger reports {charged:.4g}")
    # an abort's occurrence depends on the sample (shoal.accounting_aborts): Poisson rounds that aborted
    # need the ledger's abort charge, or the reported delta leaves them out
    aborted = rounds_seen - len(released)
    entries = accountant.state_dict().get("ledger", [])
    abort_charged = sum(int(e.get("rounds", 0)) * float(e.get("abort_delta", 0.0)) for e in entries)
    if aborted and abort_charged <= 0 and any(e.get("sampling") == "poisson" for e in entries):
        failed.append(f"{aborted} rounds aborted under Poisson sampling, the ledger charges no abort delta")
    return IterateAudit(
        rounds_seen, rounds_charged, q_hat, q_low, q_charged, sigma, sigma_high, c_hat, c_low, z_high, z_charged,
        measured, charged, failed, aborted, abort_charged,
    )  # fmt: skip
