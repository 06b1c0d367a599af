"""shoal's client as a Flower ClientApp (the message API): :func:`make_client_app`.

The ClientApp runs the client pipeline (client/pipeline.py) that the in-process simulator, the
Ray workers and the deployed node run: the ``[algorithm]`` client program on client
``partition-id`` of the task's simulation data, seeded from the assignment's seed (its batches
and its dropout draws), so a Flower run gives the in-process engine's model. What a client
keeps between its rounds lives in the node's ``context.state`` (Flower's store: a Ray actor's
trainer serves many nodes), loaded before and saved after each step; SCAFFOLD's new ``c_i`` is
held until a later message says (``taken``) that the server aggregated that update. The
records' layout and the server side are flower/apps.py.
"""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from shoal.client.state import State
from shoal.config import Config
from shoal.errors import ConfigError
from shoal.params import ParamSpec
from shoal.rounds import Assignment, i_hash
from shoal.seeding import derive_seed

from .apps import (
    ARRAYS,
    BROADCAST,
    CLIENT_STATE,
    CONFIG,
    IDENTITY,
    METRICS,
    NUM_EXAMPLES,
    PENDING,
    PENDING_VERSION,
    PERSONAL,
    TAKEN,
    TO_SERVER,
    Setup,
    config_from_context,
    from_arrays,
    metric_record,
    scalar,
    setup_for,
    tensor_record,
    to_arrays,
)


def _partition(context: Context) -> int:
    try:
        return int(context.node_config["partition-id"])
    except KeyError:
        raise ConfigError(
            "node config has no 'partition-id': start the node with "
            "flower-supernode --node-config 'partition-id=3 num-partitions=10'"
        ) from None


def _node(context: Context, cfg: Config | None, device: str | None) -> tuple[Setup, int, str]:
    """This node's Setup, partition and client id."""
    c = cfg or config_from_context(context)
    pid = _partition(context)
    setup = setup_for(c, device)
    if not 0 <= pid < setup.num_clients:
        raise ConfigError(f"partition-id {pid} is outside the {setup.num_clients} clients of this config")
    return setup, pid, setup.client_ids[pid]


def load_state(setup: Setup, context: Context) -> State:
    """This node's client state from its ``context.state`` (empty before its first round, or when
    the algorithm keeps nothing): a Ray actor's trainer serves many nodes, so nothing of one
    node's stays in it between messages."""
    if not setup.program.keeps_state:
        return {}
    record = context.state.array_records.get(CLIENT_STATE)
    if record is None:
        return {}
    return {k: torch.from_numpy(v.numpy().copy()) for k, v in record.items()}


def save_state(setup: Setup, context: Context, state: State, version: int) -> None:
    """The state the client program returned replaces this node's (it is the whole new state);
    for a program whose state follows the server's (SCAFFOLD: c stays the mean of the c_i) it is
    kept aside with the update's base ``version`` until the server says it took that update."""
    if not setup.program.keeps_state:
        return
    record = tensor_record(state)
    if setup.program.settles:
        context.state[PENDING] = record
        context.state[PENDING_VERSION] = ConfigRecord({"version": version})
    else:
        context.state[CLIENT_STATE] = record


def _broadcast_of(msg: Message, spec: ParamSpec) -> State:
    """What the server's step sent beside the model (SCAFFOLD's c): model-sized float vectors,
    else a ValueError naming the entry (nothing is trained on a vector of another model)."""
    out: State = {}
    for name, array in (msg.content.array_records.get(BROADCAST) or {}).items():
        t = torch.from_numpy(array.numpy().copy()).reshape(-1)
        if t.numel() != spec.numel or not t.is_floating_point():
            raise ValueError(
                f"the server sent {name!r} of {t.numel()} {t.dtype} entries beside the model; "
                f"this model has {spec.numel} float parameters"
            )
        out[name] = t.float()
    return out


def settle(setup: Setup, context: Context, conf: ConfigRecord) -> None:
    """SCAFFOLD: the state set aside after this node's last step becomes its state when the
    server's message says it aggregated that update (``taken`` = its base version); otherwise
    (dropped, refused, the round aborted) it is discarded, as the in-process engine discards it."""
    if not setup.program.settles or PENDING not in context.state.array_records or TAKEN not in conf:
        return
    meta = context.state.config_records.get(PENDING_VERSION)
    taken = int(scalar(conf[TAKEN], TAKEN))
    if meta is not None and int(scalar(meta["version"], "version")) == taken:
        context.state[CLIENT_STATE] = context.state.array_records[PENDING]
    del context.state[PENDING]
    if meta is not None:
        del context.state[PENDING_VERSION]


def make_client_app(cfg: Config | None = None, device: str | None = None) -> ClientApp:
    """A ClientApp running shoal's client step (the ``[algorithm]`` client program) on client
    ``partition-id`` of the task's simulation data (``task.simulation_data(simulation.num_clients,
    simulation.seed)``).

    Train messages from :class:`ShoalStrategy` carry the seed; from another strategy
    (Flower's FedAvg) the seed is derived from (simulation.seed, server-round, client
    id) exactly as SyncRounds derives it. The reply's model is the global one plus the update
    the program sends. Evaluate messages are answered with the task's metrics on the client's
    own test data (``num-examples`` 0 when it has none), with its own buffers (FedBN) and, with
    ``algorithm.personal_eval_steps`` >= 0, the metrics of its personalised model as
    ``personal_<metric>``. The client's state between rounds lives in the node's
    ``context.state``. ``device`` defaults to ``train.device``.
    """
    app = ClientApp()

    @app.query()
    def identify(msg: Message, context: Context) -> Message:
        _, _, cid = _node(context, cfg, device)
        return Message(RecordDict({IDENTITY: ConfigRecord({"client-id": cid})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        setup, pid, cid = _node(context, cfg, device)
        conf = msg.content.config_records.get(CONFIG, ConfigRecord())
        rnd = int(scalar(conf.get("server-round", 1), "server-round"))
        seed = int(scalar(conf.get("seed", derive_seed(setup.cfg.simulation.seed, rnd, i_hash(cid))), "seed"))
        version = int(scalar(conf.get("version", rnd - 1), "version"))
        global_flat = from_arrays(msg.content.array_records[ARRAYS], setup.spec)
        broadcast = _broadcast_of(msg, setup.spec)  # checked before anything of the node's changes
        settle(setup, context, conf)
        task = Assignment(cid, rnd, version, seed)
        state = load_state(setup, context)
        try:  # the client pipeline's training step: its batches and dropout seeded from ``seed``
            result = setup.pipeline.train_one(setup.client_train(pid), task, global_flat, state, broadcast)
        except KeyError as e:  # the algorithm's broadcast did not come with the model
            raise ConfigError(
                f"algorithm.name = {setup.program.name!r} needs {e} with the model, and the server sent none: "
                "run the ServerApp with shoal's ShoalStrategy and the same [algorithm]"
            ) from None
        save_state(setup, context, result.state, version)
        update = result.update
        local = global_flat + update.delta.detach().to(global_flat.device)  # what the program sends, as a model
        content = RecordDict(
            {
                ARRAYS: to_arrays(local, setup.spec),
                METRICS: metric_record({NUM_EXAMPLES: update.num_examples, **update.metrics}),
            }
        )
        if result.to_server:
            content[TO_SERVER] = tensor_record(result.to_server)
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        setup, pid, _ = _node(context, cfg, device)
        test = setup.client_test(pid)
        metrics: dict[str, int | float] = {NUM_EXAMPLES: 0}
        settle(setup, context, msg.content.config_records.get(CONFIG, ConfigRecord()))
        if test is not None:
            state = load_state(setup, context)
            setup.program.load_buffers(state)  # FedBN: this node's own statistics
            params = from_arrays(msg.content.array_records[ARRAYS], setup.spec)
            ev = setup.trainer.evaluate_data(params, test, summarize=False)  # raw means: the strategy summarizes
            metrics = {NUM_EXAMPLES: int(ev.pop("num_examples")), **ev}
            steps = setup.cfg.algorithm.personal_eval_steps
            if steps >= 0:  # the personalised model: its personal part, fine-tuned on its own training data
                conf = msg.content.config_records.get(CONFIG, ConfigRecord())
                version = int(scalar(conf.get("version", conf.get("server-round", 0)), "version"))
                seed = derive_seed(setup.cfg.simulation.seed, pid, version)  # as the in-process engine seeds it
                tuned = setup.program.fine_tuned(setup.client_train(pid), params, state, steps, seed)
                personal = setup.trainer.evaluate_data(tuned, test, summarize=False)
                personal.pop("num_examples")
                metrics.update({f"{PERSONAL}{k}": v for k, v in personal.items()})
        return Message(RecordDict({METRICS: metric_record(metrics)}), reply_to=msg)

    return app
