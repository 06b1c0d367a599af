"""The Ray engine on a real two-node Ray cluster started here: the same config and seed give
the in-process engine's model (1e-5) with DP, secure aggregation, compression, attacks,
robust rules, async rounds, FedBN buffers and client state (SCAFFOLD, Ditto), with and
without partial sums, and when a worker is killed in the middle of a round; gossip (every
algorithm, secure groups, churn, attacks, DP-SGD with per-peer accounting) gives the
in-process peers' models.

Slow by nature (marked): a Ray cluster and its workers take ~25 s to start on two cores,
so the module starts ONE cluster (two 1-CPU nodes, one worker each) and every test shares
its worker pool; each run is a few rounds of logistic regression on 8 synthetic clients.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from shoal.config import load_config
from shoal.errors import ConfigError
from shoal.metrics import read_jsonl
from shoal.simulations.async_engine import AsyncEngine
from shoal.simulations.client_data import PopulationShards
from shoal.simulations.experiment import run_simulation
from shoal.simulations.gossip import GossipSimulation
from shoal.simulations.inprocess import InProcessSimulation, PlainRound
from shoal.simulations.sync_engine import VirtualSyncEngine
from shoal.tasks import BuiltinTask

from ..dashboard.events import assert_events_match_metrics

ray = pytest.importorskip("ray")

from shoal.simulations.ray_engine import (  # noqa: E402 - after the skip when Ray is missing
    RayClients,
    RayPeers,
    SummedRound,
    WorkerPool,
    ray_peers,
    ray_simulation,
    run_ray_simulation,
    split_contiguous,
    worker_count,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (make test: -n 2)

SMALL = [
    "simulation.num_clients=8",
    "simulation.clients_per_round=4",
    "simulation.rounds=3",
    "simulation.device='cpu'",
    "simulation.progress=false",
    "output.plots=false",
    "train.lr=0.05",
]


def config(*extra: str, engine: str = "inprocess"):
    return load_config(
        None,
        [
            *SMALL,
            f"simulation.engine='{engine}'",
            "simulation.ray_workers_per_node=1",
            "privacy.reproducible=true",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def pool():
    """Two Ray nodes (1 CPU each) on this machine and one worker per node, for the whole module."""
    from ray.cluster_utils import Cluster

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the driver shares two cores with both workers
    node = {"num_cpus": 1, "object_store_memory": 80 << 20}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    ray.init(address=cluster.address)
    workers = WorkerPool(config(engine="ray"))
    try:
        yield workers
    finally:
        workers.close()
        ray.shutdown()
        cluster.shutdown()
        torch.set_num_threads(threads)


def rounds(sim: InProcessSimulation) -> torch.Tensor:
    for _ in range(sim.cfg.simulation.rounds):
        sim.run_round()
    return sim.global_params.detach().cpu()


def same_model(pool, *extra: str) -> tuple[InProcessSimulation, InProcessSimulation]:
    """Both engines on the same config; asserts the global models agree to 1e-5."""
    here = InProcessSimulation.from_config(config(*extra))
    there = ray_simulation(config(*extra, engine="ray"), pool)
    start = here.global_params.clone()
    a, b = rounds(here), rounds(there)
    diff = (a - b).abs().max().item()
    assert diff <= 1e-5, diff
    assert (a - start).abs().max().item() > 1e-3  # the model did train
    return here, there


@pytest.mark.timeout(120)
def test_workers_sit_on_both_nodes_and_partial_sums_match_per_client_updates(pool):
    here, summed = same_model(pool)
    assert isinstance(summed.runner, SummedRound)  # plain FedAvg: workers return sums
    assert summed.pool_figures()["ray_nodes"] == 2
    per_client = ray_simulation(config("simulation.ray_partial_sums=false", engine="ray"), pool)
    assert isinstance(per_client.runner, PlainRound)
    assert (rounds(per_client) - here.global_params).abs().max().item() <= 1e-5
    # counters of the summed path are those of the per-client one
    assert summed.wire.total_up == per_client.wire.total_up == here.wire.total_up > 0
    assert summed.participants == here.participants


@pytest.mark.timeout(120)
def test_records_and_summary_of_a_ray_run_match_in_process(pool, tmp_path):
    tb = "output.tensorboard=true"
    ours = run_ray_simulation(config("strategy.name='fedadam'", tb, engine="ray"), tmp_path / "ray", pool=pool)
    run_simulation(config("strategy.name='fedadam'"), tmp_path / "inprocess")
    assert ours["engine"] == "ray" and ours["ray_workers"] == 2
    a, b = read_jsonl(tmp_path / "ray" / "metrics.jsonl"), read_jsonl(tmp_path / "inprocess" / "metrics.jsonl")
    assert [r["round"] for r in a] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        for key in ("num_results", "num_examples", "bytes_up", "bytes_down"):
            assert x[key] == y[key], key
        for key in ("test_accuracy", "test_loss", "train_loss"):
            assert math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-6), key
    assert json.loads((tmp_path / "ray" / "summary.json").read_text())["ray_nodes"] == 2
    assert_events_match_metrics(tmp_path / "ray", ("test_accuracy", "bytes_up"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("features", "runner"),
    [
        pytest.param(["privacy.mode='central'", "privacy.noise_multiplier=0.5"], "PlainRound", id="central-dp"),
        pytest.param(  # DP-SGD acts inside local training: the workers may still sum
            ["privacy.mode='local'", "privacy.noise_multiplier=0.5", "train.batch_size=16"], "SummedRound", id="dp-sgd"
        ),
        pytest.param(
            ["secure_aggregation.enabled=true", "secure_aggregation.clip=4.0"]
            + ["privacy.mode='distributed'", "privacy.noise_multiplier=0.5"]
            # N = 8, K = 4 (an aborted Poisson round is released as an empty one, in both engines)
            + ["simulation.rounds=1"],
            "SecureAggregationRounds",
            id="secagg-distributed-dp",
        ),
        pytest.param(
            ["compression.encoding='topk'", "compression.topk_fraction=0.2", "attack.kind='label_flip'"]
            + ["attack.fraction=0.25", "robust.rule='median'"],
            "PlainRound",
            id="topk-labelflip-median",
        ),
        pytest.param(
            ["compression.encoding='q8'", "attack.kind='sign_flip'", "attack.fraction=0.25"]
            + ["robust.rule='trimmed_mean'", "robust.trim_beta=0.25"],
            "PlainRound",
            id="q8-signflip-trimmed",
        ),
    ],
)
def test_features_give_the_in_process_model(pool, features, runner):
    here, there = same_model(pool, *features)
    assert type(there.runner).__name__ == runner
    if here.privacy is not None:
        assert there.privacy is not None and math.isclose(here.privacy.epsilon, there.privacy.epsilon)


@pytest.mark.timeout(120)
def test_sync_rounds_on_the_virtual_clock_with_dropouts_and_late_folds_give_the_in_process_model(pool):
    extra = [
        "heterogeneity.enabled=true",
        "heterogeneity.speed_sigma=1.0",
        "heterogeneity.mean_on_s=1.0",
        "heterogeneity.mean_off_s=0.5",
        "asynchronous.over_selection=0.5",
        "asynchronous.deadline_s=0.8",
        "asynchronous.late='fold'",
        "compression.encoding='topk'",
        "compression.topk_fraction=0.2",
    ]
    here = VirtualSyncEngine(config(*extra))
    there = VirtualSyncEngine(config(*extra, engine="ray"), ray_simulation(config(*extra, engine="ray"), pool))
    a, b = list(here.run()), list(there.run())
    assert [r["virtual_time_s"] for r in a] == [r["virtual_time_s"] for r in b]
    assert here.totals()["dropouts"] == there.totals()["dropouts"] > 0  # dropped clients' uploads resolve too
    assert here.totals()["staleness"] == there.totals()["staleness"]
    assert "1" in here.totals()["staleness"]["staleness_hist"]  # a late result was folded
    assert here.totals()["bytes_up_total"] == there.totals()["bytes_up_total"]
    assert (here.rounds.global_params - there.rounds.global_params).abs().max().item() <= 1e-5


@pytest.mark.timeout(120)
def test_fedbuff_on_the_virtual_clock_gives_the_in_process_model(pool):
    extra = [
        "simulation.mode='async'",
        "simulation.rounds=4",
        "asynchronous.buffer_size=3",
        "asynchronous.concurrency=4",
        "heterogeneity.speed_sigma=1.0",
        "heterogeneity.network_delay_s=0.5",
        "attack.kind='scale'",
        "attack.fraction=0.25",
        "robust.norm_bound=1.0",
    ]
    here = AsyncEngine(config(*extra))
    there = AsyncEngine(config(*extra, engine="ray"), ray_simulation(config(*extra, engine="ray"), pool))
    a, b = list(here.run()), list(there.run())
    assert [r["virtual_time_s"] for r in a] == [r["virtual_time_s"] for r in b]
    assert [r["accepted"] for r in a] == [r["accepted"] for r in b]
    assert there.rounds.version == 4
    assert (here.rounds.global_params - there.rounds.global_params).abs().max().item() <= 1e-5


FEDBN_TASK = '''
import torch
from torch import nn
from shoal.task import SimulationData, Task


class Clinics(Task):
    """Two features shifted per client; BatchNorm statistics stay on each client (FedBN); dropout
    draws from torch's global RNG, seeded per client and round by the client pipeline."""

    exchange_buffers = False

    def model(self):
        return nn.Sequential(nn.Linear(2, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 2))

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        train = []
        for i in range(num_clients):
            x = torch.randn(24 + 4 * i, 2, generator=g) * (1 + i) + i
            train.append((x, (x[:, 0] > x[:, 1]).long()))
        return SimulationData(train=train, test=(torch.randn(50, 2, generator=g), torch.zeros(50).long()))
'''


@pytest.mark.timeout(120)
def test_fedbn_buffers_stay_with_each_client_and_dropout_draws_as_in_process(pool, tmp_path):
    path = tmp_path / "clinics.py"
    path.write_text(FEDBN_TASK)
    here, there = same_model(pool, f"task.app='{path}:Clinics'", "simulation.rounds=4", "train.batch_size=8")
    assert set(here.local_states) == set(there.local_states) and here.local_states
    for cid, state in here.local_states.items():
        for name, t in state.items():
            assert torch.allclose(t, there.local_states[cid][name], atol=1e-5), (cid, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("name", "key", "extra"),
    [
        ("scaffold", "scaffold/c", ()),
        ("scaffold", "scaffold/c", ("secure_aggregation.enabled=true", "secure_aggregation.bits=28")),
        ("ditto", "ditto/v", ()),
    ],
)
def test_client_state_follows_each_client_to_its_worker(pool, name, key, extra):
    """Client state (SCAFFOLD's control variates, Ditto's personal models) lives in the driver's
    store, travels with each call and comes back: the model, SCAFFOLD's server c and every
    client's state are the in-process engine's, also when SCAFFOLD's control-variate deltas go
    through the masked sum of secure aggregation."""
    here, there = same_model(pool, f"algorithm.name='{name}'", "simulation.rounds=4", *extra)
    assert (there.secure_aggregation is not None) == bool(extra)
    if name == "scaffold":
        assert here.control is not None and there.control is not None
        assert torch.allclose(here.control.c, there.control.c, atol=1e-5) and here.control.c.abs().max() > 0
    assert len(here.states) == len(there.states) > 0
    for cid in here.participants:
        assert torch.allclose(here.states.get(cid)[key], there.states.get(cid)[key], atol=1e-5)


@pytest.mark.timeout(180)
def test_a_worker_killed_mid_round_does_not_change_the_result(pool):
    killed: list[int] = []

    def kill_first_worker(p: WorkerPool, method: str) -> None:
        if method.startswith("train") and len(killed) < 3:  # in a round; once per engine path
            ray.kill(p.actors[0], no_restart=False)  # its process dies; Ray restarts it
            killed.append(1)

    pool.on_submitted = kill_first_worker
    one = "simulation.rounds=1"  # each restart costs a worker process; one round shows the result kept
    try:
        here, there = same_model(pool, "simulation.ray_partial_sums=false", one)
        assert isinstance(there.runner, PlainRound)
        again = ray_simulation(config(one, engine="ray"), pool)
        assert (rounds(again) - here.global_params).abs().max().item() <= 1e-5  # the summed path too
        peers = GossipSimulation.from_config(config(*GOSSIP, engine="ray"), peers=ray_peers(pool))  # and gossip's
        alone = GossipSimulation.from_config(config(*GOSSIP))
        start = alone.models.clone()
        peers.run_round()
        alone.run_round()
        assert (peers.models - alone.models).abs().max().item() <= 1e-5
        assert (alone.models - start).abs().max().item() > 1e-3
    finally:
        pool.on_submitted = None
    assert len(killed) == 3 and pool.resubmitted >= 3


def test_a_task_object_that_workers_cannot_rebuild_is_a_config_error(pool):
    class Mine(BuiltinTask):  # an object made here: a worker has no way to make the same
        pass

    cfg = config(engine="ray")
    task = Mine("logreg", cfg.data, cfg.simulation.num_clients, cfg.simulation.seed)
    with pytest.raises(ConfigError, match=r"task\.app"):
        InProcessSimulation.from_config(cfg, task=task, clients=lambda sim: RayClients(sim, pool))


def test_split_and_worker_count_rules():
    assert split_contiguous([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert split_contiguous([30, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert split_contiguous([5], 4) == [range(0, 1)]
    assert [len(r) for r in split_contiguous([1] * 7, 3)] == [3, 2, 2]
    cfg = load_config(None, ["simulation.engine='ray'", "simulation.ray_cpus_per_worker=2"])
    assert worker_count(cfg, cpus=8, gpus=0, nodes=2) == 4
    per_node = load_config(None, ["simulation.engine='ray'", "simulation.ray_workers_per_node=3"])
    assert worker_count(per_node, cpus=8, gpus=0, nodes=2) == 6
    gpu = load_config(None, ["simulation.engine='ray'", "simulation.ray_gpus_per_worker=0.25"])
    assert worker_count(gpu, cpus=16, gpus=1, nodes=1) == 4  # four workers share the GPU
    with pytest.raises(ConfigError, match="ray_workers"):
        worker_count(load_config(None, ["simulation.ray_workers=5"]), cpus=4, gpus=0, nodes=1)


@pytest.mark.timeout(120)
def test_a_lazily_loaded_population_trains_on_the_workers_as_in_process(pool):
    """A task with population(): 5,000 clients, 8 a round; workers load the clients they train."""
    population = [
        "task.app='shoal.tasks:SyntheticPopulationTask'",
        "simulation.num_clients=5000",
        "simulation.clients_per_round=8",
    ]
    here, there = same_model(pool, *population)
    assert there.participants == here.participants and len(here.participants) <= 24
    assert isinstance(there.shards, PopulationShards)  # the driver holds ids and sizes, not the clients' data


GOSSIP = ["simulation.mode='gossip'", "gossip.view_size=4", "gossip.shuffle_length=2", "train.batch_size=20"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "features",
    [
        pytest.param(["gossip.churn=0.25", "gossip.churn_period=2", "gossip.loss=0.1"], id="push-pull-churn"),
        pytest.param(  # forged models through the q8 wire, bounded merges
            ["compression.encoding='q8'", "compression.zstd=true", "attack.kind='sign_flip'", "attack.fraction=0.25"]
            + ["robust.norm_bound=1.0"],
            id="push-pull-q8-sign-flip",
        ),
        pytest.param(  # the workers flip the attackers' labels, chosen among peer names
            ["gossip.algorithm='dpsgd'", "gossip.topology='regular'", "attack.kind='label_flip'"]
            + ["attack.fraction=0.25", "robust.rule='median'"],
            id="dpsgd-label-flip-median",
        ),
        pytest.param(
            ["gossip.algorithm='group_average'", "gossip.group_size=2", "gossip.churn=0.25", "gossip.churn_period=2"],
            id="group-average-churn",
        ),
        pytest.param(  # every peer trains with DP-SGD on its worker; epsilon is counted on the driver
            ["privacy.mode='local'", "privacy.noise_multiplier=1.0", "gossip.churn=0.25", "gossip.churn_period=2"],
            id="push-pull-dp-sgd-churn",
        ),
        pytest.param(  # secure aggregation within each group, members dropping out mid-protocol
            ["gossip.algorithm='secure_groups'", "gossip.group_size=4", "secure_aggregation.dropout_masked=0.2"],
            id="secure-groups-dropouts",
        ),
    ],
)
def test_gossip_peers_train_on_the_workers_and_give_the_in_process_models(pool, features):
    here = GossipSimulation.from_config(config(*GOSSIP, *features))
    there = GossipSimulation.from_config(config(*GOSSIP, *features, engine="ray"), peers=ray_peers(pool))
    assert isinstance(there.peers, RayPeers)
    assert (here.attackers == there.attackers).all()
    start = here.models.clone()
    for _ in range(3):
        here.run_round()
        there.run_round()
    diff = (here.models - there.models).abs().max().item()
    assert diff <= 1e-5, diff
    assert (here.models - start).abs().max().item() > 1e-3  # the peers did train
    a, b = here.evaluate(), there.evaluate()
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, str):
            assert value == b[key], key
        else:
            assert math.isclose(value, b[key], rel_tol=1e-5, abs_tol=1e-6), key
    if "privacy.mode='local'" in features:  # the peers that trained on workers are the ones charged
        assert there.privacy is not None and here.privacy is not None
        assert there.privacy.accountant.participations == here.privacy.accountant.participations
        assert 0 < b["epsilon"] and len(set(here.privacy.accountant.participations.values())) > 1  # churn


@pytest.mark.timeout(120)
def test_a_gossip_run_on_ray_writes_the_in_process_records(pool, tmp_path):
    extra = [*GOSSIP, "gossip.algorithm='dpsgd'", "gossip.topology='ring'"]
    ours = run_ray_simulation(config(*extra, engine="ray"), tmp_path / "ray", pool=pool)
    run_simulation(config(*extra), tmp_path / "inprocess")
    assert ours["engine"] == "ray" and ours["ray_nodes"] == 2
    a, b = read_jsonl(tmp_path / "ray" / "metrics.jsonl"), read_jsonl(tmp_path / "inprocess" / "metrics.jsonl")
    assert [r["round"] for r in a] == [1, 2, 3]
    for x, y in zip(a, b, strict=True):
        for key in ("test_accuracy", "average_model_accuracy", "consensus_distance", "bytes_sent_per_peer"):
            assert math.isclose(x[key], y[key], rel_tol=1e-5, abs_tol=1e-6), key


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(("hierarchy.edge_rounds=2", "hierarchy.edge_failure=0.3"), id="hierfavg-lost-edges"),
        pytest.param(  # one protocol over the whole cohort, edges add masked vectors, one edge lost
            ("secure_aggregation.enabled=true", "secure_aggregation.clip=4.0", "hierarchy.edge_failure=0.3"),
            id="secure",
        ),
    ],
)
def test_virtual_edges_on_the_workers_give_the_in_process_model(pool, extra):
    """simulations/hierarchy.py on Ray: each edge's clients train on the workers, HierFAVG's edge
    rounds, lost edges and secure aggregation through the edges included; the same model and the
    same bytes on every link."""
    from shoal.simulations.hierarchy import HierarchicalRound

    here, there = same_model(pool, "hierarchy.edges=2", *extra)
    assert isinstance(there.runner, HierarchicalRound) and isinstance(here.runner, HierarchicalRound)
    assert there.runner.links.total == here.runner.links.total
    assert there.runner.lost_total == here.runner.lost_total


@pytest.mark.timeout(300)
def test_the_federated_lora_example_gives_the_in_process_model(pool):
    """The federated LoRA example (tests/hf/tiny.py) on the module's workers: a Hugging Face model
    with its base frozen, only the adapter trained and exchanged, the in-process model."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from ..hf.tiny import ADAPTER_NUMEL, CORPUS, OVERRIDES

    if not CORPUS.is_file():
        pytest.skip(f"{CORPUS} is not there")
    lora = [
        *OVERRIDES,
        *("simulation.num_clients=3", "simulation.clients_per_round=3", "simulation.rounds=2"),
        *("simulation.device='cpu'", "simulation.progress=false", "output.plots=false"),
        *("train.batch_size=16", "train.lr=0.01", "simulation.ray_workers_per_node=1"),
    ]
    here = InProcessSimulation.from_config(load_config(None, lora))
    there = ray_simulation(load_config(None, [*lora, "simulation.engine='ray'"]), pool)
    start = here.global_params.clone()
    a, b = rounds(here), rounds(there)
    assert a.numel() == ADAPTER_NUMEL
    assert (a - start).abs().max() > 1e-4  # it trained
    assert (a - b).abs().max().item() <= 1e-5


def test_workers_that_ray_cannot_place_stop_the_run_in_one_line(pool):
    """The module's pool holds both CPUs of the cluster: a second pool's workers are never placed.
    The run stops after simulation.ray_start_timeout_s with what the cluster has free, instead of
    waiting for ever."""
    from shoal.errors import EngineError

    cfg = config("simulation.ray_start_timeout_s=2", engine="ray")
    second = WorkerPool(cfg)
    try:
        with pytest.raises(EngineError, match=r"2 of 2 Ray workers did not start and load the task within .*0 CPU"):
            ray_simulation(cfg, second)
    finally:
        second.close()
