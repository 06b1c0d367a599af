import copy

import pytest
import torch
import torch.nn.functional as F

from shoal.client.device import select_device
from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig
from shoal.errors import ConfigError
from shoal.models import build_model
from shoal.params import flatten


def reference_sgd(model, x, y, cfg: TrainConfig, seed: int):
    """Textbook torch loop: torch.optim.SGD plus an explicit FedProx loss term."""
    model = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    n, bs = len(y), cfg.batch(len(y))
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, bs):
            idx = perm[s : s + bs]
            opt.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            if cfg.prox_mu:
                loss = loss + cfg.prox_mu / 2 * sum(((p - p0) ** 2).sum() for p, p0 in zip(model.parameters(), start))
            loss.backward()
            opt.step()
    return flatten(model)


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(epochs=2, batch_size=10, lr=0.1),
        TrainConfig(epochs=2, batch_size=7, lr=0.05, momentum=0.9, weight_decay=1e-3),
        TrainConfig(epochs=3, batch_size=16, lr=0.05, prox_mu=1.0),
        TrainConfig(epochs=2, batch_size=float("inf"), lr=0.5),
    ],
    ids=["sgd", "momentum+wd", "fedprox", "full-batch"],
)
def test_matches_textbook_torch_loop(cfg):
    torch.manual_seed(0)
    model = build_model("2nn", (1, 28, 28), 10)
    x, y = torch.rand(53, 1, 28, 28), torch.randint(0, 10, (53,))
    expected = reference_sgd(model, x, y, cfg, seed=11)
    trainer = LocalTrainer(model, cfg)
    start = trainer.flat.clone()
    update = trainer.train(start, x, y, seed=11)
    assert torch.allclose(start + update.delta, expected, atol=2e-6)
    assert update.num_examples == 53
    bs = cfg.batch(53)
    assert update.metrics["local_steps"] == cfg.epochs * -(-53 // bs)


def test_deterministic_per_seed_and_independent_of_history():
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model("logreg", (60,), 10), TrainConfig(epochs=2, lr=0.1, momentum=0.5))
    g = trainer.flat.clone()
    x, y = torch.randn(40, 60), torch.randint(0, 10, (40,))
    a = trainer.train(g, x, y, seed=3).delta
    trainer.train(g, torch.randn(30, 60), torch.randint(0, 10, (30,)), seed=4)  # another client in between
    b = trainer.train(g, x, y, seed=3).delta
    c = trainer.train(g, x, y, seed=5).delta
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_training_lowers_loss():
    torch.manual_seed(0)
    x = torch.randn(200, 60)
    y = (x[:, 0] > 0).long()
    trainer = LocalTrainer(build_model("logreg", (60,), 2), TrainConfig(epochs=5, lr=0.1))
    g = trainer.flat.clone()
    before = trainer.evaluate(g, x, y)
    u = trainer.train(g, x, y, seed=0)
    after = trainer.evaluate(g + u.delta, x, y)
    assert after["loss"] < before["loss"] and after["accuracy"] > 0.9


def test_device_selection():
    assert select_device("cpu").type == "cpu"
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError):
        select_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            select_device("cuda:0")
