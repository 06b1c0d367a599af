"""shoal inside Flower 1.41 (the message API): a server strategy; the ClientApp is flower/client_app.py.

:class:`ShoalStrategy` is a ``flwr.serverapp.strategy.Strategy`` whose aggregation is
shoal's streaming :class:`~shoal.aggregation.Strategy` (FedAvg, FedAvgM, FedAdam, ...)
driven by shoal's :class:`~shoal.rounds.SyncRounds`: the same client sampling, the same
per-client seeds and the same checks as the in-process engine and the HTTP server.
:func:`~shoal.flower.client_app.make_client_app` runs shoal's client pipeline (client/pipeline.py,
the one the in-process simulator, the Ray workers and the deployed node run) as a Flower
ClientApp, so a shoal client joins a SuperLink through ``flower-supernode``.
What a client keeps between its rounds (FedBN's buffers, FedPer's and FedRep's personal layers,
Ditto's personal model, FedDyn's gradient memory, SCAFFOLD's control variate, momentum) lives
in the node's ``context.state``, loaded before and saved after each step. SCAFFOLD's server
control variate travels with each train message (``"shoal-broadcast"``), each reply's control
variate delta beside its model (``"shoal-to-server"``), and a node keeps its new ``c_i`` only once
a later message says (``taken``) that the server aggregated that update.

Both sides load the run's task (shoal/task.py: ``[task] app``, else the built-in task of
``[model]`` + ``[data]``) and build model, trainer and strategy through shoal.assembly;
a node trains on client ``partition-id`` of ``task.simulation_data(...)``.

Messages follow Flower's conventions, so either side also works with Flower's own
counterpart: the model travels as an ArrayRecord under ``"arrays"`` (named like the
model's state_dict), the reply carries the client's *local model* there (the global model plus
the update the client program sends: for FedPer, FedRep and Ditto the personal parts are not
in it) and a MetricRecord ``"metrics"`` with ``"num-examples"``; the server forms the delta.
EVALUATE messages ask the nodes to evaluate the global model on their own test data
(the task's metrics, ``num-examples`` = their test examples, 0 without test data) and, with
``algorithm.personal_eval_steps``, their personalised model too (``personal_<metric>``).
A shoal ClientApp answers a QUERY message with its client id (``client-00003`` for
partition 3, or the task's ``client_ids[3]``), which lets the server map Flower node ids
to shoal client ids and sample exactly as the in-process engine does; a node that does
not answer is ``node-<id>``.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues, MetricRecordValues
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from shoal import assembly
from shoal.aggregation import Strategy
from shoal.algorithms import algorithm_of
from shoal.assembly import ClientParts, HoldsClient, make_round_strategy, make_sync_rounds, task_from_config, task_label
from shoal.client.device import select_device
from shoal.client.pipeline import ClientPipeline
from shoal.config import Config, load_config
from shoal.errors import ConfigError, EngineError, SpecMismatch, UpdateRejected
from shoal.params import ParamSpec
from shoal.rounds import Assignment, RoundSummary, SyncRounds, evaluation_due
from shoal.simulations.client_data import client_id, load_simulation_data, on_device
from shoal.simulations.inprocess import weighted_means
from shoal.task import ClientData, SimulationData, Task
from shoal.update import Update

log = logging.getLogger(__name__)

ARRAYS = "arrays"  # Flower's default ArrayRecord key
CONFIG = "config"  # Flower's default ConfigRecord key
METRICS = "metrics"
NUM_EXAMPLES = "num-examples"  # Flower's default weighting key
IDENTITY = "identity"  # the ConfigRecord of a QUERY reply: {"client-id": ...}
CLIENT_STATE = "shoal-state"  # a node's context.state ArrayRecord: its client program's state (client/state.py)
# SCAFFOLD: the server's control variate c with each train message, each reply's Delta c_i beside its
# model; a node keeps its new c_i aside until a later message says the server took its update.
BROADCAST = "shoal-broadcast"  # a train message's ArrayRecord: what the server's step sends beside the model
TO_SERVER = "shoal-to-server"  # a train reply's ArrayRecord: what the server's step needs beside the update
PENDING = "shoal-pending"  # a node's context.state ArrayRecord: the new state, until the server took the update
PENDING_VERSION = "shoal-pending-version"  # a node's context.state ConfigRecord: {"version": the update's base}
TAKEN = "taken"  # config key: the base version of this client's last update the server aggregated (-1: none)
PERSONAL = "personal_"  # an evaluation reply's personalised metrics (algorithm.personal_eval_steps)
RUN_CONFIG_KEY = "shoal-config"  # run_config key (pyproject.toml / --run-config) naming the TOML file


# --- records -----------------------------------------------------------------------------


def scalar(value: ConfigRecordValues, key: str) -> int | float | str | bytes:
    """A record entry for int() or float(): a list (a node's bad reply) is a ValueError, which
    the strategy turns into a dropped reply, not a TypeError that stops the run."""
    if isinstance(value, list):
        raise ValueError(f"{key!r} is a list, expected a number")
    return value


def metric_record(values: Mapping[str, int | float]) -> MetricRecord:
    """A MetricRecord of numbers (flwr's constructor takes an invariant dict of its value union)."""
    record: dict[str, MetricRecordValues] = dict(values)
    return MetricRecord(record)


# --- the model as an ArrayRecord -------------------------------------------------------


def to_arrays(flat: torch.Tensor, spec: ParamSpec) -> ArrayRecord:
    """The flat parameter vector as an ArrayRecord named like the model's state_dict."""
    return tensor_record(spec.views(flat))


def tensor_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors (a client's state, what an algorithm sends beside the model) as an ArrayRecord."""
    return ArrayRecord({name: t.detach().cpu() for name, t in tensors.items()})


def from_arrays(record: ArrayRecord, spec: ParamSpec) -> torch.Tensor:
    """An ArrayRecord back into one flat float32 vector; SpecMismatch unless the names
    and shapes are exactly the spec's (nothing is reshaped or guessed)."""
    got = {k: tuple(v.shape) for k, v in record.items()}
    want = {e.name: e.shape for e in spec.entries}
    if got != want:
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        wrong = sorted(k for k in want.keys() & got.keys() if got[k] != want[k])
        raise SpecMismatch(
            f"ArrayRecord does not match the model: missing {missing}, unexpected {extra}, wrong shape {wrong}"
        )
    return torch.cat([torch.from_numpy(record[e.name].numpy()).reshape(-1).float() for e in spec.entries])


# --- what both sides build from one Config ----------------------------------------------


@dataclass
class Setup(HoldsClient):
    """Task, data, model spec and the client parts (trainer and client program) built from a
    Config, once per process (a Ray actor serves many simulated clients; loading the task's data
    per message would dominate). Nothing in it belongs to one client: each node's state is in
    its own ``context.state``."""

    cfg: Config
    task: Task
    data: SimulationData
    client: ClientParts
    initial: torch.Tensor  # the global model before round 1, as the in-process engine makes it
    client_ids: list[str]
    test: ClientData | None  # the central test set, on the trainer's device
    pipeline: ClientPipeline  # the client's steps around ``client.program`` (client/pipeline.py)
    _train: dict[int, ClientData] = field(default_factory=dict)
    _test: dict[int, ClientData | None] = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    @property
    def label(self) -> str:
        return task_label(self.cfg, self.task)

    @property
    def has_client_test(self) -> bool:
        return self.data.client_test is not None and any(d is not None for d in self.data.client_test)

    def client_train(self, i: int) -> ClientData:
        """Client i's training data (tensors moved to the device once; a Dataset as it is)."""
        if i not in self._train:
            self._train[i] = on_device(self.data.train[i], self.trainer.device)  # type: ignore[assignment]
        return self._train[i]

    def client_test(self, i: int) -> ClientData | None:
        """Client i's own test data, or None."""
        if self.data.client_test is None:
            return None
        if i not in self._test:
            self._test[i] = on_device(self.data.client_test[i], self.trainer.device)
        return self._test[i]


def _build(cfg: Config, device: str) -> Setup:
    task = task_from_config(cfg)
    data = load_simulation_data(task, cfg)
    client = assembly.build(cfg, task, "client", device=select_device(device), example=data.train[0])
    trainer = client.trainer
    dev = trainer.device
    ids = (
        [str(c) for c in data.client_ids]
        if data.client_ids is not None
        else [client_id(i) for i in range(len(data.train))]
    )
    initial = trainer.flat.detach().clone().cpu()
    return Setup(cfg, task, data, client, initial, ids, on_device(data.test, dev), ClientPipeline(client.program))


@functools.lru_cache(maxsize=2)
def _cached(cfg_json: str, device: str) -> Setup:
    from shoal.config import config_from_dict

    return _build(config_from_dict(json.loads(cfg_json)).validate(), device)


def setup_for(cfg: Config, device: str | None = None) -> Setup:
    """The (cached) Setup of ``cfg``; ``device`` defaults to ``cfg.train.device``."""
    return _cached(json.dumps(cfg.to_dict(), sort_keys=True), device or cfg.train.device)


def config_from_context(context: Context) -> Config:
    """The shoal Config a deployed app names in its run config (``shoal-config = "x.toml"``)."""
    path = context.run_config.get(RUN_CONFIG_KEY)
    if not path:
        raise ConfigError(
            f"run config has no {RUN_CONFIG_KEY!r}: set it to a shoal TOML file in the app's "
            f"pyproject.toml ([tool.flwr.app.config]) or with --run-config '{RUN_CONFIG_KEY}=\"x.toml\"'"
        )
    return load_config(str(path))


# --- the server side --------------------------------------------------------------------


class ShoalStrategy(FlowerStrategy):
    """A Flower message-API strategy that aggregates with a shoal Strategy.

    Sampling is SyncRounds' (K = ``clients_per_round``, else ``fraction`` of the
    clients, seeded by (seed, round)); each train message carries the client's id and
    seed so a shoal ClientApp trains exactly as the in-process engine would. Replies
    are accumulated in task order, so the result does not depend on arrival order.
    Central evaluation is ``evaluate_fn`` of :meth:`start`. In the rounds where
    ``federated_eval(round)`` is true, every connected node is sent an EVALUATE message
    and evaluates the new global model on its own test data; the replies' metrics are
    averaged weighted by their ``num-examples`` into :attr:`last_federated`
    (``fed_<metric>`` and ``fed_num_examples``, as the in-process engine names them).
    A failed or rejected reply is logged and left out, or with ``strict`` raised as
    UpdateRejected (the simulation engine is strict: a simulated client has no excuse to fail).
    """

    def __init__(
        self,
        strategy: Strategy,
        spec: ParamSpec,
        clients_per_round: int = 0,
        fraction: float = 0.1,
        seed: int = 0,
        min_available_nodes: int = 1,
        strict: bool = False,
        device: torch.device | str = "cpu",
        federated_eval: Callable[[int], bool] | None = None,
        task: Task | None = None,
        start_timeout_s: float | None = None,
    ):
        self.strategy = strategy
        # the simulation engine's bound on Flower starting its clients (simulation.ray_start_timeout_s);
        # None for a deployed SuperLink, whose SuperNodes may connect whenever they like
        self.start_timeout_s = start_timeout_s
        self.task = task  # summarizes the pooled federated means (perplexity, R²...) once
        self.device = torch.device(device)  # where the strategy's buffers live (make_strategy's device)
        self.spec = spec
        self.clients_per_round = clients_per_round
        self.fraction = fraction
        self.seed = seed
        self.min_available_nodes = min_available_nodes
        self.strict = strict
        self.rounds: SyncRounds | None = None
        self.node_of: dict[str, int] = {}  # shoal client id -> Flower node id
        self.last_round: RoundSummary | None = None
        self._tasks: dict[int, Assignment] = {}  # node id -> the task of the open round
        self.federated_eval = federated_eval
        self.last_federated: dict[str, float] = {}  # fed_<metric> of the last round that evaluated
        self._eval_nodes: dict[int, str] = {}  # node id -> client id of the open evaluation
        # an algorithm with a server step of its own (SCAFFOLD): its broadcast goes with each task,
        # each reply's to_server comes back, and each node is told which of its updates were taken
        self.stateful = callable(getattr(strategy, "broadcast", None))
        self.taken: dict[str, int] = {}  # client id -> base version of its last aggregated update

    def summary(self) -> None:
        log.info(
            "ShoalStrategy: %s, K=%s, fraction=%s, seed=%d, %d parameters",
            type(self.strategy.optimizer).__name__,
            self.clients_per_round,
            self.fraction,
            self.seed,
            self.spec.numel,
        )

    def identify(self, grid: Grid, timeout: float = 600) -> dict[str, int]:
        """Client id -> node id of the connected nodes; nodes not seen before are asked
        for their client id with a QUERY message."""
        connected = list(grid.get_node_ids())
        online = set(connected)
        known = set(self.node_of.values())
        new = [n for n in connected if n not in known]
        if new:
            asks = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in new]
            first = not self.node_of and self.start_timeout_s is not None
            replies = list(grid.send_and_receive(asks, timeout=self.start_timeout_s if first else timeout))
            if first and not replies:
                raise EngineError(
                    f"none of the {len(new)} Flower clients answered within simulation.ray_start_timeout_s = "
                    f"{self.start_timeout_s:g} s: Ray started no ClientApp actor (Flower's log above says why; "
                    "check simulation.flower_client_cpus / flower_client_gpus against what the machine has)"
                )
            if first and len(replies) < len(new):  # sampling from those that answered picks other clients
                raise EngineError(
                    f"{len(replies)} of the {len(new)} Flower clients answered within "
                    f"simulation.ray_start_timeout_s = {self.start_timeout_s:g} s; raise it on a busy machine"
                )
            for reply in replies:
                node = reply.metadata.src_node_id
                cid = f"node-{node}"
                if not reply.has_error() and IDENTITY in reply.content.config_records:
                    cid = str(reply.content.config_records[IDENTITY]["client-id"])
                if self.node_of.get(cid, node) != node and self.node_of[cid] in online:
                    raise ConfigError(f"two Flower nodes claim client id {cid!r}: give each node its own partition-id")
                self.node_of[cid] = node  # a restarted node comes back under a new node id
        return {cid: node for cid, node in self.node_of.items() if node in online}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        params = from_arrays(arrays, self.spec).to(self.device)
        if self.rounds is None:
            self.rounds = make_sync_rounds(self.strategy, params, self.clients_per_round, self.fraction, self.seed)
        else:
            self.rounds.global_params = params
        started, said = time.monotonic(), False
        while (connected := len(list(grid.get_node_ids()))) < self.min_available_nodes:
            if self.start_timeout_s is not None and time.monotonic() - started > self.start_timeout_s:
                raise EngineError(
                    f"{connected} of {self.min_available_nodes} Flower nodes connected within "
                    f"simulation.ray_start_timeout_s = {self.start_timeout_s:g} s"
                )
            if not said:
                log.info("waiting for %d Flower nodes to connect", self.min_available_nodes)
                said = self.start_timeout_s is not None  # a deployed server says it every second
            # a simulation registers its nodes within milliseconds; a deployed SuperNode takes its time
            time.sleep(0.02 if self.start_timeout_s is not None else 1)
        node_of = self.identify(grid)
        tasks = self.rounds.start_round(list(node_of))
        self._tasks = {node_of[t.client_id]: t for t in tasks}
        broadcast = self._broadcast()
        messages = []
        for node, task in self._tasks.items():
            conf = ConfigRecord(dict(config))
            conf.update(
                {
                    "server-round": server_round,
                    "client-id": task.client_id,
                    "seed": task.seed,
                    "version": task.version,
                    TAKEN: self.taken.get(task.client_id, -1),
                }
            )
            content = RecordDict({ARRAYS: arrays, CONFIG: conf})
            if broadcast is not None:
                content[BROADCAST] = broadcast
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages

    def _broadcast(self) -> ArrayRecord | None:
        """What the algorithm's server step sends beside the model (SCAFFOLD's c), or None."""
        aux = self.strategy.broadcast() if self.stateful else None
        return tensor_record(aux) if aux is not None else None

    def _to_server(self, reply: Message) -> dict[str, torch.Tensor]:
        """A reply's tensors for the algorithm's server step (the strategy checks their names and
        sizes when it takes the update); nothing for a strategy without such a step."""
        record = reply.content.array_records.get(TO_SERVER) if self.stateful else None
        if record is None:
            return {}
        return {k: torch.from_numpy(v.numpy().copy()).reshape(-1).float().to(self.device) for k, v in record.items()}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rounds = self.rounds
        if rounds is None:
            raise RuntimeError("aggregate_train() before configure_train(): no round is open")
        order = {node: i for i, node in enumerate(self._tasks)}
        replies = list(replies)
        silent = set(self._tasks) - {m.metadata.src_node_id for m in replies}
        for node in sorted(silent, key=order.__getitem__):  # no reply at all: as a failure, strict or logged
            self._drop(server_round, self._tasks[node].client_id, "sent no reply")
        for reply in sorted(replies, key=lambda m: order.get(m.metadata.src_node_id, len(order))):
            node = reply.metadata.src_node_id
            task = self._tasks.get(node)
            if task is None:
                log.warning("round %d: reply from node %d, which was not asked", server_round, node)
                continue
            if reply.has_error():
                self._drop(server_round, task.client_id, f"failed: {reply.error.reason}")
                continue
            try:
                local = from_arrays(reply.content.array_records[ARRAYS], self.spec).to(self.device)
                metrics = reply.content.metric_records[METRICS]
                update = Update(
                    delta=local - rounds.global_params,
                    num_examples=int(scalar(metrics[NUM_EXAMPLES], NUM_EXAMPLES)),
                    base_version=task.version,
                    sender=task.client_id,
                    metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                    to_server=self._to_server(reply),
                )
                rounds.submit(task.client_id, update)
            except (KeyError, SpecMismatch, UpdateRejected, ValueError, TypeError) as e:  # TypeError: a bad dtype
                self._drop(server_round, task.client_id, f"rejected: {e}")
        if not rounds.received:
            rounds.abort_round()  # nothing to aggregate: model and version stay
            log.warning("round %d: no usable reply; the global model is unchanged", server_round)
            return None, None
        taken = {t.client_id: t.version for t in self._tasks.values() if t.client_id in rounds.received}
        self.last_round = rounds.finish_round()
        s = self.last_round
        if not s.failed:
            self.taken.update(taken)
        return to_arrays(rounds.global_params, self.spec), MetricRecord(
            {"train_loss": s.train_loss, "num-results": s.num_results, NUM_EXAMPLES: s.num_examples}
        )

    def _drop(self, server_round: int, cid: str, why: str) -> None:
        if self.strict:
            raise UpdateRejected("client_failed", f"round {server_round}: {cid} {why}")
        log.warning("round %d: %s %s", server_round, cid, why)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._eval_nodes = {}
        if self.federated_eval is None or not self.federated_eval(server_round):
            return []
        node_of = self.identify(grid)
        messages = []
        for cid in sorted(node_of):
            node = node_of[cid]
            self._eval_nodes[node] = cid
            conf = ConfigRecord(dict(config))
            version = self.rounds.version if self.rounds is not None else 0
            conf.update(
                {"server-round": server_round, "client-id": cid, "version": version, TAKEN: self.taken.get(cid, -1)}
            )
            content = RecordDict({ARRAYS: arrays, CONFIG: conf})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.EVALUATE))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted means of the nodes' metrics on their own test data (``fed_<metric>``),
        and of their personalised models' (``personal_<metric>`` -> ``fed_personal_<metric>``),
        each summarized by the task on its own, as the in-process engine does."""
        if not self._eval_nodes:
            return None
        order = {node: i for i, node in enumerate(self._eval_nodes)}
        results, personal = [], []
        for reply in sorted(replies, key=lambda m: order.get(m.metadata.src_node_id, len(order))):
            cid = self._eval_nodes.get(reply.metadata.src_node_id, f"node-{reply.metadata.src_node_id}")
            if reply.has_error():
                self._drop(server_round, cid, f"evaluation failed: {reply.error.reason}")
                continue
            try:
                metrics = reply.content.metric_records[METRICS]
                n = float(scalar(metrics[NUM_EXAMPLES], NUM_EXAMPLES))
            except (KeyError, TypeError, ValueError) as e:
                self._drop(server_round, cid, f"evaluation reply rejected: {e}")
                continue
            if n > 0:
                ev = {k: float(v) for k, v in metrics.items() if k != NUM_EXAMPLES and isinstance(v, (int, float))}
                results.append({k: v for k, v in ev.items() if not k.startswith(PERSONAL)} | {"num_examples": n})
                own = {k.removeprefix(PERSONAL): v for k, v in ev.items() if k.startswith(PERSONAL)}
                if own:
                    personal.append({**own, "num_examples": n})
        self.last_federated = {f"fed_{k}": v for k, v in weighted_means(results, self.task).items()}
        self.last_federated.update({f"fed_{PERSONAL}{k}": v for k, v in weighted_means(personal, self.task).items()})
        return metric_record(self.last_federated) if self.last_federated else None


# Called after each evaluated round: (round summary, {"test_<metric>", "fed_<metric>", ...}, global params).
RoundCallback = Callable[[RoundSummary, dict[str, float], torch.Tensor], None]


def round_strategy(cfg: Config, setup: Setup, device: torch.device | str = "cpu") -> Strategy:
    """The shoal strategy a ShoalStrategy of ``cfg`` aggregates with: ``[strategy]`` (or FedNova's,
    FedDyn's or the DP mean, as shoal.assembly makes it) and, for SCAFFOLD, the server control
    variate moved over the updates each round took (N: the task's clients)."""
    inner = make_round_strategy(cfg, setup.spec.numel, device, setup.num_clients)
    if not algorithm_of(cfg).control_variate:
        return inner
    from shoal.aggregation.scaffold import ScaffoldStrategy

    return ScaffoldStrategy(inner, setup.spec.numel, setup.num_clients, device)


def evaluated_round(cfg: Config) -> Callable[[int], bool]:
    """The rounds the in-process engine evaluates: every ``eval_every``-th and the last."""
    sim = cfg.simulation
    return lambda r: evaluation_due(r, sim.eval_every, sim.rounds)


def make_server_app(
    cfg: Config | None = None,
    on_round: RoundCallback | None = None,
    timeout: float = 3600,
    strict: bool = False,
    errors: list[BaseException] | None = None,
) -> ServerApp:
    """A ServerApp running ``cfg``'s rounds with :class:`ShoalStrategy`; every
    ``simulation.eval_every`` rounds (and the last) the task's metrics of the global model
    on its central test set (``test_<metric>``) and, when the task's clients have test
    data, the nodes' federated evaluation (``fed_<metric>``). Without ``cfg`` it reads the
    config named by the run config key ``shoal-config``. An exception of the app is also
    appended to ``errors`` (Flower logs it in its own thread and ends with a generic one)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            _main(grid, context)
        except BaseException as e:
            if errors is not None:
                errors.append(e)
            raise

    def _main(grid: Grid, context: Context) -> None:
        c = cfg or config_from_context(context)
        sim = c.simulation
        setup = setup_for(c, sim.device)
        trainer = setup.trainer
        due = evaluated_round(c)
        strategy = ShoalStrategy(
            round_strategy(c, setup, trainer.device),
            setup.spec,
            sim.clients_per_round,
            sim.fraction,
            sim.seed,
            # the simulation's SuperNodes are registered while this app already runs: sampling from
            # the first ones to appear would pick other clients than the in-process engine picks
            min_available_nodes=setup.num_clients if strict else 1,
            strict=strict,
            device=trainer.device,
            federated_eval=due if setup.has_client_test else None,
            task=setup.task,
            start_timeout_s=sim.ray_start_timeout_s if strict else None,  # strict: the simulation engine
        )

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if not due(server_round):
                return None
            params = from_arrays(arrays, setup.spec)
            ev: dict[str, float] = {}
            if setup.test is not None:
                central = trainer.evaluate_data(params, setup.test)
                ev.update({f"test_{k}": v for k, v in central.items() if k != "num_examples"})
            ev.update(strategy.last_federated)  # this round's, from aggregate_evaluate (it runs first)
            if on_round is not None and strategy.last_round is not None:
                on_round(strategy.last_round, ev, params)
            return metric_record(ev) if ev else None

        strategy.start(
            grid, to_arrays(setup.initial, setup.spec), num_rounds=sim.rounds, timeout=timeout, evaluate_fn=evaluate
        )

    return app
