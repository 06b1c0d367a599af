"""Every model family trains in the simulator with every batching setting, sync and async: the
batched path takes what it can and falls back to one-by-one training with one log line, never
a traceback. Each cell is one short run of a small model on a few clients."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

import shoal
from shoal.config import load_config
from shoal.simulations.experiment import run_simulation
from shoal.simulations.inprocess import InProcessSimulation

CLASSES, N, CLIENTS = 3, 24, 4


class GRUNet(nn.Module):  # returns a tuple from its GRU; token ids in
    def __init__(self, lstm: bool = False):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.rnn = (nn.LSTM if lstm else nn.GRU)(8, 8, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        out, _ = self.rnn(self.emb(x))
        return self.head(out[:, -1])


class Encoder(nn.Module):  # a small transformer encoder (dropout layers with p = 0 inside)
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 8, mode="mean")
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(self.bag(x))


class DictNet(nn.Module):  # dict inputs (two feature groups)
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, CLASSES), nn.Linear(2, CLASSES)

    def forward(self, x):
        return self.a(x["num"]) + self.b(x["cat"])


class DictData(Dataset):
    def __init__(self, g: torch.Generator, n: int):
        self.num, self.cat = torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)
        self.y = (self.num[:, 0] > 0).long() + (self.cat[:, 0] > 0).long()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"num": self.num[i], "cat": self.cat[i]}, self.y[i]


def _cnn_bn():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, CLASSES))


FAMILIES = {
    "mlp": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, CLASSES)), "image"),
    "cnn_bn": (_cnn_bn, "image"),
    "gru": (GRUNet, "tokens"),
    "lstm": (lambda: GRUNet(lstm=True), "tokens"),
    "transformer": (Encoder, "tokens"),
    "embedding_bag": (Bag, "tokens"),
    "dict_inputs": (DictNet, "dict"),
}


class FamilyTask(shoal.Task):
    num_classes = CLASSES

    def __init__(self, family: str):
        self.build, self.kind = FAMILIES[family]

    def model(self):
        return self.build()

    def _draw(self, g: torch.Generator, n: int):
        if self.kind == "dict":
            return DictData(g, n)
        if self.kind == "image":
            x = torch.rand(n, 1, 8, 8, generator=g)
            return x, (x.mean((1, 2, 3)) * 3).long().clamp(max=CLASSES - 1)
        x = torch.randint(0, 10, (n, 6), generator=g)
        return x, x[:, 0] % CLASSES

    def simulation_data(self, num_clients, seed):
        g = torch.Generator().manual_seed(seed)
        return shoal.SimulationData(train=[self._draw(g, N) for _ in range(num_clients)], test=self._draw(g, 30))


def _config(batch: str, mode: str):
    return load_config(
        None,
        [
            f"simulation.num_clients={CLIENTS}",
            "simulation.clients_per_round=4",
            "simulation.rounds=2",
            "simulation.progress=false",
            f"simulation.batch_clients={batch}",
            f"simulation.mode='{mode}'",
            "asynchronous.concurrency=4",
            "asynchronous.buffer_size=2",
            "train.batch_size=8",
            "output.plots=false",
        ],
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("batch,mode", [("'auto'", "sync"), ("8", "sync"), ("'auto'", "async")])
def test_every_family_trains_with_every_batching_setting(family, batch, mode, tmp_path, caplog):
    task = FamilyTask(family)
    cfg = _config(batch, mode)
    with caplog.at_level(logging.INFO):
        sim = InProcessSimulation.from_config(cfg, task=task)
        summary = run_simulation(cfg, tmp_path, progress=False, sim=sim)
    assert summary["rounds"] >= 1
    acc = summary["final_test_accuracy"]
    assert 0.0 <= acc <= 1.0
    one_by_one = [r.getMessage() for r in caplog.records if "one by one" in r.getMessage()]
    if sim.batched is None and batch != "1":
        assert len(one_by_one) == 1, one_by_one  # the fallback says why, once
    if family in ("gru", "lstm", "transformer") and batch != "1":
        assert sim.batched is not None  # recurrent and attention layers run as batchable stand-ins
    if family == "mlp" and batch != "1":
        assert sim.batched is not None  # what can be batched still is
