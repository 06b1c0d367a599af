"""A large model's node keeps the global model on disk (client/disk_model.py): it trains the same
update as from the model in memory, bit for bit, with plain SGD (the lean loop: no bound gradient
buffer), momentum and weight decay; the file is checked as a body in memory is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shoal.client.disk_model import DiskModel
from shoal.client.training import LocalTrainer
from shoal.client.transfer import OnDisk
from shoal.config import TrainConfig
from shoal.errors import Malformed, NonFinite, SpecMismatch
from shoal.wire import model_parts


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _on_disk(flat: torch.Tensor, trainer: LocalTrainer, version: int = 4) -> OnDisk:
    head, data = model_parts(flat, trainer.spec, version)
    body = OnDisk(len(head) + len(data))
    body.write_at(0, memoryview(head))
    body.write_at(len(head), data)
    return body


@pytest.mark.parametrize("train", [{}, {"weight_decay": 0.01}, {"momentum": 0.9}])
def test_training_from_the_model_on_disk_gives_the_same_update(train):
    cfg = TrainConfig(lr=0.1, batch_size=8, epochs=2, **train)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 12, generator=g), torch.randint(0, 3, (40,), generator=g)
    memory, disk = LocalTrainer(_model(), cfg), LocalTrainer(_model(), cfg)
    start = memory.flat.clone() + 0.01
    expected = memory.train(start, x, y, seed=7)
    model = DiskModel(_on_disk(start, disk), disk.spec)
    assert model.version == 4 and torch.equal(model.load(), start)
    got = disk.train(model, x, y, seed=7)  # type: ignore[arg-type]  # the node passes it as the node does
    assert torch.equal(got.delta, expected.delta)
    assert got.metrics == expected.metrics
    lean = not train.get("momentum")
    assert (disk.grad.numel() == 0) == lean  # plain SGD let the bound gradient buffer go
    assert all(p.grad is None for p in disk.model.parameters()) == lean
    # the next training from memory binds the gradient buffer again and gives the same as before
    again = disk.train(start, x, y, seed=7)
    assert torch.equal(again.delta, expected.delta) and disk.grad.numel() == disk.flat.numel()


def test_a_model_file_is_checked_as_a_body_in_memory_is():
    trainer = LocalTrainer(_model(), TrainConfig(lr=0.1, batch_size=8))
    bad = trainer.flat.clone()
    bad[5] = float("nan")
    with pytest.raises(NonFinite):
        DiskModel(_on_disk(bad, trainer), trainer.spec)
    other = LocalTrainer(nn.Linear(3, 2), TrainConfig(lr=0.1, batch_size=8))
    with pytest.raises(SpecMismatch):
        DiskModel(_on_disk(other.flat, other), trainer.spec)
    body = _on_disk(trainer.flat, trainer)
    body.write_at(0, memoryview(b"\xff" * 8))  # a header length past the file's end
    with pytest.raises(Malformed):
        DiskModel(body, trainer.spec)
    with pytest.raises(ValueError, match="no objective"):
        LocalTrainer(_model(), TrainConfig(lr=0.1, batch_size=8, prox_mu=0.1)).train(
            DiskModel(_on_disk(trainer.flat, trainer), trainer.spec),  # type: ignore[arg-type]
            torch.randn(8, 12),
            torch.zeros(8, dtype=torch.long),
            seed=0,
        )


def test_upload_chunks_are_views_of_the_update_except_across_parts():
    from shoal.client.transfer import Body

    delta = torch.arange(100, dtype=torch.float32)
    body = Body([b"head", memoryview(delta.numpy()).cast("B")])
    whole = bytes(body.whole())
    for a, b in ((0, 10), (4, 104), (100, 404), (2, 6)):
        part = body.chunk(a, b)
        assert bytes(part) == whole[a:b]
        assert isinstance(part, memoryview) == (a >= 4), (a, b)  # the first crosses the header: a copy
