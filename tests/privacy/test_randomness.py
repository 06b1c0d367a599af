"""Where DP randomness comes from: the OS (>= 128 bits) unless privacy.reproducible is on."""

import math
import os

import numpy as np
import pytest
import torch

import shoal.noise
import shoal.privacy_state as privacy_state
from shoal.aggregation.dp import make_generator
from shoal.client.dp_sgd import DpSgdTrainer
from shoal.config import PrivacyConfig, TrainConfig, load_config
from shoal.models import build_model
from shoal.noise import NoiseSource
from shoal.rounds import Assignment
from shoal.simulations.dp_hooks import DistributedNoise
from shoal.simulations.inprocess import InProcessSimulation
from shoal.update import Update

BASE = ["simulation.rounds=3", "simulation.num_clients=20", "simulation.clients_per_round=10", "simulation.seed=7"]


def cfg(mode, *extra):
    return load_config(None, [*BASE, f'privacy.mode="{mode}"', "privacy.noise_multiplier=1.0", *extra])


@pytest.fixture
def os_entropy(monkeypatch):
    """Every read of OS entropy by the noise sources and the selection secret: its size in bytes."""
    reads = []
    urandom, token = os.urandom, privacy_state.secrets.token_bytes

    def read(n):
        reads.append(n)
        return urandom(n)

    def token_bytes(n=None):
        reads.append(n)
        return token(n)

    monkeypatch.setattr(shoal.noise.os, "urandom", read)
    monkeypatch.setattr(privacy_state.secrets, "token_bytes", token_bytes)
    return reads


def _selections(sim, rounds=3):
    out = []
    for _ in range(rounds):
        sim.run_round()
        out.append(sorted(sim.rounds.selected))
    return out


def test_selection_and_central_noise_take_128_bits_from_the_os_not_the_seed(os_entropy):
    a, b = InProcessSimulation.from_config(cfg("central")), InProcessSimulation.from_config(cfg("central"))
    for sim in (a, b):
        assert isinstance(sim.rounds.secret, bytes) and len(sim.rounds.secret) * 8 >= 128
        gen = sim.rounds.strategy.aggregator._gen
        assert isinstance(gen, NoiseSource) and not gen.reproducible
    assert a.rounds.secret != b.rounds.secret
    assert os_entropy and min(os_entropy) * 8 >= 128  # the secrets and the noise keys
    # same config, same simulation.seed: Poisson selections (q = 1/2, 3 rounds) and models differ
    assert _selections(a) != _selections(b)
    assert not torch.equal(a.global_params, b.global_params)
    assert "CSPRNG" in a.privacy.summary()["randomness"]


def test_reproducible_mode_repeats_and_says_what_it_gives_up(os_entropy):
    runs = [InProcessSimulation.from_config(cfg("central", "privacy.reproducible=true")) for _ in range(2)]
    assert all(s.rounds.secret is None for s in runs)
    assert _selections(runs[0]) == _selections(runs[1])
    assert torch.equal(runs[0].global_params, runs[1].global_params)
    assert "does NOT hold against anyone who knows the seed" in runs[0].privacy.summary()["randomness"]
    other = InProcessSimulation.from_config(cfg("central", "privacy.reproducible=true", "simulation.seed=8"))
    assert _selections(other) != _selections(
        InProcessSimulation.from_config(cfg("central", "privacy.reproducible=true"))
    )


@pytest.mark.parametrize("reproducible", [False, True])
def test_distributed_noise_shares(reproducible):
    c = cfg("distributed", f"privacy.reproducible={str(reproducible).lower()}")
    step = DistributedNoise(c, shares=4)
    task = Assignment("c0", 1, 0, seed=1234)
    draws = [step(task, Update(torch.zeros(1000), 10, 0)).delta for _ in range(2)]
    assert torch.equal(draws[0], draws[1]) == reproducible
    assert float(draws[0].std()) == pytest.approx(0.5, rel=0.1)  # z C / sqrt(t)


def test_generators_and_sources():
    assert isinstance(make_generator("cpu", None), NoiseSource)
    assert isinstance(make_generator("cpu", 5), torch.Generator)
    a, b = NoiseSource.seeded(1, 2), NoiseSource.seeded(1, 2)
    assert np.array_equal(a.words(8), b.words(8)) and a.reproducible
    assert not np.array_equal(NoiseSource().words(8), NoiseSource().words(8))
    x = NoiseSource.seeded(3).gaussian(200_000, 2.0)
    assert abs(x.mean()) < 0.02 and x.std() == pytest.approx(2.0, rel=0.01)
    assert np.isfinite(x).all() and np.mean(np.abs(x) < 2.0) == pytest.approx(0.6827, abs=0.005)
    assert np.mean((x / 2.0) ** 4) == pytest.approx(3.0, rel=0.05)  # Gaussian tails, not a narrower sum
    t = torch.empty(3, 70_001, dtype=torch.float32)  # blocks of 2^15 entries and a partial one
    NoiseSource.seeded(3).gaussian_into(t, 2.0)
    assert torch.equal(t.flatten()[:1000], torch.from_numpy(x[:1000]).float())
    u = NoiseSource.seeded(4).below(np.array([1, 3, 2**62 + 1] * 1000))
    assert u.min() >= 0 and (u[0::3] == 0).all() and u[1::3].max() == 2
    src = NoiseSource.seeded(5)
    for h in (1, 3, 1000, (1 << 24) - 3, (1 << 24) + 1, 1 << 40):  # 32-bit words up to 2^24, 64-bit above
        v = src.below(h, 60_000)
        assert v.dtype == np.int64 and v.min() >= 0 and v.max() < h
        assert abs(v.mean() / (h - 1 or 1) - 0.5) < 0.01 if h > 1 else (v == 0).all()
    counts = np.bincount(src.below(3, 90_000), minlength=3)
    assert np.abs(counts - 30_000).max() < 5 * math.sqrt(90_000 * 2 / 9)


@pytest.mark.parametrize("reproducible", [False, True])
def test_local_dp_sgd_noise_and_batches_follow_the_switch(reproducible):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    cfg = TrainConfig(epochs=1, batch_size=10, lr=0.1)
    privacy = PrivacyConfig(mode="local", noise_multiplier=1.0, clip_norm=1.0, reproducible=reproducible)
    deltas = []
    for _ in range(2):
        torch.manual_seed(0)
        trainer = DpSgdTrainer(build_model("logreg", (1, 28, 28), 10), cfg, privacy)
        deltas.append(trainer.train(trainer.flat.detach().clone(), x, y, seed=5).delta)
    assert torch.equal(deltas[0], deltas[1]) == reproducible  # same task seed: same update only if reproducible


def test_dp_sgd_step_noise_comes_from_the_noise_source_with_the_right_std():
    """The per-step noise is the CSPRNG's (same source key -> same noise; torch's generator untouched)
    and has std z C / B on the averaged gradient; each entry a float64 sum cast to float32."""
    from opacus import GradSampleModule

    from shoal.client.dp_sgd import CsprngDPOptimizer

    def step_grad(src):
        torch.manual_seed(0)
        model = GradSampleModule(torch.nn.Linear(300, 100), loss_reduction="mean")
        gen = torch.Generator().manual_seed(9)
        opt = CsprngDPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            noise_multiplier=2.0,
            max_grad_norm=1.5,
            expected_batch_size=4,
            generator=gen,
        )
        opt.noise_source = src
        for p in model.parameters():
            p.grad_sample = torch.zeros((1, *p.shape))
        opt.step()
        assert torch.equal(gen.get_state(), torch.Generator().manual_seed(9).get_state())  # not drawn from
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    a, b = step_grad(NoiseSource.seeded(11)), step_grad(NoiseSource.seeded(11))
    assert torch.equal(a, b) and a.dtype == torch.float32 and a.numel() == 30_100
    assert float(a.std()) == pytest.approx(2.0 * 1.5 / 4, rel=0.03) and abs(float(a.mean())) < 0.02
    assert not torch.equal(a, step_grad(NoiseSource()))


def test_device_stream_gaussian_is_keyed_from_the_source_and_normal():
    """The ChaCha20 Gaussian that a CUDA tensor gets (forced onto the CPU here): keyed with 32 bytes
    of the source's AES stream, so it repeats exactly when the source is seeded; normal."""
    n = 20_000
    a, b = NoiseSource.seeded(3), NoiseSource.seeded(3)
    x = a.gaussian_into(torch.empty(n, dtype=torch.float64), 2.0, keystream="chacha20")
    assert torch.equal(x, b.gaussian_into(torch.empty(n, dtype=torch.float64), 2.0, keystream="chacha20"))
    after_key = NoiseSource.seeded(3)
    after_key.secret()  # the device stream's key: the AES stream goes on after it
    assert np.array_equal(a.words(4), after_key.words(4))
    assert not torch.equal(x[:100], torch.from_numpy(NoiseSource.seeded(3).gaussian(100, 2.0)))
    assert abs(float(x.mean())) < 5 * 2.0 / math.sqrt(n)
    assert abs(float(x.var()) - 4.0) < 5 * 4.0 * math.sqrt(2 / n)
    assert float(((x / 2.0) ** 4).mean()) == pytest.approx(3.0, rel=0.1)  # Gaussian tails
    y = a.gaussian_into(torch.empty(n, dtype=torch.float64), 2.0, keystream="chacha20")
    assert not torch.equal(x, y)  # the stream moved on
    with pytest.raises(ValueError, match="keystream"):
        a.gaussian_into(torch.empty(3), 1.0, keystream="os")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gaussian_into_a_cuda_tensor_draws_on_the_device():
    n = 70_001
    t = NoiseSource.seeded(3).gaussian_tensor(n, 2.0, "cuda")
    cpu = NoiseSource.seeded(3).gaussian_into(torch.empty(n, dtype=torch.float64), 2.0, keystream="chacha20")
    # the same bits; CUDA's float64 log, sin and cos may differ from the CPU's in the last place
    assert t.device.type == "cuda" and torch.allclose(t.cpu(), cpu.float(), rtol=1e-5, atol=1e-6)
    aes = NoiseSource.seeded(3).gaussian_into(torch.empty(n, device="cuda"), 2.0, keystream="aes")
    assert torch.allclose(aes.cpu(), torch.from_numpy(NoiseSource.seeded(3).gaussian(n, 2.0)).float(), atol=1e-5)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 28, 28, generator=g), torch.randint(0, 10, (40,), generator=g)
    privacy = PrivacyConfig(mode="local", noise_multiplier=1.0, clip_norm=1.0)
    trainer = DpSgdTrainer(
        build_model("logreg", (1, 28, 28), 10), TrainConfig(epochs=1, batch_size=10, lr=0.1), privacy, "cuda"
    )
    delta = trainer.train(trainer.flat.detach().clone(), x.cuda(), y.cuda(), seed=5).delta
    assert torch.isfinite(delta).all() and float(delta.abs().sum()) > 0
