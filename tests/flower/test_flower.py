"""shoal inside Flower: the ArrayRecord mapping, the engine's Ray settings, and one real
Flower simulation (Ray) compared with the in-process engine on the same config and seed: a
user's task file named by a relative path (Dataset clients, FedBN, FedPer's personal heads,
a custom metric, federated and personalised evaluation).

Each Flower simulation starts and stops a Ray runtime (tens of seconds on two loaded cores),
so the suite runs one that works (a module fixture that three tests read) and one that cannot
start a client. Ray is held to 2 CPUs, one per client actor.
"""

import json
import math

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError, SpecMismatch
from shoal.flower.apps import from_arrays, to_arrays
from shoal.flower.engine import backend_config
from shoal.metrics import read_jsonl
from shoal.models import build_model
from shoal.params import ParamSpec, flatten
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation

# every Ray runtime of the suite on one xdist worker, one at a time; the module fixture built once
pytestmark = pytest.mark.xdist_group("ray")

SMALL = [
    "simulation.num_clients=2",
    "simulation.clients_per_round=1",
    "simulation.rounds=1",
    "simulation.device='cpu'",
    "simulation.progress=false",
    "output.plots=false",
    "simulation.ray_num_cpus=2",
    "simulation.flower_client_cpus=1",
    # the ServerApp's thread waits this long for clients that never come; the interpreter waits
    # for that thread at exit (at the default 300 s the pytest process outlived the suite by minutes)
    "simulation.ray_start_timeout_s=5",
]


def test_arrays_round_trip_bit_exact_and_named_like_the_state_dict():
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    spec = ParamSpec.of(model)
    flat = flatten(model, spec)
    record = to_arrays(flat, spec)
    assert list(record.keys()) == list(model.state_dict().keys())
    assert torch.equal(from_arrays(record, spec), flat)


def test_arrays_of_another_model_are_refused_by_name():
    a = build_model("logreg", (60,), 10)
    b = build_model("2nn", (60,), 10)
    with pytest.raises(SpecMismatch, match="missing"):
        from_arrays(to_arrays(flatten(b), ParamSpec.of(b)), ParamSpec.of(a))


def test_engine_choice_and_ray_settings_come_from_the_config():
    cfg = load_config(
        None,
        [
            "simulation.engine='flower'",
            "simulation.flower_client_cpus=0.5",
            "simulation.flower_client_gpus=0.25",
            "simulation.ray_num_cpus=2",
        ],
    )
    bc = backend_config(cfg)
    assert bc["client_resources"] == {"num_cpus": 0.5, "num_gpus": 0.25}
    assert bc["init_args"] == {"address": "local", "num_cpus": 2, "include_dashboard": False}  # never a found one
    cluster = load_config(None, ["simulation.engine='flower'", "simulation.ray_address='ray://head:10001'"])
    assert backend_config(cluster)["init_args"] == {"address": "ray://head:10001"}


def test_a_client_larger_than_the_ray_runtime_is_a_config_error():
    cfg = load_config(
        None, ["simulation.engine='flower'", "simulation.flower_client_cpus=4", "simulation.ray_num_cpus=2"]
    )
    with pytest.raises(ConfigError, match="flower_client_cpus"):
        backend_config(cfg)
    with pytest.raises(ConfigError, match="simulation.engine"):
        load_config(None, ["simulation.engine='spark'"])


# --- one real Flower simulation, read by three tests ---------------------------------------

# A user's task file, outside the repository, named by a relative path as a user would type it:
# Dataset clients, FedBN buffers kept per node, FedPer's personal heads kept per node, a custom
# metric, federated evaluation on the clients' own test data only (no central test set), named ids.
USER_TASK = '''
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from shoal.task import SimulationData, Task


class Rows(Dataset):
    """Not a TensorDataset: shoal reads it through a DataLoader."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Sites(Task):
    exchange_buffers = False  # BatchNorm statistics stay on each site (FedBN)
    personal = ("head",)  # FedPer: each site keeps its own head

    def __init__(self, hidden=8):
        self.hidden = hidden

    def model(self):
        h = self.hidden
        return nn.Sequential(
            OrderedDict(body=nn.Linear(4, h), norm=nn.BatchNorm1d(h), act=nn.ReLU(), head=nn.Linear(h, 3))
        )

    def metrics(self, model, x, y):
        out = model(x)
        top2 = (out.topk(2, dim=1).indices == y[:, None]).any(1).float().mean()
        return {"loss": F.cross_entropy(out, y), "accuracy": (out.argmax(1) == y).float().mean(), "top2": top2}

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(4, 3, generator=g)

        def rows(n, site):  # each site sees two of the three classes
            x = torch.randn(n, 4, generator=g) + site
            y = (x @ w).argmax(1)
            return Rows(x, torch.where(y == site % 3, (y + 1) % 3, y))

        train = [rows(40, i) for i in range(num_clients)]
        test = [rows(20, i) if i % 2 == 0 else None for i in range(num_clients)]
        return SimulationData(train=train, client_test=test, client_ids=[f"site-{i}" for i in range(num_clients)])
'''

USER_SETTINGS = [
    "task.app='sites.py:Sites'",
    "task.args={hidden = 6}",
    "algorithm.name='fedper'",
    "algorithm.personal_eval_steps=2",
    "simulation.num_clients=4",
    "simulation.clients_per_round=2",
    "simulation.rounds=3",
    "simulation.eval_every=1",
    "simulation.device='cpu'",
    "simulation.progress=false",
    "output.plots=false",
    "output.tensorboard=true",
    "simulation.ray_num_cpus=2",
    "simulation.flower_client_cpus=1",
    "train.batch_size=10",
    "train.lr=0.1",
]


@pytest.fixture(scope="module")
def flower_and_inprocess(tmp_path_factory):
    """The user's task on both engines: the real Flower engine (Ray actors, each serving several
    nodes; each node's personal head and BatchNorm statistics in its context.state) and in-process."""
    from shoal.flower.engine import run_flower

    work = tmp_path_factory.mktemp("user")
    (work / "sites.py").write_text(USER_TASK)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as Ray gives each 1-CPU actor; more threads only contend on 2 cores
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.chdir(work)  # the task is named by a relative path
            flower_out = tmp_path_factory.mktemp("flower")
            flower = run_flower(
                load_config(None, [*USER_SETTINGS, "simulation.engine='flower'"]), flower_out, progress=False
            )
            cfg = load_config(None, USER_SETTINGS)
            sim = InProcessSimulation.from_config(cfg)
            initial = sim.evaluate()
            for _ in range(cfg.simulation.rounds):
                sim.run_round()
            inproc_out = tmp_path_factory.mktemp("inprocess")
            run_simulation(cfg, inproc_out, progress=False)
    finally:
        torch.set_num_threads(threads)
    return flower, flower_out, sim, initial, inproc_out, work


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_user_task_file_through_the_flower_engine_gives_the_inprocess_model_and_records(flower_and_inprocess):
    """Dataset clients, FedBN buffers and FedPer heads kept per node, a custom metric, federated
    and personalised evaluation on the clients' own test data, named client ids: the same model
    and records as in-process."""
    flower, flower_out, sim, _, inproc_out, work = flower_and_inprocess
    assert sim.spec.numel == flower.global_params.numel()  # BatchNorm statistics are not exchanged
    diff = (flower.global_params - sim.global_params.cpu()).abs().max().item()
    assert diff <= 1e-5, diff
    ours, theirs = read_jsonl(flower_out / "metrics.jsonl"), read_jsonl(inproc_out / "metrics.jsonl")
    assert [r["round"] for r in ours] == [1, 2, 3]
    for a, b in zip(ours, theirs, strict=True):
        assert set(a) == set(b)
        assert {"fed_loss", "fed_accuracy", "fed_top2", "fed_num_examples", "fed_personal_accuracy"} <= set(a)
        assert not any(k.startswith("test_") for k in a)  # the task has no central test set
        assert a["fed_num_examples"] == 40  # sites 0 and 2 have 20 test rows each
        for key in ("version", "num_results", "num_examples"):
            assert a[key] == b[key], key
        for key in ("fed_loss", "fed_accuracy", "fed_top2", "fed_personal_accuracy", "fed_personal_loss", "train_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), key
    summary = json.loads((flower_out / "summary.json").read_text())
    assert summary["engine"] == "flower" and summary["rounds"] == 3 and summary["num_clients"] == 4
    assert summary["task"] == f"{work / 'sites.py'}:Sites"
    assert summary["final_metrics"]["fed_top2"] == ours[-1]["fed_top2"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flower_and_inprocess_runs_write_the_same_numbers_as_tensorboard_events(flower_and_inprocess):
    from ..dashboard.events import assert_events_match_metrics

    _, flower_out, _, _, inproc_out, _ = flower_and_inprocess
    for out in (flower_out, inproc_out):
        assert_events_match_metrics(out, ("fed_accuracy", "fed_personal_accuracy", "train_loss"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shoal_strategy_in_a_flower_serverapp_improves_accuracy(flower_and_inprocess):
    """ServerApp(ShoalStrategy) against shoal ClientApps in Flower's simulation: the personal
    heads learned each site's classes (FedPer's shared model alone does much worse)."""
    flower, _, _, initial, _, _ = flower_and_inprocess
    final = flower.summary["final_metrics"]
    assert final["fed_personal_accuracy"] > initial["fed_personal_accuracy"] + 0.1, (final, initial)
    assert final["fed_personal_accuracy"] > final["fed_accuracy"]


def test_task_file_path_is_made_absolute_for_the_workers(tmp_path, monkeypatch):
    from shoal.assembly import with_absolute_task

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["task.app='sub/my_task.py:Sites'"])
    assert with_absolute_task(cfg).task.app == f"{tmp_path / 'sub' / 'my_task.py'}:Sites"
    assert cfg.task.app == "sub/my_task.py:Sites"  # the caller's config is left as it was
    module = load_config(None, ["task.app='my_pkg.tasks:Sites'"])
    assert with_absolute_task(module).task.app == "my_pkg.tasks:Sites"


def test_a_reply_with_a_list_for_its_example_count_is_dropped_not_a_crash():
    """A node's metric record may hold lists; where a number is needed that is a bad reply
    (dropped, the model unchanged), not a TypeError out of aggregate_train."""
    import time

    from flwr.app import Message, MessageType, Metadata, MetricRecord, RecordDict

    from shoal.aggregation import make_strategy
    from shoal.flower.apps import ARRAYS, METRICS, NUM_EXAMPLES, ShoalStrategy
    from shoal.rounds import SyncRounds

    model = build_model("logreg", (60,), 10)
    spec = ParamSpec.of(model)
    flat = flatten(model, spec)
    strategy = ShoalStrategy(make_strategy(load_config(None, []).strategy, spec.numel), spec, clients_per_round=1)
    strategy.rounds = SyncRounds(strategy.strategy, flat.clone(), 1)
    (task,) = strategy.rounds.start_round(["a"])
    strategy._tasks = {7: task}  # what configure_train records: node 7 was sent client a's task
    meta = Metadata(
        run_id=1,
        message_id="",
        src_node_id=7,
        dst_node_id=0,
        reply_to_message_id="m",
        group_id="1",
        created_at=time.time(),
        ttl=60.0,
        message_type=MessageType.TRAIN,
    )
    content = RecordDict({ARRAYS: to_arrays(flat, spec), METRICS: MetricRecord({NUM_EXAMPLES: [3, 4]})})
    assert strategy.aggregate_train(1, [Message(content, metadata=meta)]) == (None, None)
    assert strategy.rounds.version == 0 and torch.equal(strategy.rounds.global_params, flat)


class _SilentGrid:
    """A Flower grid whose nodes never come, or come and never answer (Ray placed no actor)."""

    def __init__(self, nodes: list[int]):
        self.nodes = nodes
        self.waited: list[float] = []

    def get_node_ids(self):
        return self.nodes

    def send_and_receive(self, messages, timeout=None):
        self.waited.append(timeout)
        return []


@pytest.mark.parametrize(("nodes", "match"), [([], "0 of 1 Flower nodes connected"), ([5, 6], "none of the 2")])
def test_the_simulation_engine_bounds_flowers_client_start(nodes, match, monkeypatch):
    """The simulation's ServerApp waits at most simulation.ray_start_timeout_s for its clients to
    connect and answer, then stops with one line (a deployed SuperLink, without the bound, waits)."""
    from shoal.aggregation import make_strategy
    from shoal.errors import EngineError
    from shoal.flower import apps
    from shoal.flower.apps import ShoalStrategy

    monkeypatch.setattr(apps, "Message", lambda *a, **k: object())  # outside a Flower run no Message is made
    spec = ParamSpec.of(build_model("logreg", (60,), 10))
    strategy = ShoalStrategy(make_strategy(load_config(None, []).strategy, spec.numel), spec, 1, start_timeout_s=0.3)
    grid = _SilentGrid(nodes)
    with pytest.raises(EngineError, match=match):
        strategy.configure_train(1, to_arrays(torch.zeros(spec.numel), spec), {}, grid)  # type: ignore[arg-type]
    assert grid.waited in ([], [0.3])


@pytest.mark.slow
def test_a_flower_runtime_that_starts_no_client_ends_in_one_clear_error(tmp_path):
    """One GPU per client on a machine without one: Flower's runtime stops ('ActorPool is empty')
    and the run ends in an EngineError naming the settings, not a generic RuntimeError."""
    from shoal.errors import EngineError
    from shoal.flower.engine import run_flower

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the client would start")
    cfg = load_config(None, [*SMALL, "simulation.engine='flower'", "simulation.flower_client_gpus=1"])
    with pytest.raises(EngineError, match="flower_client_gpus"):
        run_flower(cfg, tmp_path / "out", progress=False)
