"""shoal inside Flower 1.41 (the message API): a server strategy and a ClientApp.

:class:`ShoalStrategy` is a ``flwr.serverapp.strategy.Strategy`` whose aggregation is
shoal's streaming :class:`~shoal.aggregation.Strategy` (FedAvg, FedAvgM, FedAdam, ...)
driven by shoal's :class:`~shoal.rounds.SyncRounds`: the same client sampling, the same
per-client seeds and the same checks as the in-process engine and the HTTP server.
:func:`make_client_app` turns shoal's :class:`~shoal.client.training.LocalTrainer` into
a Flower ClientApp, so a shoal client joins a SuperLink through ``flower-supernode``.

Messages follow Flower's conventions, so either side also works with Flower's own
counterpart: the model travels as an ArrayRecord under ``"arrays"`` (named like the
model's state_dict), the reply carries the client's *local model* there and a
MetricRecord ``"metrics"`` with ``"num-examples"``; the server forms the delta.
A shoal ClientApp answers a QUERY message with its client id (``client-00003`` for
partition 3), which lets the server map Flower node ids to shoal client ids and sample
exactly as the in-process engine does; a node that does not answer is ``node-<id>``.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from shoal.aggregation import Strategy, make_strategy
from shoal.aggregation.robust import make_aggregator
from shoal.client.device import select_device
from shoal.client.training import LocalTrainer
from shoal.config import Config, load_config
from shoal.datasets import FederatedData, load_federated
from shoal.errors import ConfigError, SpecMismatch, UpdateRejected
from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.rounds import RoundSummary, SyncRounds, Assignment, i_hash
from shoal.seeding import derive_seed
from shoal.update import Update

log = logging.getLogger(__name__)

ARRAYS = "arrays"            # Flower's default ArrayRecord key
CONFIG = "config"            # Flower's default ConfigRecord key
METRICS = "metrics"
NUM_EXAMPLES = "num-examples"  # Flower's default weighting key
IDENTITY = "identity"        # the ConfigRecord of a QUERY reply: {"client-id": ...}
RUN_CONFIG_KEY = "shoal-config"  # run_config key (pyproject.toml / --run-config) naming the TOML file


def client_id(partition_id: int) -> str:
    """The id the in-process engine gives client ``partition_id`` (same sampling, same seeds)."""
    return f"client-{partition_id:05d}"


# --- the model as an ArrayRecord -------------------------------------------------------


def to_arrays(flat: torch.Tensor, spec: ParamSpec) -> ArrayRecord:
    """The flat parameter vector as an ArrayRecord named like the model's state_dict."""
    return ArrayRecord({name: t.detach().cpu() for name, t in spec.views(flat).items()})


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
class Setup:
    """Data, model spec and a trainer built from a Config, once per process (a Ray actor
    serves many simulated clients; loading the dataset per message would dominate)."""

    cfg: Config
    data: FederatedData
    trainer: LocalTrainer
    initial: torch.Tensor  # the global model before round 1, as the in-process engine makes it

    @property
    def spec(self) -> ParamSpec:
        return self.trainer.spec


def _build(cfg: Config, device: str) -> Setup:
    data = load_federated(cfg.data, cfg.simulation.num_clients, cfg.simulation.seed)
    torch.manual_seed(cfg.simulation.seed)  # model initialisation, as InProcessSimulation does
    model = build_model(cfg.model.name, data.input_shape, data.num_classes)
    trainer = LocalTrainer(model, cfg.train, select_device(device))
    return Setup(cfg, data, trainer, trainer.flat.detach().clone().cpu())


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
    Evaluation is central (``evaluate_fn`` of :meth:`start`), as in the in-process
    engine; no federated evaluation messages are sent. A failed or rejected reply is
    logged and left out of the round, or with ``strict`` raised as UpdateRejected (the
    simulation engine is strict: a simulated client has no excuse to fail).
    """

    def __init__(self, strategy: Strategy, spec: ParamSpec, clients_per_round: int = 0,
                 fraction: float = 0.1, seed: int = 0, min_available_nodes: int = 1, strict: bool = False,
                 device: torch.device | str = "cpu"):
        self.strategy = strategy
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

    def summary(self) -> None:
        log.info(
            "ShoalStrategy: %s, K=%s, fraction=%s, seed=%d, %d parameters",
            type(self.strategy.optimizer).__name__, self.clients_per_round, self.fraction, self.seed, self.spec.numel,
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
            for reply in grid.send_and_receive(asks, timeout=timeout):
                node = reply.metadata.src_node_id
                cid = f"node-{node}"
                if not reply.has_error() and IDENTITY in reply.content.config_records:
                    cid = str(reply.content.config_records[IDENTITY]["client-id"])
                if self.node_of.get(cid, node) != node and self.node_of[cid] in online:
                    raise ConfigError(f"two Flower nodes claim client id {cid!r}: give each node its own partition-id")
                self.node_of[cid] = node  # a restarted node comes back under a new node id
        return {cid: node for cid, node in self.node_of.items() if node in online}

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        params = from_arrays(arrays, self.spec).to(self.device)
        if self.rounds is None:
            self.rounds = SyncRounds(self.strategy, params, self.clients_per_round, self.fraction, self.seed)
        else:
            self.rounds.global_params = params
        while len(list(grid.get_node_ids())) < self.min_available_nodes:
            log.info("waiting for %d Flower nodes to connect", self.min_available_nodes)
            time.sleep(1)  # as Flower's own sample_nodes waits
        node_of = self.identify(grid)
        tasks = self.rounds.start_round(list(node_of))
        self._tasks = {node_of[t.client_id]: t for t in tasks}
        messages = []
        for node, task in self._tasks.items():
            conf = ConfigRecord(dict(config))
            conf.update({"server-round": server_round, "client-id": task.client_id, "seed": task.seed,
                         "version": task.version})
            content = RecordDict({ARRAYS: arrays, CONFIG: conf})
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rounds = self.rounds
        order = {node: i for i, node in enumerate(self._tasks)}
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
                    delta=local - rounds.global_params, num_examples=int(metrics[NUM_EXAMPLES]),
                    base_version=task.version, sender=task.client_id,
                    metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
                )
                rounds.submit(task.client_id, update)
            except (KeyError, SpecMismatch, UpdateRejected, ValueError) as e:
                self._drop(server_round, task.client_id, f"rejected: {e}")
        if not rounds.received:
            rounds.abort_round()  # nothing to aggregate: model and version stay
            log.warning("round %d: no usable reply; the global model is unchanged", server_round)
            return None, None
        self.last_round = rounds.finish_round()
        s = self.last_round
        return to_arrays(rounds.global_params, self.spec), MetricRecord(
            {"train_loss": s.train_loss, "num-results": s.num_results, NUM_EXAMPLES: s.num_examples}
        )

    def _drop(self, server_round: int, cid: str, why: str) -> None:
        if self.strict:
            raise UpdateRejected("client_failed", f"round {server_round}: {cid} {why}")
        log.warning("round %d: %s %s", server_round, cid, why)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None


# Called after each round's central evaluation: (round summary, {"accuracy", "loss"}, global params).
RoundCallback = Callable[[RoundSummary, dict[str, float], torch.Tensor], None]


def make_server_app(cfg: Config | None = None, on_round: RoundCallback | None = None,
                    timeout: float = 3600, strict: bool = False) -> ServerApp:
    """A ServerApp running ``cfg``'s rounds with :class:`ShoalStrategy` and central evaluation
    on the test set every ``simulation.eval_every`` rounds (and the last). Without ``cfg``
    it reads the config named by the run config key ``shoal-config``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        c = cfg or config_from_context(context)
        sim = c.simulation
        setup = setup_for(c, sim.device)
        trainer, test = setup.trainer, setup.data.test
        strategy = ShoalStrategy(
            make_strategy(c.strategy, setup.spec.numel, trainer.device,
                          make_aggregator(c.robust, setup.spec.numel, trainer.device)), setup.spec,
            sim.clients_per_round, sim.fraction, sim.seed, strict=strict, device=trainer.device,
        )

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0 or not (server_round % sim.eval_every == 0 or server_round == sim.rounds):
                return None
            params = from_arrays(arrays, setup.spec)
            ev = trainer.evaluate(params, test.x, test.y)
            if on_round is not None and strategy.last_round is not None:
                on_round(strategy.last_round, ev, params)
            return MetricRecord(ev)

        strategy.start(grid, to_arrays(setup.initial, setup.spec), num_rounds=sim.rounds,
                       timeout=timeout, evaluate_fn=evaluate)

    return app


# --- the client side --------------------------------------------------------------------


def _partition(context: Context) -> int:
    try:
        return int(context.node_config["partition-id"])
    except KeyError:
        raise ConfigError(
            "node config has no 'partition-id': start the node with "
            "flower-supernode --node-config 'partition-id=3 num-partitions=10'"
        ) from None


def make_client_app(cfg: Config | None = None, device: str | None = None) -> ClientApp:
    """A ClientApp training shoal's LocalTrainer on client ``partition-id`` of ``cfg``'s data.

    Train messages from :class:`ShoalStrategy` carry the seed; from another strategy
    (Flower's FedAvg) the seed is derived from (simulation.seed, server-round, client
    id) exactly as SyncRounds derives it. ``device`` defaults to ``train.device``.
    """
    app = ClientApp()

    @app.query()
    def identify(msg: Message, context: Context) -> Message:
        cid = client_id(_partition(context))
        return Message(RecordDict({IDENTITY: ConfigRecord({"client-id": cid})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        c = cfg or config_from_context(context)
        pid = _partition(context)
        setup = setup_for(c, device)
        if not 0 <= pid < setup.data.num_clients:
            raise ConfigError(f"partition-id {pid} is outside the {setup.data.num_clients} clients of this config")
        conf = msg.content.config_records.get(CONFIG, ConfigRecord())
        cid = client_id(pid)
        rnd = int(conf.get("server-round", 1))
        seed = int(conf.get("seed", derive_seed(c.simulation.seed, rnd, i_hash(cid))))
        version = int(conf.get("version", rnd - 1))
        global_flat = from_arrays(msg.content.array_records[ARRAYS], setup.spec)
        shard = setup.data.client(pid)
        dev = setup.trainer.device
        update = setup.trainer.train(global_flat, shard.x.to(dev), shard.y.to(dev), seed, version, cid)
        return Message(
            RecordDict({
                ARRAYS: to_arrays(setup.trainer.flat, setup.spec),
                METRICS: MetricRecord({NUM_EXAMPLES: update.num_examples, **update.metrics}),
            }),
            reply_to=msg,
        )

    return app
