"""A deployed node takes the parts shoal.assembly builds (role "node"); ``Node.from_config``
builds them from the node's config, data and device, as ``shoal client`` and ``shoal node`` do."""

import dataclasses

import pytest
import torch

from shoal import assembly
from shoal.assembly import NodeParts
from shoal.client.node import Node
from shoal.client.state import DiskClientState, MemoryClientState
from shoal.config import load_config
from shoal.privacy_state import NodePrivacy
from shoal.shards import Shard
from shoal.task import LocalData, Task, TaskError

SETS = ['model.name="logreg"', "train.batch_size=8", "simulation.seed=3"]


def local(n: int = 24, test: int = 0) -> LocalData:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n + test, 60, generator=g), torch.randint(0, 10, (n + test,), generator=g)
    return LocalData(train=(x[:n], y[:n]), test=(x[n:], y[n:]))


def builtin(cfg):
    task = assembly.task_from_config(cfg)
    task.input_shape, task.num_classes = (60,), 10  # what a shard of `shoal data split` tells the task
    return task


def test_node_parts_hold_the_checked_data_and_start_from_the_servers_model():
    cfg = load_config(None, SETS)
    task = builtin(cfg)
    parts = assembly.build(cfg, task, "node", data=local(test=0), device="cpu", name="n3")
    assert isinstance(parts, NodeParts) and parts.name == "n3" and parts.task is task
    assert parts.test is None  # an empty test set is no test set
    assert isinstance(parts.train, tuple) and parts.train[0].shape == (24, 60)
    assert parts.privacy is None and isinstance(parts.states, MemoryClientState)
    server = assembly.build(cfg, task, "server")
    assert parts.spec.hash == server.spec.hash
    assert torch.equal(parts.trainer.flat.detach(), server.rounds.global_params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.name = "other"  # type: ignore[misc]
    with pytest.raises(TaskError, match="no examples"):
        assembly.build(cfg, task, "node", data=LocalData(train=(torch.zeros(0, 60), torch.zeros(0).long())))


def test_privacy_and_state_folder_are_parts_of_the_node(tmp_path):
    cfg = load_config(
        None,
        [*SETS, 'privacy.mode="local"', "privacy.noise_multiplier=1.0", "privacy.delta=1e-3"],
    )
    parts = assembly.build(cfg, builtin(cfg), "node", data=local(), name="n0", privacy_ledger=tmp_path / "l.json")
    assert isinstance(parts.privacy, NodePrivacy) and parts.privacy.ledger == tmp_path / "l.json"
    assert parts.privacy.name == "n0"
    keeps = load_config(None, [*SETS, "train.momentum=0.9", "algorithm.keep_optimizer_state=true"])
    stateful = assembly.build(keeps, builtin(keeps), "node", data=local(), state_dir=tmp_path / "state")
    assert isinstance(stateful.states, DiskClientState) and stateful.states.folder == tmp_path / "state"
    plain = assembly.build(load_config(None, SETS), builtin(cfg), "node", data=local(), state_dir=tmp_path / "s2")
    assert isinstance(plain.states, MemoryClientState)  # FedAvg keeps nothing: no folder is made
    assert not (tmp_path / "s2").exists()


def test_a_shard_names_the_node_and_is_data_of_the_builtin_task_only():
    cfg = load_config(None, SETS)
    shard = Shard("client-00007", torch.randn(16, 60), torch.randint(0, 10, (16,)), 10)
    parts = assembly.build(cfg, None, "node", data=shard)
    assert parts.name == "client-00007" and parts.task.input_shape == (60,) and parts.test is None
    assert assembly.build(cfg, parts.task, "node", data=shard, name="mine").name == "mine"
    with_test = dataclasses.replace(shard, test_x=torch.randn(5, 60), test_y=torch.randint(0, 10, (5,)))
    test = assembly.build(cfg, None, "node", data=with_test).test  # the shard's own test data is the node's
    assert isinstance(test, tuple) and torch.equal(test[0], with_test.test_x) and torch.equal(test[1], with_test.test_y)

    class UserTask(Task):
        def model(self):
            return torch.nn.Linear(60, 10)

    with pytest.raises(TaskError, match="shard file is data of the built-in task"):
        assembly.build(cfg, UserTask(), "node", data=shard)


def test_the_node_takes_parts_and_refuses_a_config():
    cfg = load_config(None, SETS)
    with pytest.raises(TypeError, match="from_config"):
        Node(cfg, "http://127.0.0.1:9", "t")  # type: ignore[arg-type]
    task = builtin(cfg)
    node = Node.from_config("http://127.0.0.1:9", "t", local(test=8), cfg, torch.device("cpu"), name="n1", task=task)
    assert node.name == "n1" and node.task is task and node.test is not None and node.poll_s == 20.0
    # a part swapped before construction is the one the node uses
    parts = assembly.build(cfg, task, "node", data=local(), name="n2")
    store = MemoryClientState()
    node = Node(dataclasses.replace(parts, states=store), "http://127.0.0.1:9,http://127.0.0.1:10", "t", poll_s=1.0)
    assert node.states is store and node.trainer is parts.trainer and node.program is parts.program
    assert node.urls == ["http://127.0.0.1:9", "http://127.0.0.1:10"] and node.poll_s == 1.0
