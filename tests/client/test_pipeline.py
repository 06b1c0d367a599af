"""The client pipeline's own rules: a client's training depends on its assignment, not on what the
process drew before (dropout's RNG), and it leaves the process's RNG as it found it; state is kept
or held until the round settles; the node's task message is parsed once, malformed fields refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.client.algorithms import make_program
from shoal.client.http import NodeError
from shoal.client.pipeline import ClientPipeline
from shoal.client.task_message import TaskMessage
from shoal.client.training import LocalTrainer
from shoal.config import load_config
from shoal.rounds import Assignment
from shoal.task import Task

DATA = (torch.randn(32, 3, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 2)


class Dropped(Task):
    def model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))

    def loss(self, model, x, y):
        return F.cross_entropy(model(x), y)


def pipeline(name: str = "fedavg") -> ClientPipeline:
    task = Dropped()
    cfg = load_config(None, [f"algorithm.name='{name}'", "train.lr=0.1", "train.batch_size=8"])
    trainer = LocalTrainer(task.model(), cfg.train, "cpu", task=task)
    return ClientPipeline(make_program(cfg, task, trainer))


def test_dropout_draws_follow_the_assignment_seed_and_the_process_rng_is_left_alone():
    p = pipeline()
    start = p.trainer.flat.detach().clone()
    task = Assignment("c", 1, 0, seed=11)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = p.train_one(DATA, task, start, {}, {}).update.delta.clone()
    assert torch.equal(torch.get_rng_state(), before)  # nothing after the client sees its draws
    torch.manual_seed(99)  # another history of the process: the same update
    b = p.train_one(DATA, task, start, {}, {}).update.delta.clone()
    c = p.train_one(DATA, Assignment("c", 1, 0, seed=12), start, {}, {}).update.delta
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # another round's seed draws other masks (and batches)
    # a gossip peer's local step is seeded the same way
    torch.manual_seed(3)
    d = p.local_step(start, DATA, 11).delta.clone()
    torch.manual_seed(4)
    assert torch.equal(d, p.local_step(start, DATA, 11).delta)


def test_held_state_is_kept_only_for_the_clients_the_server_took():
    p = pipeline("scaffold")
    start = p.trainer.flat.detach().clone()
    broadcast = {"scaffold/c": torch.zeros_like(start)}
    tasks = [Assignment("a", 1, 0, 1), Assignment("b", 1, 0, 2)]
    out = list(p.run(tasks, start, broadcast, lambda j: DATA))
    assert [t.client_id for t, _ in out] == ["a", "b"]
    assert p.held_to_server("a") and "a" not in p.states  # held until the round settles
    kept = p.settle({"b"})
    assert len(kept) == 1 and "scaffold/dc" in kept[0]
    assert "b" in p.states and "a" not in p.states and not p.held_to_server("a")


def test_the_task_message_is_parsed_once_and_a_malformed_field_is_one_line():
    msg = TaskMessage.parse(
        {"status": "work", "round": 3, "version": 2, "seed": 9, "evaluate": True, "upload_chunk_bytes": 1 << 20}
    )
    assert (msg.round, msg.version, msg.seed, msg.evaluate, msg.upload_chunk_bytes) == (3, 2, 9, True, 1 << 20)
    assert not msg.secure and msg.privacy is None and msg.key == (3, 2)
    assert msg.assignment("n").seed == 9 and msg.assignment("n", seed=4).seed == 4
    done = TaskMessage.parse({"status": "done", "version": 7, "reason": "budget"})
    assert (done.status, done.version, done.reason) == ("done", 7, "budget")
    assert TaskMessage.parse({"status": "work", "round": 1, "version": 0, "seed": 0, "privacy": "local"}).privacy == {
        "mode": "local"
    }
    for bad in (
        {"status": "work", "round": "3", "version": 0, "seed": 0},
        {"status": "work", "round": 1, "version": True, "seed": 0},
        {"status": "work", "round": 1, "version": 0},
        {"status": "work", "round": 1, "version": 0, "seed": 0, "secure_aggregation": "yes"},
        ["not", "a", "task"],
    ):
        with pytest.raises(NodeError, match="server"):
            TaskMessage.parse(bad)
