"""The one place that turns a config and a task into a run's parts.

``build(cfg, task, role)`` returns a frozen dataclass of every part a role runs:
``simulation`` (SimulationParts: the in-process simulator, the virtual-clock engines and the Ray
driver), ``gossip`` (GossipParts), ``server`` (ServerParts: ``shoal server``), ``node``
(NodeParts: a deployed node, ``shoal client`` and each run of ``shoal node``) and ``client``
(ClientParts: a Ray worker, the Flower ClientApp, a node, ``shoal peer``). Their
constructors take these parts and assemble nothing, so the same config gives the same model,
trainer, client program, strategy and rounds wherever it runs (docs/architecture.md).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import nn

from shoal.aggregation import Strategy, WeightedMean, make_server_optimizer, make_strategy
from shoal.aggregation.compression import Compressor
from shoal.aggregation.fedasync import FedAsync
from shoal.aggregation.fedbuff import FedBuff
from shoal.aggregation.robust import make_aggregator
from shoal.aggregation.scaffold import ScaffoldControl
from shoal.aggregation.staleness import make_staleness_weight
from shoal.algorithms import algorithm_of
from shoal.async_rounds import AsyncRounds
from shoal.client.algorithms import ClientProgram, make_program
from shoal.client.batched import BatchedTrainer, make_batched_trainer
from shoal.client.device import select_device
from shoal.client.state import ClientState, StateMapping, make_client_state
from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.params import ParamSpec, flatten
from shoal.privacy_plan import plan_of
from shoal.privacy_state import (
    NodePrivacy,
    PrivacyBudget,
    expected_clients,
    round_sampling,
    selection_secret,
    sum_dtype,
)
from shoal.rounds import Rounds, SyncRounds
from shoal.secure_sizing import SecureSizing, size_secure_rounds
from shoal.seeding import derive_seed, rng
from shoal.shards import Shard
from shoal.task import (
    ClientData,
    LocalData,
    Population,
    SimulationData,
    Task,
    TaskError,
    call_part,
    check_data,
    check_loss,
    load_task,
    make_model,
    num_examples,
    task_name,
)
from shoal.tasks import BuiltinTask, builtin_local_data

if TYPE_CHECKING:
    from shoal.server.privacy import ServerPrivacy
    from shoal.simulations.client_data import ClientShards, PopulationShards
    from shoal.simulations.dp_hooks import DistributedNoise
    from shoal.simulations.wire_step import WireStep

log = logging.getLogger(__name__)


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


def make_evaluator(cfg: Config, task: Task, device: torch.device | str = "cpu") -> LocalTrainer:
    """A plain trainer of the task's model for evaluation only (a server's central evaluation:
    never DP-SGD, whatever ``[privacy]`` says of the clients' training)."""
    return LocalTrainer(initial_model(cfg, task), cfg.train, device, task=task)


def make_round_strategy(cfg: Config, numel: int, device: torch.device | str, num_clients: int) -> Strategy:
    """The server's strategy: the DP mean for central/distributed DP, else ``[strategy]`` x ``[robust]``."""
    if plan_of(cfg).user_level:
        from shoal.aggregation.dp import make_dp_strategy

        seed = derive_seed(cfg.simulation.seed, 0xD9)
        k = expected_clients(cfg, num_clients)
        return make_dp_strategy(cfg.strategy, cfg.privacy, numel, k, device, seed)
    step = algorithm_of(cfg).server_step  # the registry's declaration (shoal/algorithms.py)
    if step == "fednova":  # config rules allow it only with the plain mean, no DP
        from shoal.aggregation.fednova import FedNovaStrategy

        return FedNovaStrategy(WeightedMean(numel, device), make_server_optimizer(cfg.strategy), cfg.strategy.weighting)
    if step == "feddyn":
        from shoal.aggregation.feddyn import FedDynStrategy

        return FedDynStrategy(numel, num_clients, cfg.algorithm.feddyn_alpha, device, cfg.strategy.weighting)
    return make_strategy(cfg.strategy, numel, device, make_aggregator(cfg.robust, numel, device))


def make_client_program(cfg: Config, task: Task, trainer: LocalTrainer) -> ClientProgram:
    """The client step of ``[algorithm]`` (client/algorithms.py), around ``trainer``."""
    return make_program(cfg, task, trainer)


def make_sync_rounds(
    strategy: Strategy,
    global_params: torch.Tensor,
    clients_per_round: int,
    fraction: float,
    seed: int,
    sampling: str = "fixed",
) -> SyncRounds:
    """Plain SyncRounds (no deadline, no over-selection): the in-process simulator's and Flower's."""
    return SyncRounds(strategy, global_params, clients_per_round, fraction, seed, sampling=sampling)


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


# --- the run's parts -------------------------------------------------------------------------
#
# Each role's constructor takes one of the frozen dataclasses below, built here from a config and
# a task; ``build(cfg, task, role)`` names them all. The order of the steps inside a builder is
# part of the contract: ``initial_model`` seeds torch's generator, and the same seed must give the
# same numbers in every role (the reproducibility and bit-for-bit resume tests hold them to it).


@dataclass(frozen=True)
class Batching:
    """What the batched many-clients trainer is sized for: whether the clients' data are tensors
    held in memory, one example input (None for Datasets, which are never batched), the clients
    per round and the largest client's example count. ``say_why``: log why clients train one by
    one (the driver says it once; Ray workers, which decide the same, keep quiet)."""

    in_memory: bool
    example: Any
    cohort: int
    max_client_size: int
    say_why: bool = True


@dataclass(frozen=True)
class ClientParts:
    """What trains a client: the trainer (the task's model, seeded, bound to its flat vector), the
    client program of ``[algorithm]`` around it and, when the model and task allow, the batched
    trainer of many clients at once (client/batched.py)."""

    task: Task
    device: torch.device
    trainer: LocalTrainer
    program: ClientProgram
    batched: BatchedTrainer | None = None

    @property
    def spec(self) -> ParamSpec:
        """The exchanged parameters (read from the trainer: DP-SGD may swap layers)."""
        return self.trainer.spec


class HoldsClient:
    """The trainer, client program and exchanged parameters of a role's ``client`` parts, for the
    dataclasses that hold one (the simulation's, a node's, the Flower app's)."""

    client: ClientParts

    @property
    def trainer(self) -> LocalTrainer:
        return self.client.trainer

    @property
    def program(self) -> ClientProgram:
        return self.client.program

    @property
    def spec(self) -> ParamSpec:
        return self.client.spec


def batching_blocker(cfg: Config, task: Task, trainer: LocalTrainer, in_memory: bool) -> str | None:
    """Why the config, the task or the model rules out training many clients as one batch (None: it may)."""
    declared = algorithm_of(cfg)
    if plan_of(cfg).dp_sgd:  # DP-SGD clips per sample with Opacus: never batched across clients
        return "privacy.mode = 'local' (DP-SGD) trains each client with Opacus"
    if not declared.batchable:
        return f"algorithm.name = {declared.name!r} trains a personal part of its own on each client"
    if not in_memory:
        return "the clients' data are torch Datasets (read through a DataLoader), not tensors"
    if type(task).loss is not Task.loss:
        return "the task has its own loss (the batched path computes cross-entropy itself)"
    if task.optimizer is not None:
        return f"the task uses the {task.optimizer} optimizer (the batched path runs SGD)"
    if any(not p.requires_grad for p in trainer.model.parameters()):
        return "the model has frozen parameters"
    if type(task).to_device is not Task.to_device:
        return "the task has its own to_device()"
    if cfg.algorithm.keep_optimizer_state:
        return "algorithm.keep_optimizer_state keeps each client's momentum between its rounds"
    return None


def build_client(
    cfg: Config,
    task: Task,
    device: torch.device | str,
    example: ClientData | None,
    batching: Batching | None = None,
) -> ClientParts:
    """The trainer and client program of one process that trains clients (the simulator, a Ray
    worker, a Flower ClientApp, a node, a peer). ``example``: some client's training data, on which
    the task's loss is checked once before the trainer binds the gradients (None: not checked);
    ``batching``: the cohort a batched trainer would take (None: clients train one by one)."""
    device = torch.device(device)
    model = initial_model(cfg, task).to(device)  # seeded by simulation.seed: the same start everywhere
    if example is not None:
        check_loss(task, model, example, device)
    trainer = make_trainer(cfg, task, model, device)
    program = make_client_program(cfg, task, trainer)
    parts = ClientParts(task, device, trainer, program)
    return parts if batching is None else with_batching(cfg, parts, batching)


def with_batching(cfg: Config, parts: ClientParts, batching: Batching) -> ClientParts:
    """``parts`` with the batched trainer of ``batching``'s cohort, when nothing rules it out
    (:func:`batching_blocker`; the reason is logged once)."""
    blocker = batching_blocker(cfg, parts.task, parts.trainer, batching.in_memory)
    if blocker is not None:
        if batching.say_why and cfg.simulation.batch_clients != 1 and batching.cohort > 1:
            log.info("training clients one by one: %s", blocker)
        else:
            log.debug("training clients one by one: %s", blocker)
        return parts
    batched = make_batched_trainer(
        cfg.simulation.batch_clients,
        parts.trainer.model,
        parts.trainer.spec,
        cfg.train,
        parts.device,
        batching.example,
        batching.cohort,
        batching.max_client_size,
        cfg.simulation.cuda_graphs,
    )
    return dataclasses.replace(parts, batched=batched)


RunnerKind = Literal["plain", "secure_aggregation", "edges"]

# A population's federated evaluation: a fixed, seeded sample of a round's size (the same clients
# every evaluation, so the curve compares rounds), loaded one client at a time.
_FED_EVAL_STREAM = 0xFEDE  # seeds that sample apart from client sampling


@dataclass(frozen=True)
class SimulationParts(HoldsClient):
    """Everything the in-process simulator runs (simulations/inprocess.py): the clients' data
    (``shards``: held tensors, or a population loaded client by client), the test sets, who the
    clients are, what trains them, their state store, the server's strategy and rounds (on the
    virtual clock with the deadline keys), SCAFFOLD's control variate, the privacy budget, the wire
    and the sample of a population's federated evaluation. Built final: ``runner`` names the round
    runner (``plain``, ``secure_aggregation`` or virtual ``edges``; the simulation makes it, a
    function of the simulation), ``secure`` is secure aggregation's sizing (shoal/secure_sizing.py:
    t, K_max, the discrete Gaussian), from which ``privacy`` already has the right accountant and
    ``noise`` (distributed DP's client step, None under the discrete Gaussian, which the encoding
    adds) its shares and cohort."""

    cfg: Config
    task: Task
    device: torch.device
    data: SimulationData | None
    shards: ClientShards | PopulationShards
    test: ClientData | None
    client_test: list[ClientData | None] | None
    client_ids: list[str]
    client: ClientParts
    states: ClientState
    strategy: Strategy
    control: ScaffoldControl | None
    rounds: SyncRounds
    privacy: PrivacyBudget | None
    wire: WireStep
    fed_eval_clients: list[int]
    runner: RunnerKind = "plain"
    secure: SecureSizing | None = None
    noise: DistributedNoise | None = None


def build_simulation(
    cfg: Config,
    task: Task | None = None,
    data: SimulationData | Population | None = None,
) -> SimulationParts:
    """The in-process simulator's parts: ``data`` (default: the task's population, or its
    simulation data) split into clients, then the client parts, strategy and rounds."""
    from shoal.simulations.client_data import (
        ClientShards,
        PopulationShards,
        check_population,
        check_simulation_data,
        client_id,
        load_population,
        load_simulation_data,
        on_device,
    )
    from shoal.simulations.dp_hooks import DistributedNoise
    from shoal.simulations.wire_step import WireStep

    task = task if task is not None else task_from_config(cfg)
    sim = cfg.simulation
    device = select_device(sim.device)
    # A task's population (or one passed in) is loaded client by client as rounds select them;
    # SimulationData is held whole.
    population = None
    if data is None:
        population = load_population(task, cfg)
    elif isinstance(data, Population) or hasattr(data, "train_data"):
        population = check_population(task, data)
    held: SimulationData | None = None
    shards: ClientShards | PopulationShards
    client_test: list[ClientData | None] | None = None
    if population is not None:
        shards = PopulationShards(task, population, device)
        client_ids = shards.client_ids
        central = call_part(task, "central_test_data()", task.central_test_data)
        test = on_device(check_data(task, central, "central_test_data()", allow_none=True), device)
    else:
        held = load_simulation_data(task, cfg) if data is None else check_simulation_data(task, data)
        shards = ClientShards(held.train, device)
        test = on_device(held.test, device)
        if held.client_test is not None:
            client_test = [on_device(d, device) for d in held.client_test]
        ids = held.client_ids
        client_ids = [str(c) for c in ids] if ids is not None else [client_id(i) for i in range(len(shards))]
    n = len(client_ids)
    client = build_client(cfg, task, device, shards.data(0))
    spec = client.spec
    # One client step (client/algorithms.py) and the clients' state between their rounds.
    states = make_client_state(cfg.algorithm.state_dir, device)
    strategy = make_round_strategy(cfg, spec.numel, device, n)
    control = ScaffoldControl(spec.numel, n, device) if algorithm_of(cfg).control_variate else None
    flat = client.trainer.flat.detach().clone()
    if sim.mode == "sync" and cfg.heterogeneity.enabled:  # the virtual clock's: deadline, over-selection, late
        a = cfg.asynchronous
        rounds = make_deadline_rounds(
            cfg, flat, spec.numel, sim.clients_per_round, sim.fraction, a.deadline_s or None, a.min_fraction, strategy
        )
    else:  # DP: the sampling its accountant assumes
        rounds = make_sync_rounds(strategy, flat, sim.clients_per_round, sim.fraction, sim.seed, round_sampling(cfg))
    rounds.secret = selection_secret(cfg)  # DP: selection and task seeds from the OS
    secure = size_secure_rounds(cfg, n, spec.numel)  # t, K_max and the discrete Gaussian, checked
    ddg = secure.ddg_accounting() if secure is not None else None  # then accounted with its own bound
    sizes = {c: shards.size(i) for i, c in enumerate(client_ids)}
    aborts = secure.abort_branches if secure is not None else None  # what a round costs with its aborts
    privacy = PrivacyBudget(cfg, sizes, strategy, None, ddg, aborts) if plan_of(cfg).enabled else None
    noise = None  # distributed DP's share: N(0, z^2 C^2 / t), t = secure aggregation's survivors or those selected
    if plan_of(cfg).client_shares and ddg is None:
        noise = DistributedNoise(cfg, rounds, *((secure.noise_shares, secure.max_summands) if secure else ()))
    runner: RunnerKind = "plain"
    if cfg.hierarchy.edges:
        runner = "edges"
    elif cfg.secure_aggregation.enabled:
        runner = "secure_aggregation"
    # top-k residuals: in memory, or beside the clients' state on disk (algorithm.state_dir)
    residuals = None
    if cfg.algorithm.state_dir and cfg.compression.encoding == "topk":
        residuals = StateMapping(make_client_state(f"{cfg.algorithm.state_dir}/residuals"), "residual")
    wire = WireStep(cfg.compression, spec, residuals)
    cohort = rounds.sample_size(n)
    client = with_batching(
        cfg, client, Batching(shards.in_memory, shards.example if shards.in_memory else None, cohort, shards.max_size())
    )
    fed_eval: list[int] = []
    if isinstance(shards, PopulationShards) and shards.has_test:
        picked = rng(sim.seed, _FED_EVAL_STREAM).choice(n, size=min(n, cohort), replace=False)
        fed_eval = sorted(int(i) for i in picked)
    return SimulationParts(
        cfg,
        task,
        device,
        held,
        shards,
        test,
        client_test,
        client_ids,
        client,
        states,
        strategy,
        control,
        rounds,
        privacy,
        wire,
        fed_eval,
        runner,
        secure,
        noise,
    )


@dataclass(frozen=True)
class ServerParts:
    """What an aggregator (server/service.py) runs: the task, the exchanged spec (with the base of
    frozen parameters), the rounds (``sync``: the SyncRounds of ``server.mode = "sync"``, else None;
    ``rounds``: those, or the AsyncRounds of ``"async"``) and the server's DP state."""

    task: Task
    spec: ParamSpec
    rounds: Rounds
    sync: SyncRounds | None
    privacy: ServerPrivacy | None


def build_server(cfg: Config, task: Task | None = None, registered: int | None = None) -> ServerParts:
    """The aggregator's parts. The global model is one flat vector: the module it came from is not
    kept (a trainer is made only for a central evaluation). ``registered``: the enabled nodes of the
    registry, N of FedDyn's and SCAFFOLD's server steps (None: the larger of clients_per_round and
    min_nodes until the registry binds it)."""
    from shoal.server.privacy import ServerPrivacy

    s = cfg.server
    if s.mode not in algorithm_of(cfg).modes:
        raise ConfigError(
            f"algorithm.name = {cfg.algorithm.name!r} with server.mode = {s.mode!r}: the algorithm's client state "
            "and server step assume a node trains from the round's model and its result belongs to that round; "
            "use server.mode = 'sync' (docs/algorithms.md)"
        )
    task = task if task is not None else task_from_config(cfg)
    # The same seed gives the same initial model as `shoal simulate` and as every node.
    model = initial_model(cfg, task)
    spec = ParamSpec.of(model, exchange_buffers=task.exchange_buffers).with_base(model)
    flat = flatten(model, spec)
    del model
    # [privacy]: the DP strategy, Poisson sampling, the accountant and the budget (server/privacy.py)
    privacy = ServerPrivacy(cfg, spec.numel) if plan_of(cfg).enabled else None
    if s.mode != "sync":  # versions advance with the updates themselves
        return ServerParts(task, spec, make_async_rounds(cfg, flat, spec.numel), None, privacy)
    strategy = privacy.strategy if privacy is not None else None
    population = registered or max(s.clients_per_round, s.min_nodes)
    strategy = strategy or make_round_strategy(cfg, spec.numel, "cpu", population)
    narrow = sum_dtype(s.sum_dtype, spec.numel) == torch.float32
    if narrow and type(strategy) is Strategy and type(strategy.aggregator) is WeightedMean:
        # half the sum's memory, and the mean and new model made in its place (aggregation/mean.py)
        strategy.aggregator = WeightedMean(spec.numel, "cpu", torch.float32)
        log.info(
            "the round's sum is float32 (server.sum_dtype = %r, %d parameters): %.0f MB instead of %.0f",
            s.sum_dtype,
            spec.numel,
            spec.numel * 4 / 1e6,
            spec.numel * 8 / 1e6,
        )
    if algorithm_of(cfg).control_variate:
        from shoal.aggregation.scaffold import ScaffoldStrategy

        strategy = ScaffoldStrategy(strategy, spec.numel, population)
    sampling = "poisson" if privacy is not None and privacy.user_level else "fixed"
    sync = make_deadline_rounds(
        cfg, flat, spec.numel, s.clients_per_round, s.fraction, s.deadline_s, s.min_fraction, strategy, sampling
    )
    return ServerParts(task, spec, sync, sync, privacy)


@dataclass(frozen=True)
class GossipParts:
    """What the gossip simulator's network runs (simulations/gossip/network.py): the peers' data
    (one peer per client of the task's simulation data), the test sets and what trains a peer."""

    cfg: Config
    task: Task
    data: SimulationData
    shards: ClientShards
    test: ClientData | None
    client_test: list[ClientData | None] | None
    client: ClientParts

    @property
    def device(self) -> torch.device:
        return self.client.device


def build_gossip(cfg: Config, task: Task | None = None, data: SimulationData | None = None) -> GossipParts:
    """The gossip network's parts; ``data`` defaults to the task's simulation data. Every peer starts
    from the same model; DP-SGD (privacy.mode = 'local') may swap layers (BatchNorm), so the
    exchanged spec and the initial model are the trainer's."""
    from shoal.simulations.client_data import ClientShards, check_simulation_data, load_simulation_data, on_device

    task = task if task is not None else task_from_config(cfg)
    device = select_device(cfg.simulation.device)
    held = load_simulation_data(task, cfg) if data is None else check_simulation_data(task, data)
    shards = ClientShards(held.train, device)
    client = build_client(cfg, task, device, shards.data(0))
    client_test = None if held.client_test is None else [on_device(d, device) for d in held.client_test]
    return GossipParts(cfg, task, held, shards, on_device(held.test, device), client_test, client)


@dataclass(frozen=True)
class NodeParts(HoldsClient):
    """What a deployed node (client/node.py) runs: its config and task, its name, its checked
    training and test data (tensors on the device; a Dataset as it is), the trainer and client
    program (``client``: the simulator's client step), the store of its client state between
    rounds and restarts, its side of ``[privacy]`` (None without privacy) and the upload's
    encoder (``[compression]``, which keeps top-k's error-feedback residual)."""

    cfg: Config
    task: Task
    name: str
    train: ClientData
    test: ClientData | None
    client: ClientParts
    states: ClientState
    privacy: NodePrivacy | None
    compressor: Compressor


def build_node(
    cfg: Config,
    task: Task | None = None,
    data: LocalData | Shard | None = None,
    device: torch.device | str = "cpu",
    name: str = "",
    state_dir: Path | None = None,
    privacy_ledger: Path | None = None,
) -> NodeParts:
    """A deployed node's parts. ``data``: the node's own (``local_data()``'s LocalData, or a shard
    of ``shoal data split`` for the built-in task, whose client id names the node unless ``name``
    does); ``state_dir``: the folder of its client state (None: in memory); ``privacy_ledger``: the
    file where a local-DP node keeps the rounds it spent (None: in memory)."""
    from shoal.client.state import DiskClientState, MemoryClientState
    from shoal.simulations.client_data import on_device

    task = task if task is not None else task_from_config(cfg)
    if data is None:
        raise TaskError(f"task {task_name(task)}: a node needs its own data (local_data() or a shard)")
    if isinstance(data, Shard):
        name = name or data.client_id
        if not isinstance(task, BuiltinTask):
            raise TaskError(
                f"task {task_name(task)}: a shard file is data of the built-in task; "
                "give the data this task's local_data() reads"
            )
        data = builtin_local_data(task, data)
    name = name or "node"
    device = torch.device(device)
    train = on_device(check_data(task, data.train, "local_data().train"), device)
    assert train is not None  # check_data refuses a missing training set
    test = on_device(check_data(task, data.test, "local_data().test", allow_none=True), device)
    if num_examples(train) == 0:
        raise TaskError(f"task {task_name(task)}: local_data().train has no examples")
    if test is not None and num_examples(test) == 0:
        test = None
    # The same initial model as the server (simulation.seed: frozen parameters and client-local
    # buffers never travel, so they must start equal everywhere) and the client step of
    # [algorithm] (the simulator's), the task's loss checked on this node's data first.
    client = build_client(cfg, task, device, train)
    states: ClientState = MemoryClientState()
    if state_dir is not None and client.program.keeps_state:  # a folder only when the algorithm keeps something
        states = DiskClientState(state_dir, device)
    privacy = NodePrivacy(cfg, name, num_examples(train), privacy_ledger) if plan_of(cfg).enabled else None
    return NodeParts(cfg, task, name, train, test, client, states, privacy, Compressor(cfg.compression))


Role = Literal["simulation", "gossip", "server", "node", "client"]


@overload
def build(cfg: Config, task: Task | None, role: Literal["simulation"], **inputs: Any) -> SimulationParts: ...
@overload
def build(cfg: Config, task: Task | None, role: Literal["gossip"], **inputs: Any) -> GossipParts: ...
@overload
def build(cfg: Config, task: Task | None, role: Literal["server"], **inputs: Any) -> ServerParts: ...
@overload
def build(cfg: Config, task: Task | None, role: Literal["node"], **inputs: Any) -> NodeParts: ...
@overload
def build(cfg: Config, task: Task | None, role: Literal["client"], **inputs: Any) -> ClientParts: ...
def build(
    cfg: Config, task: Task | None, role: Role, **inputs: Any
) -> SimulationParts | GossipParts | ServerParts | NodeParts | ClientParts:
    """The parts of ``role`` for ``cfg`` and ``task`` (None: the config's task):

    - ``simulation``: the in-process simulator's (``data=``); the virtual-clock engines and the
      Ray engine's driver run on it;
    - ``gossip``: the gossip simulator's network (``data=``);
    - ``server``: an aggregator's (``registered=``);
    - ``node``: a deployed node's (``data=`` its LocalData or shard, ``device=``, ``name=``,
      ``state_dir=`` its client state's folder, ``privacy_ledger=`` its local-DP ledger);
    - ``client``: what trains clients in one process: a Ray worker, a Flower ClientApp, a
      deployed node, a peer (``device=``, ``example=`` some client's data to check the loss on,
      ``batching=`` the cohort of a batched trainer).
    """
    task = task if task is not None else task_from_config(cfg)
    if role == "simulation":
        return build_simulation(cfg, task, **inputs)
    if role == "gossip":
        return build_gossip(cfg, task, **inputs)
    if role == "server":
        return build_server(cfg, task, **inputs)
    if role == "node":
        return build_node(cfg, task, **inputs)
    if role == "client":
        return build_client(cfg, task, **inputs)
    raise ValueError(f"no parts for role {role!r}: one of simulation, gossip, server, node, client")
