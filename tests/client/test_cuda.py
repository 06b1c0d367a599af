"""Local training on a CUDA device gives what it gives on the CPU (skipped without CUDA).

bench/gpu_suite.sh runs these on a GPU machine. cuDNN convolutions use TF32 by default (PyTorch's
setting, kept for users: it is what makes fp32 CNNs fast on the GPU); the tests turn it off so
that differences show a bug, not TF32's 10-bit mantissa (which moved CNN updates by ~2% here).
"""

import pytest
import torch

from shoal.client.batched import BatchedTrainer
from shoal.client.device import select_device
from shoal.client.dp_sgd import DpSgdTrainer
from shoal.client.training import LocalTrainer
from shoal.config import PrivacyConfig, TrainConfig
from shoal.models import build_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SIZES = [23, 5, 40, 1, 17, 9]


@pytest.fixture(autouse=True)
def no_tf32():
    """Exact comparisons: no TF32, and no cuDNN autotuner (select_device turns it on, and the
    algorithms it picks for a batched and a per-client convolution round differently)."""
    cudnn = torch.backends.cudnn
    saved = cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, cudnn.benchmark, cudnn.deterministic
    cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    cudnn.benchmark, cudnn.deterministic = False, True
    yield
    cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32, cudnn.benchmark, cudnn.deterministic = saved


def _clients(shape):
    g = torch.Generator().manual_seed(0)
    n = sum(SIZES)
    x, y = torch.rand((n, *shape), generator=g), torch.randint(0, 10, (n,), generator=g)
    return x, y, [sum(SIZES[:i]) for i in range(len(SIZES))]


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return float((got.cpu() - want.cpu()).norm()) <= rel * float(want.norm())


@pytest.mark.parametrize("model,path", [("2nn", "chain"), ("2nn", "vmap"), ("cnn", "vmap")])
def test_batched_on_cuda_equals_local_trainer_on_cuda(model, path):
    cfg = TrainConfig(epochs=2, batch_size=7, lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model(model, (1, 28, 28), 10), cfg, "cuda")
    x, y, starts = _clients((1, 28, 28))
    x, y = x.cuda(), y.cuda()
    g = trainer.flat.detach().clone()
    batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cuda", 4)
    if path == "vmap":
        batched.chain = None
    assert (batched.chain is not None) == (path == "chain")
    got = dict(batched.train(g, x, y, starts, SIZES, [3 + i for i in range(len(SIZES))]))
    for i, (a, n) in enumerate(zip(starts, SIZES)):
        want = trainer.train(g, x[a : a + n], y[a : a + n], 3 + i)
        assert got[i].delta.device.type == "cuda"
        assert got[i].delta.abs().max() > 0
        rel = float((got[i].delta - want.delta).norm()) / float(want.delta.norm())
        # cuDNN computes a batched (vmap) convolution and a per-client one with different
        # algorithms; 12 momentum steps carry their rounding to ~1e-4 of the update (a wrong
        # step would differ by O(1)); the linear 2NN agrees to float rounding
        assert rel <= (1e-3 if model == "cnn" else 1e-4), (model, path, i, rel)


@pytest.mark.parametrize("model", ["2nn", "cnn"])
def test_one_client_on_cuda_follows_the_cpu(model):
    cfg = TrainConfig(epochs=1, batch_size=10, lr=0.05)
    x, y, _ = _clients((1, 28, 28))
    deltas = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        t = LocalTrainer(build_model(model, (1, 28, 28), 10), cfg, device)
        g = t.flat.detach().clone()
        deltas.append(t.train(g, x.to(device), y.to(device), seed=5).delta.cpu())
    assert _close(deltas[1], deltas[0], 1e-4)


def test_dp_sgd_on_cuda_clips_and_adds_noise_of_std_z_c_over_batch():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 1, 28, 28, generator=g).cuda(), torch.randint(0, 10, (40,), generator=g).cuda()
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, batch_size=40, lr=1.0)
    model = build_model("logreg", (1, 28, 28), 10)
    tight = DpSgdTrainer(model, cfg, PrivacyConfig(mode="local", noise_multiplier=0.0, clip_norm=0.01), "cuda")
    start = tight.flat.detach().clone()
    assert start.device.type == "cuda"
    step = tight.train(start, x, y, seed=1).delta
    assert 0 < float(step.norm()) <= 0.01 * (1 + 1e-5)  # lr * C bounds one clipped mean step
    z, c = 2.0, 1e-6  # gradients clipped to ~0: the step is the noise, N(0, (zC)^2) / B
    torch.manual_seed(0)
    privacy = PrivacyConfig(mode="local", noise_multiplier=z, clip_norm=c)
    noisy = DpSgdTrainer(build_model("logreg", (1, 28, 28), 10), cfg, privacy, "cuda")
    d = noisy.train(start, x, y, seed=2).delta
    assert float(d.std()) == pytest.approx(z * c / 40, rel=0.05)


def test_choosing_a_gpu_turns_on_the_cudnn_autotuner():
    saved = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = False
        assert select_device("cpu").type == "cpu" and not torch.backends.cudnn.benchmark
        assert select_device("auto").type == "cuda" and torch.backends.cudnn.benchmark
    finally:
        torch.backends.cudnn.benchmark = saved
