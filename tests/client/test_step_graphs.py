"""The batched trainer's steps as graph replays: the runner's bookkeeping on a CPU with a recorder that
behaves as a CUDA graph does (records at capture, runs at each replay), and, on a GPU, graphs on
against graphs off."""

import pytest
import torch
from torch import nn

from shoal.client import step_graphs
from shoal.client.batched import BatchedTrainer
from shoal.client.step_graphs import StepRunner, runs
from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig
from shoal.models import build_model

WARM, MIN = step_graphs.WARMUP_STEPS, step_graphs.MIN_REPLAYS


class Recorder:
    """A StepGraph on the CPU: capture keeps the step without running it, replay runs it."""

    def __init__(self, log, fail=False):
        self.log, self.fail, self.step = log, fail, None

    def capture(self, step):
        self.log.append("capture")
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.step = step

    def replay(self):
        self.log.append("replay")
        self.step()


def small_cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(100, 10))


def test_runs_group_equal_active_counts():
    assert runs([]) == []
    assert runs([3, 3, 3, 2, 1, 1]) == [(3, 3), (2, 1), (1, 2)]


def test_every_step_runs_once_in_order_whether_recorded_or_not():
    long = WARM + 1 + MIN  # the shortest run that is recorded
    active = [5] * (long + 3) + [4] * (long - 1) + [2] * long
    events = []
    done = []

    def step(a):
        done.append(a)

    runner = StepRunner(lambda previous: Recorder(events), torch.device("cpu"))
    runner.run(step, active)
    assert done == active  # warm-up steps + replays, never the capture itself
    assert runner.captured == 2 and runner.replays == (long + 3 - WARM) + (long - WARM)
    assert events.count("capture") == 2 and not runner.failed


def test_a_failed_capture_finishes_eagerly_and_stays_off():
    events, done = [], []
    runner = StepRunner(lambda previous: Recorder(events, fail=True), torch.device("cpu"))
    active = [3] * 10 + [1] * 10
    runner.run(done.append, active)
    assert done == active and runner.failed and runner.captured == 0
    assert events == ["capture"]  # the second run of steps was not tried again


def test_trainer_steps_through_a_recorder_equal_the_local_trainer():
    """The batched step reads its batch and step number from the device, so replaying one recorded
    step trains every step: with the recorder, each client equals LocalTrainer's (1e-6)."""
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, batch_size=4, lr=0.05, momentum=0.9, prox_mu=0.1)
    sizes = [40, 40, 40, 9]  # B = 4: 3 steps of 4 clients (eager), 7 of 3 (recorded)
    g = torch.Generator().manual_seed(1)
    x = torch.rand((sum(sizes), 1, 12, 12), generator=g)
    y = torch.randint(0, 10, (sum(sizes),), generator=g)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for path in ("vmap", "chain"):
        model = small_cnn() if path == "vmap" else build_model("2nn", (1, 12, 12), 10)
        local = LocalTrainer(model, cfg)
        start = local.flat.clone()
        batched = BatchedTrainer(local.model, local.spec, cfg, "cpu", 4)
        assert (batched.chain is not None) == (path == "chain") and batched.step_graphs is None  # eager on a CPU
        events: list[str] = []
        batched.step_graphs = lambda previous, events=events: Recorder(events)
        got = dict(batched.train(start, x, y, starts, sizes, [7, 8, 9, 10]))
        assert events == ["capture"] + ["replay"] * (7 - step_graphs.WARMUP_STEPS)
        for i, (a, n) in enumerate(zip(starts, sizes)):
            want = local.train(start, x[a : a + n], y[a : a + n], [7, 8, 9, 10][i])
            assert torch.allclose(got[i].delta, want.delta, atol=1e-6, rtol=0), (path, i)
            assert got[i].metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], abs=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("model", ["cnn", "2nn"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_graphs_equal_eager_steps(model, precision):
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = TrainConfig(epochs=2, batch_size=10, lr=0.05, momentum=0.5, weight_decay=1e-3, precision=precision)
    net = build_model(model, (1, 28, 28), 10).to(dev)
    local = LocalTrainer(net, cfg, dev)
    sizes = [60] * 6 + [30] * 4
    x = torch.rand((sum(sizes), 1, 28, 28), device=dev)
    y = torch.randint(0, 10, (sum(sizes),), device=dev)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    g0 = local.flat.detach().clone()
    out = {}
    for graphs in (False, True):
        batched = BatchedTrainer(local.model, local.spec, cfg, dev, 10, cuda_graphs=graphs)
        out[graphs] = dict(batched.train(g0, x, y, starts, sizes, list(range(10))))
        assert (batched.step_graphs is not None) == graphs  # no capture failed
    tol = 1e-6 if precision == "fp32" else 1e-3
    for i in range(10):
        assert torch.allclose(out[True][i].delta, out[False][i].delta, atol=tol, rtol=0), i
