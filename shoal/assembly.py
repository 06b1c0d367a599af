"""The one place that turns a config and a task into a run's objects.

Every engine and service calls these instead of wiring objects by hand: the simulator
(sync, virtual clock, gossip, Flower), ``shoal server``, ``shoal client`` and
``shoal peer``. So the same config gives the same model, trainer, strategy and rounds
wherever it runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from shoal.aggregation import Strategy, WeightedMean, make_server_optimizer, make_strategy
from shoal.aggregation.fedasync import FedAsync
from shoal.aggregation.fedbuff import FedBuff
from shoal.aggregation.robust import make_aggregator
from shoal.aggregation.staleness import make_staleness_weight
from shoal.async_rounds import AsyncRounds
from shoal.client.algorithms import ClientProgram, make_program
from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.privacy_plan import plan_of
from shoal.rounds import SyncRounds
from shoal.seeding import derive_seed
from shoal.task import Task, load_task, make_model
from shoal.tasks import BuiltinTask


def task_from_config(cfg: Config) -> Task:
    """``[task] app`` (with ``[task.args]``), or the built-in task of ``[model]`` + ``[data]``."""
    if cfg.task.app:
        return load_task(cfg.task.app, cfg.task.args)
    return BuiltinTask(cfg.model.name, cfg.data, cfg.simulation.num_clients, cfg.simulation.seed)


def with_absolute_task(cfg: Config) -> Config:
    """``cfg`` with a task file path (``[task] app = "dir/file.py:name"``) made absolute, so
    processes started elsewhere (Ray workers, other nodes) import the same file."""
    target, sep, attr = cfg.task.app.rpartition(":")
    if not sep or not (target.endswith(".py") or "/" in target or "\\" in target):
        return cfg
    path = Path(target).expanduser()
    if path.is_absolute():
        return cfg
    out = copy.deepcopy(cfg)
    out.task.app = f"{path.resolve()}:{attr}"
    return out


def task_label(cfg: Config, task: Task) -> str:
    """A short name for plots and logs."""
    return task.describe() if hasattr(task, "describe") else cfg.task.app


def initial_model(cfg: Config, task: Task) -> nn.Module:
    """The task's model initialised from ``simulation.seed``: the same start everywhere."""
    return make_model(task, cfg.simulation.seed)


def make_trainer(cfg: Config, task: Task, model: nn.Module, device: torch.device | str) -> LocalTrainer:
    """Local training as ``[train]`` and ``[privacy]`` say (DP-SGD for privacy.mode = "local")."""
    if plan_of(cfg).dp_sgd:
        from shoal.client.dp_sgd import DpSgdTrainer  # Opacus only when asked for

        return DpSgdTrainer(model, cfg.train, cfg.privacy, device, task=task)
    return LocalTrainer(model, cfg.train, device, task=task)


def expected_clients(cfg: Config, num_clients: int) -> int:
    """K, the number of clients a round selects (as SyncRounds.sample_size): the DP mean's
    fixed denominator, the number of noise shares, and q = K / N for the accountant."""
    sim = cfg.simulation
    return min(sim.clients_per_round or max(1, round(sim.fraction * num_clients)), num_clients)


def make_round_strategy(cfg: Config, numel: int, device: torch.device | str, num_clients: int) -> Strategy:
    """The server's strategy: the DP mean for central/distributed DP, else ``[strategy]`` x ``[robust]``."""
    if plan_of(cfg).user_level:
        from shoal.aggregation.dp import make_dp_strategy

        seed = derive_seed(cfg.simulation.seed, 0xD9)
        k = expected_clients(cfg, num_clients)
        return make_dp_strategy(cfg.strategy, cfg.privacy, numel, k, device, seed)
    if cfg.algorithm.name == "fednova":  # config rules allow it only with the plain mean, no DP
        from shoal.aggregation.fednova import FedNovaStrategy

        return FedNovaStrategy(WeightedMean(numel, device), make_server_optimizer(cfg.strategy), cfg.strategy.weighting)
    if cfg.algorithm.name == "feddyn":
        from shoal.aggregation.feddyn import FedDynStrategy

        return FedDynStrategy(numel, num_clients, cfg.algorithm.feddyn_alpha, device, cfg.strategy.weighting)
    return make_strategy(cfg.strategy, numel, device, make_aggregator(cfg.robust, numel, device))


def make_client_program(cfg: Config, task: Task, trainer: LocalTrainer) -> ClientProgram:
    """The client step of ``[algorithm]`` (client/algorithms.py), around ``trainer``."""
    return make_program(cfg, task, trainer)


def make_deadline_rounds(
    cfg: Config,
    global_params: torch.Tensor,
    numel: int,
    clients_per_round: int,
    fraction: float,
    deadline_s: float | None,
    min_fraction: float,
    strategy: Strategy | None = None,
    sampling: str = "fixed",
) -> SyncRounds:
    """SyncRounds with the ``[asynchronous]`` over-selection and late-result keys (``sampling``:
    SyncRounds' fixed | poisson; a DP server samples Poisson, server/privacy.py)."""
    a = cfg.asynchronous
    device = global_params.device
    strategy = strategy or make_strategy(cfg.strategy, numel, device, make_aggregator(cfg.robust, numel, device))
    return SyncRounds(
        strategy,
        global_params,
        clients_per_round,
        fraction,
        cfg.simulation.seed,
        over_selection=a.over_selection,
        deadline_s=deadline_s,
        min_fraction=min_fraction,
        late=a.late,
        late_weight=make_staleness_weight(a.staleness_weight, a.staleness_a, a.staleness_b),
        max_staleness=a.max_staleness,
        sampling=sampling,
    )


def make_async_rounds(cfg: Config, global_params: torch.Tensor, numel: int) -> AsyncRounds:
    """The AsyncRounds an ``[asynchronous]`` config describes (simulator and server)."""
    a, rb = cfg.asynchronous, cfg.robust
    weight = make_staleness_weight(a.staleness_weight, a.staleness_a, a.staleness_b)
    if a.algorithm == "fedasync":  # config validation refuses robust rules other than the norm bound here
        algorithm: FedAsync | FedBuff = FedAsync(a.alpha, weight, a.fedasync_mix, rb.norm_bound)
    else:  # a robust rule (or a norm bound) combines FedBuff's K buffered updates
        rule = None if rb.rule == "mean" and rb.norm_bound == 0 else make_aggregator(rb, numel, global_params.device)
        algorithm = FedBuff(
            a.buffer_size,
            make_server_optimizer(cfg.strategy),
            weight,
            cfg.strategy.weighting,
            numel,
            global_params.device,
            rule,
        )
    return AsyncRounds(algorithm, global_params, cfg.simulation.seed, a.max_staleness)
