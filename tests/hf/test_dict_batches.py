"""Dict batches as a first-class batch (no Hugging Face needed): a Dataset of dict examples
trains, evaluates, checks and audits exactly as the same data given as (x, y) tensors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig
from shoal.simulations.mia import per_sample_loss
from shoal.task import DictDataset, Inputs, Task, TaskError, check_data, check_loss, make_model, split_batch


class Tagger(nn.Module):
    """Token tagging with a Hugging Face-style interface: keyword inputs, an output object that
    carries its own loss when given labels (mean over positions whose label is not -100)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.embed(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1), ignore_index=-100)
        return SimpleNamespace(logits=logits, loss=loss)


class DictTask(Task):
    """Default loss: the model's own; metrics: token accuracy."""

    def model(self):
        return Tagger()

    def metrics(self, model, x, y):
        out = model(**x)
        return {"loss": out.loss, "accuracy": (out.logits.argmax(-1) == y).float().mean()}


class PairTask(DictTask):
    """The same model and loss on (x, y) tensors."""

    def loss(self, model, x, y):
        return model(input_ids=x, labels=y).loss

    def metrics(self, model, x, y):
        return super().metrics(model, {"input_ids": x, "labels": y}, y)


def data(n: int = 40):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 11, (n, 6), generator=g)
    labels = ids % 5
    return ids, labels


def trainer(task: Task) -> LocalTrainer:
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.3)
    return LocalTrainer(make_model(task, seed=1), cfg, task=task)


def test_split_batch_takes_pairs_and_dicts_and_names_what_is_missing():
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert split_batch((x, y)) == (x, y) and split_batch([x, y])[1] is y
    d = {"input_ids": x, "labels": y}
    xs, ys = split_batch(d)
    assert xs == d and isinstance(xs, Inputs) and ys is y  # keyword inputs: model(**x)
    with pytest.raises(ValueError, match=r"needs a 'labels' tensor \(its keys: input_ids\)"):
        split_batch({"input_ids": x})
    with pytest.raises(ValueError, match="expected an"):
        split_batch((x, y, y))


def test_dict_dataset_items_collate_back_to_a_dict_of_tensors():
    ids, labels = data(5)
    ds = DictDataset(input_ids=ids, labels=labels)
    assert len(ds) == 5 and torch.equal(ds[2]["input_ids"], ids[2])
    batch = torch.utils.data.default_collate([ds[i] for i in range(3)])
    assert torch.equal(batch["labels"], labels[:3])
    with pytest.raises(ValueError, match="differ in length"):
        DictDataset(input_ids=ids, labels=labels[:3])


def test_a_dict_dataset_gives_the_update_and_metrics_of_the_same_tensors():
    """The DataLoader path with dict batches = the tensor fast path: same permutation, same steps."""
    ids, labels = data()
    a, b = trainer(DictTask()), trainer(PairTask())
    start = a.flat.detach().clone()
    assert torch.equal(start, b.flat)
    ua = a.fit(start, DictDataset(input_ids=ids, labels=labels), seed=3)
    ub = b.fit(start, (ids, labels), seed=3)
    assert ua.delta.abs().max() > 1e-3  # it trained
    torch.testing.assert_close(ua.delta, ub.delta, rtol=0, atol=1e-6)
    assert ua.metrics["local_steps"] == ub.metrics["local_steps"] == 10
    ma = a.evaluate_data(start + ua.delta, DictDataset(input_ids=ids, labels=labels), batch_size=16)
    mb = b.evaluate_data(start + ub.delta, (ids, labels), batch_size=16)
    assert ma["num_examples"] == 40
    for k in ("loss", "accuracy"):
        assert ma[k] == pytest.approx(mb[k], abs=1e-6)


def test_checks_and_the_membership_audit_take_dict_data():
    ids, labels = data(10)
    task = DictTask()
    ds = check_data(task, DictDataset(input_ids=ids, labels=labels), "train data")
    t = trainer(task)
    check_loss(task, t.model, ds, torch.device("cpu"))  # the model's own loss: a scalar with a gradient
    losses = per_sample_loss(t, t.flat.detach().clone(), ds, np.arange(4))
    with torch.no_grad():
        direct = [t.model(input_ids=ids[i : i + 1], labels=labels[i : i + 1]).loss.item() for i in range(4)]
    np.testing.assert_allclose(losses, direct, rtol=1e-6)
    no_labels = DictDataset(input_ids=ids)
    with pytest.raises(TaskError, match="needs a 'labels' tensor"):
        check_loss(task, t.model, no_labels, torch.device("cpu"))


class DictInput(nn.Module):
    """A model whose one input is a dict (an (x, y) pair's x): called as model(x), never model(**x)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 3), nn.Linear(4, 3)

    def forward(self, x):
        return self.a(x["a"]) + self.b(x["b"])


def test_a_dict_x_of_an_x_y_pair_is_still_one_argument():
    class PairOfDict(Task):
        def model(self):
            return DictInput()

    g = torch.Generator().manual_seed(0)
    items = [({"a": torch.randn(2, generator=g), "b": torch.randn(4, generator=g)}, i % 3) for i in range(12)]
    task = PairOfDict()
    t = trainer(task)
    check_loss(task, t.model, items, torch.device("cpu"))  # type: ignore[arg-type]
    update = t.fit(t.flat.detach().clone(), items, seed=0)  # type: ignore[arg-type]
    assert update.delta.abs().max() > 0 and update.metrics["local_steps"] == 4
