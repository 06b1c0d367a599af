"""The Flower ClientApp runs the client program: FedPer, FedRep, Ditto, FedDyn, FedNova, SCAFFOLD
and kept momentum through Flower give the in-process engine's global model and federated figures
(personalised ones included), each client's state kept in its node's ``context.state``.

Most cases run shoal's ServerApp and ClientApp with Flower's own Messages, Contexts and
dispatch, the nodes served in this process by a small grid (no Ray, well under a second a
case); tests/flower/test_flower.py runs FedPer through the real Flower simulation (Ray).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from shoal.aggregation.scaffold import ScaffoldStrategy
from shoal.config import load_config
from shoal.flower.apps import (
    ARRAYS,
    BROADCAST,
    CLIENT_STATE,
    CONFIG,
    PENDING,
    ShoalStrategy,
    make_server_app,
    round_strategy,
    setup_for,
    to_arrays,
)
from shoal.flower.client_app import make_client_app
from shoal.simulations.inprocess import InProcessSimulation

from ..simulations.test_client_algorithms import TASK  # two of four classes per client, a personal head

SERVER_NODE = 1


def small(task_file: Path, *extra: str) -> list[str]:
    return [
        f"task.app='{task_file}:TwoClasses'",
        "simulation.num_clients=4",
        "simulation.clients_per_round=2",
        "simulation.rounds=2",
        "simulation.eval_every=1",
        "simulation.device='cpu'",
        "simulation.progress=false",
        "output.plots=false",
        "simulation.ray_num_cpus=2",
        "simulation.flower_client_cpus=1",
        "train.lr=0.05",
        *extra,
    ]


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "two_classes.py"
    path.write_text(TASK)
    return path


class LocalGrid:
    """Flower's Grid for ClientApps called in this process: one Context per node, kept across
    messages as a SuperNode keeps it (its ``state`` is the node's), the reply made by the app."""

    def __init__(self, client_app, num_nodes: int):
        self.app = client_app
        self.contexts = {
            100 + i: Context(
                run_id=1,
                node_id=100 + i,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            TaskIdentity.node_id = node  # the reply is the node's
            try:
                replies.append(self.app(msg, self.contexts[node]))
            finally:
                TaskIdentity.node_id = SERVER_NODE
        return replies


@contextlib.contextmanager
def server_process():
    """Flower's identity of this process while it plays the ServerApp (Messages are made from it)."""
    before = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SERVER_NODE
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = before


class ArrivingGrid(LocalGrid):
    """Flower's simulation registers its SuperNodes while the ServerApp already runs: here one
    more node is connected at each look."""

    def __init__(self, client_app, num_nodes: int):
        super().__init__(client_app, num_nodes)
        self.seen = 0

    def get_node_ids(self):
        self.seen = min(self.seen + 1, len(self.contexts))
        return list(self.contexts)[: self.seen]


def run_local_flower(
    cfg, num_nodes: int, grid_class: type[LocalGrid] = LocalGrid
) -> tuple[list[dict[str, float]], torch.Tensor, LocalGrid]:
    """shoal's ServerApp and ClientApp of ``cfg`` over a LocalGrid: each evaluated round's figures
    and the final global model."""
    rounds: list[dict[str, float]] = []
    final: list[torch.Tensor] = []

    def on_round(summary, ev, params):
        rounds.append({**ev, "train_loss": summary.train_loss})
        final[:] = [params]

    grid = grid_class(make_client_app(cfg, "cpu"), num_nodes)
    with server_process():
        server = make_server_app(cfg, on_round, strict=True)
        server(grid, Context(run_id=1, node_id=SERVER_NODE, node_config={}, state=RecordDict(), run_config={}))
    return rounds, final[0], grid


def run_inprocess(cfg) -> tuple[list[dict[str, float]], torch.Tensor]:
    sim = InProcessSimulation.from_config(cfg)
    rounds = []
    for _ in range(cfg.simulation.rounds):
        summary = sim.run_round()
        rounds.append({**sim.evaluate(), "train_loss": summary.train_loss})
    return rounds, sim.global_params.cpu()


def close(a: dict[str, float], b: dict[str, float]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (key, a[key], b[key])


def test_the_simulation_samples_from_every_node_even_while_they_are_still_registering(task_file):
    """The simulation's ServerApp waits for all its nodes before the first round's sampling: the
    clients the in-process engine picks, however late Flower registers the last nodes."""
    cfg = load_config(None, small(task_file, "simulation.engine='flower'", "simulation.rounds=1"))
    flower, flower_model, grid = run_local_flower(cfg, cfg.simulation.num_clients, ArrivingGrid)
    inproc, inproc_model = run_inprocess(load_config(None, small(task_file, "simulation.rounds=1")))
    assert grid.seen == cfg.simulation.num_clients
    assert (flower_model - inproc_model).abs().max().item() <= 1e-5
    close(flower[0], inproc[0])


@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm.name='ditto'", "algorithm.personal_eval_steps=0"],
        ["algorithm.name='fedrep'", "algorithm.personal_eval_steps=2"],
        ["algorithm.name='feddyn'"],
        ["algorithm.name='fednova'", "train.momentum=0.5"],
        ["train.momentum=0.9", "algorithm.keep_optimizer_state=true", "algorithm.personal_eval_steps=1"],
        ["algorithm.name='scaffold'", "simulation.rounds=3", "train.momentum=0.5"],
    ],
    ids=["ditto", "fedrep", "feddyn", "fednova", "momentum", "scaffold"],
)
def test_the_clientapp_runs_the_client_program_as_in_process(task_file, extra):
    cfg = load_config(None, small(task_file, *extra, "simulation.engine='flower'"))  # the config rules allow it
    flower, flower_model, grid = run_local_flower(cfg, cfg.simulation.num_clients)
    inproc, inproc_model = run_inprocess(load_config(None, small(task_file, *extra)))
    assert (flower_model - inproc_model).abs().max().item() <= 1e-5
    assert len(flower) == len(inproc) == cfg.simulation.rounds
    for a, b in zip(flower, inproc, strict=True):
        close(a, b)
        assert {"test_accuracy", "fed_accuracy"} <= set(a)
        assert ("fed_personal_accuracy" in a) == ("algorithm.personal_eval_steps" in " ".join(extra))
    # what each node keeps lives in its own context.state (FedNova keeps nothing)
    kept = [c.state.array_records.get(CLIENT_STATE) for c in grid.contexts.values()]
    assert any(record is not None and len(record) > 0 for record in kept) == setup_for(cfg).program.keeps_state


DROPOUT_TASK = """
import torch
from torch import nn
from shoal.task import SimulationData, Task


class Dropped(Task):
    \"\"\"2-d blobs of four classes through a model with dropout (it draws from torch's global RNG).\"\"\"

    def model(self):
        return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        centres = torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]])
        y = [torch.randint(0, 4, (24 + 2 * i,), generator=g) for i in range(num_clients)]
        train = [(centres[t] + torch.randn(len(t), 2, generator=g), t) for t in y]
        return SimulationData(train=train, test=train[0])
"""


def test_a_model_with_dropout_gives_the_in_process_model(tmp_path):
    """Dropout's draws come from the client pipeline's RNG, seeded from each client's round seed:
    whatever the process drew before (another client, another run, a Ray actor's history), the
    ClientApp's model is the in-process engine's."""
    path = tmp_path / "dropped.py"
    path.write_text(DROPOUT_TASK)
    extra = [f"task.app='{path}:Dropped'", "simulation.rounds=3"]
    cfg = load_config(None, [*small(path, *extra), "simulation.engine='flower'"])
    torch.manual_seed(12345)  # a global RNG state unlike the in-process run's
    _, flower_model, _ = run_local_flower(cfg, cfg.simulation.num_clients)
    torch.manual_seed(0)
    start = InProcessSimulation.from_config(load_config(None, small(path, *extra))).global_params.cpu().clone()
    torch.manual_seed(777)
    _, inproc_model = run_inprocess(load_config(None, small(path, *extra)))
    assert (inproc_model - start).abs().max().item() > 1e-3  # it trained
    assert (flower_model - inproc_model).abs().max().item() <= 1e-6


def test_scaffold_nodes_keep_their_control_variate_only_when_the_server_took_their_update(task_file):
    """SCAFFOLD on Flower: c goes with each task, Delta c_i with each reply, and a node's new c_i
    waits in its context.state until a later message says the server aggregated that update; a
    reply the server never got leaves c and that node's c_i as they were, so c stays the mean of
    the c_i (as the in-process engine keeps it)."""
    cfg = load_config(None, small(task_file, "algorithm.name='scaffold'", "simulation.engine='flower'"))
    setup = setup_for(cfg)
    numel, n = setup.spec.numel, cfg.simulation.num_clients
    inner = round_strategy(cfg, setup)  # what shoal's ServerApp aggregates with
    assert isinstance(inner, ScaffoldStrategy)
    strategy = ShoalStrategy(inner, setup.spec, 2, seed=cfg.simulation.seed, federated_eval=lambda r: True)

    class DroppingGrid(LocalGrid):
        """Round 2's first train reply never reaches the server."""

        trains = 0
        dropped: tuple[int, object] | None = None  # (node, its committed state when it was asked)

        def send_and_receive(self, messages, timeout=None):
            messages = list(messages)
            replies = super().send_and_receive(messages, timeout)
            if messages and messages[0].metadata.message_type == "train":
                self.trains += 1
                if self.trains == 2:
                    node = messages[0].metadata.dst_node_id
                    self.dropped = (node, self.contexts[node].state.array_records.get(CLIENT_STATE))
                    return replies[1:]
            return replies

    grid = DroppingGrid(make_client_app(cfg, "cpu"), n)
    with server_process():
        strategy.start(grid, to_arrays(setup.initial, setup.spec), num_rounds=2)
    assert strategy.last_round is not None and strategy.last_round.num_results == 1
    assert grid.dropped is not None
    node, before = grid.dropped
    after = grid.contexts[node].state.array_records.get(CLIENT_STATE)
    assert (before is None and after is None) or torch.equal(
        torch.from_numpy(before["scaffold/c"].numpy()), torch.from_numpy(after["scaffold/c"].numpy())
    )
    assert all(PENDING not in c.state.array_records for c in grid.contexts.values())  # the evaluation settled them
    c_is = []
    for context in grid.contexts.values():
        record = context.state.array_records.get(CLIENT_STATE)
        c_is.append(torch.zeros(numel) if record is None else torch.from_numpy(record["scaffold/c"].numpy().copy()))
    assert inner.control.c.abs().max() > 0
    assert torch.allclose(torch.stack(c_is).mean(0), inner.control.c, atol=1e-6)  # c = (1/N) sum_i c_i


def test_a_broadcast_not_of_the_models_size_is_refused_before_training(task_file):
    """What comes beside the model is checked: a c of another size stops the step with one line
    naming it, and the node's state is left as it was."""
    cfg = load_config(None, small(task_file, "algorithm.name='scaffold'"))
    setup = setup_for(cfg)
    grid = LocalGrid(make_client_app(cfg, "cpu"), 1)
    with server_process():
        content = RecordDict(
            {
                ARRAYS: to_arrays(setup.initial, setup.spec),
                CONFIG: ConfigRecord({"server-round": 1, "seed": 7, "version": 0}),
                BROADCAST: ArrayRecord({"scaffold/c": torch.zeros(3)}),
            }
        )
        msg = Message(content, dst_node_id=100, message_type=MessageType.TRAIN)
        with pytest.raises(ValueError, match="'scaffold/c' of 3"):
            grid.send_and_receive([msg])
    assert not grid.contexts[100].state.array_records
