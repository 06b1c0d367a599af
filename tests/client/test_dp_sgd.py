"""DP-SGD on a client with Opacus: per-sample clipping bounds a step, the flat buffer stays bound."""

import logging

import pytest
import torch
from torch import nn

from shoal.client.dp_sgd import DpSgdTrainer
from shoal.client.training import LocalTrainer
from shoal.config import PrivacyConfig, TrainConfig
from shoal.models import build_model


def _data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _model():
    torch.manual_seed(0)
    return build_model("logreg", (1, 28, 28), 10)


def test_clipped_step_is_bounded_and_matches_sgd_without_clipping():
    x, y = _data()
    cfg = TrainConfig(epochs=1, batch_size=40, lr=0.5)  # q = 1, local_steps = 1: one step on all 40 examples
    tight = DpSgdTrainer(
        _model(), cfg, PrivacyConfig(mode="local", noise_multiplier=0.0, clip_norm=0.01, local_steps=1)
    )
    g = tight.flat.detach().clone()
    u = tight.train(g, x, y, seed=1)
    # the mean of 40 per-sample gradients each clipped to C moves at most lr * C
    assert 0 < float(u.delta.norm()) <= 0.5 * 0.01 * (1 + 1e-5)
    loose = DpSgdTrainer(_model(), cfg, PrivacyConfig(mode="local", noise_multiplier=0.0, clip_norm=1e6, local_steps=1))
    plain = LocalTrainer(_model(), cfg)
    assert torch.allclose(loose.train(g, x, y, seed=1).delta, plain.train(g, x, y, seed=1).delta, atol=1e-6)
    # parameters are still views of the flat buffer after Opacus' steps
    p = next(loose.model.parameters())
    assert p.data.data_ptr() == loose.flat.data_ptr()


def test_noise_enters_the_update_with_std_z_c_over_batch():
    x, y = _data()
    cfg = TrainConfig(epochs=1, batch_size=40, lr=1.0)
    z, c = 2.0, 1e-6  # gradients clipped to ~0: the step is the noise, lr * N(0, (zC)^2) / B
    seeded = PrivacyConfig(mode="local", noise_multiplier=z, clip_norm=c, reproducible=True, local_steps=1)
    t = DpSgdTrainer(_model(), cfg, seeded)
    g = t.flat.detach().clone()
    d = t.train(g, x, y, seed=2).delta
    assert float(d.std()) == pytest.approx(z * c / 40, rel=0.05)
    assert torch.equal(d, t.train(g, x, y, seed=2).delta)  # reproducible: same task, same noise
    assert not torch.equal(d, t.train(g, x, y, seed=3).delta)


def test_batchnorm_is_replaced_with_a_message(caplog):
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 26 * 26, 10))
    with caplog.at_level(logging.WARNING, logger="shoal.client.dp_sgd"):
        t = DpSgdTrainer(model, TrainConfig(epochs=1, batch_size=10), PrivacyConfig(mode="local"))
    assert isinstance(t.model[1], nn.GroupNorm)
    assert "BatchNorm2d replaced by GroupNorm" in caplog.text
    x, y = _data(20)
    assert torch.isfinite(t.train(t.flat.detach().clone(), x, y, seed=0).delta).all()
