import logging

import pytest
import torch
from torch import nn

from shoal.client.batched import (
    BatchedTrainer,
    clients_per_chunk,
    linear_chain,
    make_batched_trainer,
    unsupported_reason,
)
from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig, load_config
from shoal.errors import ConfigError
from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.simulations.inprocess import InProcessSimulation

SIZES = [23, 5, 40, 1, 17, 9]  # uneven, one client smaller than a batch, one single example


def clients(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(SIZES)
    x, y = torch.rand((n, *shape), generator=g), torch.randint(0, 10, (n,), generator=g)
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    return x, y, starts


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(epochs=2, batch_size=10, lr=0.1),
        TrainConfig(epochs=2, batch_size=7, lr=0.05, momentum=0.9, weight_decay=1e-3),
        TrainConfig(epochs=3, batch_size=8, lr=0.05, prox_mu=1.0, momentum=0.5),
        TrainConfig(epochs=2, batch_size=float("inf"), lr=0.5),
    ],
    ids=["sgd", "momentum+wd", "fedprox+momentum", "full-batch"],
)
@pytest.mark.parametrize("chunk", [2, 6])
@pytest.mark.parametrize("path", ["chain", "vmap"])
def test_each_client_equals_local_trainer(cfg, chunk, path):
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model("2nn", (1, 12, 12), 10), cfg)
    x, y, starts = clients((1, 12, 12))
    g = trainer.flat.clone() + 0.01 * torch.randn(trainer.spec.numel)
    seeds = [11 + i for i in range(len(SIZES))]
    batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cpu", chunk)
    assert batched.chain is not None  # the 2NN is a Flatten/Linear/ReLU chain
    if path == "vmap":
        batched.chain = None
    got = dict(batched.train(g, x, y, starts, SIZES, seeds))
    assert sorted(got) == list(range(len(SIZES)))
    for i, (a, n) in enumerate(zip(starts, SIZES)):
        want = trainer.train(g, x[a : a + n], y[a : a + n], seeds[i])
        assert torch.allclose(got[i].delta, want.delta, atol=1e-5, rtol=0), i
        assert got[i].delta.abs().max() > 0
        assert got[i].num_examples == n
        assert got[i].metrics["local_steps"] == want.metrics["local_steps"]
        assert got[i].metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], abs=1e-5)


def test_seed_decides_the_batches():
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, batch_size=4, lr=0.1)
    trainer = LocalTrainer(build_model("logreg", (1, 12, 12), 10), cfg)
    x, y, starts = clients((1, 12, 12))
    batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cpu", 8)
    g = trainer.flat.clone()
    a = dict(batched.train(g, x, y, starts, SIZES, [1] * len(SIZES)))
    b = dict(batched.train(g, x, y, starts, SIZES, [2] * len(SIZES)))
    assert not torch.equal(a[0].delta, b[0].delta)


def sim_params(batch_clients, *extra):
    cfg = load_config(
        None,
        [
            "simulation.rounds=3",
            "simulation.num_clients=12",
            "simulation.clients_per_round=5",
            "model.name=2nn",
            "train.epochs=2",
            "train.batch_size=8",
            "train.lr=0.01",
            "train.momentum=0.5",
            "train.weight_decay=1e-3",
            "train.prox_mu=0.1",
            f"simulation.batch_clients={batch_clients}",
            *extra,
        ],
    )
    sim = InProcessSimulation.from_config(cfg)
    sizes = {sim.shards.size(i) for i in range(len(sim.shards))}
    assert len(sizes) > 3  # Synthetic(1,1) gives uneven client sizes
    losses = [sim.run_round().train_loss for _ in range(3)]
    return sim, sim.global_params.clone(), losses


@pytest.mark.slow  # ~1 s alone; 20-70 s with two torch threads on a loaded 2-core machine
def test_simulation_rounds_batched_equal_sequential():
    # A stable learning rate: with lr=0.05, momentum=0.9 on Synthetic(1,1) a client's
    # 200 local steps amplify a 5e-8 difference in the global model to 0.2 (chaotic
    # dynamics, both paths alike), which would test the dynamics, not the batching.
    seq, p_seq, l_seq = sim_params(1)
    five, p_five, l_five = sim_params(5)
    two, p_two, _ = sim_params(2)
    assert seq.batched is None and five.batched.max_clients == 5 and two.batched.max_clients == 2
    torch.manual_seed(0)  # the initial model, as the simulator builds it
    p0 = torch.cat(
        [p.detach().flatten() for p in build_model("2nn", seq.task.input_shape, seq.task.num_classes).parameters()]
    )
    assert (p_seq - p0.to(p_seq.device)).abs().max() > 1e-2  # training moved the model (on a GPU where there is one)
    assert torch.allclose(p_five, p_seq, atol=1e-5, rtol=0)
    assert torch.allclose(p_two, p_seq, atol=1e-5, rtol=0)
    assert l_five == pytest.approx(l_seq, abs=1e-5)


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))

    def forward(self, x):
        return self.net(x)


def test_unbatchable_models_fall_back_and_say_why(caplog):
    cfg = TrainConfig()
    assert "buffers" in unsupported_reason(WithBatchNorm(), cfg)
    assert "Dropout" in unsupported_reason(nn.Sequential(nn.Linear(6, 3), nn.Dropout(0.5)), cfg)
    assert unsupported_reason(build_model("cnn", (1, 28, 28), 10), cfg) is None
    model = WithBatchNorm()
    with caplog.at_level(logging.INFO, logger="shoal.client.batched"):
        got = make_batched_trainer("auto", model, ParamSpec.of(model), cfg, torch.device("cpu"), (6,), 10, 20)
    assert got is None
    assert sum("one by one" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="buffers"):
        BatchedTrainer(model, ParamSpec.of(model), cfg, "cpu", 4)


def test_chunk_size_from_setting_and_budget():
    cpu = torch.device("cpu")
    small = build_model("logreg", (1, 28, 28), 10)
    spec = ParamSpec.of(small)
    assert make_batched_trainer(1, small, spec, TrainConfig(), cpu, (1, 28, 28), 100, 600) is None
    assert make_batched_trainer(7, small, spec, TrainConfig(), cpu, (1, 28, 28), 100, 600).max_clients == 7
    assert make_batched_trainer("auto", small, spec, TrainConfig(), cpu, (1, 28, 28), 100, 600).max_clients == 100
    assert make_batched_trainer("auto", small, spec, TrainConfig(), cpu, (1, 28, 28), 1, 600) is None
    big = build_model("cnn", (1, 28, 28), 10)
    big_spec = ParamSpec.of(big)
    # auto keeps large non-chain models sequential on a CPU; an explicit N batches them as asked
    assert make_batched_trainer("auto", big, big_spec, TrainConfig(), cpu, (1, 28, 28), 100, 600) is None
    assert make_batched_trainer(100, big, big_spec, TrainConfig(), cpu, (1, 28, 28), 100, 600).max_clients == 100
    # the 2NN (199,210 parameters) is a Linear chain: auto batches it, in cache-sized chunks
    mlp = build_model("2nn", (1, 28, 28), 10)
    mlp_spec = ParamSpec.of(mlp)
    fit = clients_per_chunk(mlp, mlp_spec, (1, 28, 28), 10, cpu)
    assert 1 < fit < 100
    got = make_batched_trainer("auto", mlp, mlp_spec, TrainConfig(), cpu, (1, 28, 28), 100, 600)
    assert got.max_clients == fit and got.chain is not None
    # bf16 runs under autocast on the vmap path, which auto keeps for small models only on a CPU
    assert (
        make_batched_trainer("auto", mlp, mlp_spec, TrainConfig(precision="bf16"), cpu, (1, 28, 28), 100, 600) is None
    )


def test_config_validation():
    assert load_config(None, ["simulation.batch_clients=16"]).simulation.batch_clients == 16
    for bad in ["simulation.batch_clients=0", 'simulation.batch_clients="many"']:
        with pytest.raises(ConfigError, match="batch_clients"):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="precision"):
        load_config(None, ['train.precision="fp16"'])


def test_bf16_autocast_trains_and_batched_follows_sequential():
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=3, batch_size=8, lr=0.1, precision="bf16")
    trainer = LocalTrainer(build_model("2nn", (1, 12, 12), 10), cfg)
    x, y, starts = clients((1, 12, 12))
    g = trainer.flat.clone()
    batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cpu", 6)
    got = dict(batched.train(g, x, y, starts, SIZES, list(range(len(SIZES)))))
    fp32 = LocalTrainer(build_model("2nn", (1, 12, 12), 10), TrainConfig(epochs=3, batch_size=8, lr=0.1))
    for i, (a, n) in enumerate(zip(starts, SIZES)):
        want = trainer.train(g, x[a : a + n], y[a : a + n], i)
        ref = fp32.train(g, x[a : a + n], y[a : a + n], i)
        assert got[i].delta.dtype == torch.float32
        # bf16 keeps ~3 significant digits: close to fp32, not equal to it
        assert torch.allclose(want.delta, ref.delta, atol=2e-2)
        assert torch.allclose(got[i].delta, want.delta, atol=2e-2)


class SharedLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x):
        return self.a(torch.relu(self.a(x)))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(self.a(x) + x)


def test_linear_chain_finds_plain_mlps_only():
    for name in ("logreg", "2nn"):
        m = build_model(name, (1, 12, 12), 10)
        layers = linear_chain(m, ParamSpec.of(m))
        assert layers[0].kind == "flatten" and layers[-1].kind == "linear"
    functional = nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 3))
    assert [la.kind for la in linear_chain(functional, ParamSpec.of(functional))] == ["linear", "relu", "linear"]
    for m in (
        build_model("cnn", (1, 28, 28), 10),
        SharedLinear(),  # one Linear used twice: its in-place update would race its second use
        Residual(),  # not a chain
        nn.Sequential(nn.Linear(6, 8), nn.Sigmoid(), nn.Linear(8, 3)),  # op without a hand-written backward
        nn.Sequential(nn.Linear(6, 8), nn.ReLU()),  # does not end with the logits
    ):
        assert linear_chain(m, ParamSpec.of(m)) is None, m


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(epochs=2, batch_size=4, lr=0.1),
        TrainConfig(epochs=2, batch_size=4, lr=0.05, momentum=0.9, prox_mu=0.5),
    ],
    ids=["sgd", "momentum+fedprox"],
)
def test_chain_on_feature_vectors_without_bias_equals_local_trainer(cfg):
    torch.manual_seed(0)
    trainer = LocalTrainer(nn.Sequential(nn.Linear(6, 8, bias=False), nn.ReLU(), nn.Linear(8, 10)), cfg)
    x, y, starts = clients((6,))
    g = trainer.flat.clone()
    batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cpu", 4)
    assert batched.chain is not None
    got = dict(batched.train(g, x, y, starts, SIZES, list(range(len(SIZES)))))
    for i, (a, n) in enumerate(zip(starts, SIZES)):
        want = trainer.train(g, x[a : a + n], y[a : a + n], i)
        assert got[i].delta.abs().max() > 0
        assert torch.allclose(got[i].delta, want.delta, atol=1e-5, rtol=0), i
        assert got[i].metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], abs=1e-5)


def test_frozen_tensor_takes_the_vmap_path_and_stays_put():
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=1, batch_size=4, lr=0.1, weight_decay=1e-2)
    model = build_model("2nn", (1, 12, 12), 10)
    model.net[1].bias.requires_grad_(False)
    trainer = LocalTrainer(model, cfg)
    batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cpu", 6)
    assert batched.chain is None
    x, y, starts = clients((1, 12, 12))
    g = trainer.flat.clone()
    got = dict(batched.train(g, x, y, starts, SIZES, list(range(len(SIZES)))))
    assert "net.1.bias" not in {e.name for e in trainer.spec.entries}  # frozen: never exchanged
    before = model.net[1].bias.detach().clone()
    for i, (a, n) in enumerate(zip(starts, SIZES)):
        want = trainer.train(g, x[a : a + n], y[a : a + n], i)
        assert torch.allclose(got[i].delta, want.delta, atol=1e-5, rtol=0), i
    assert torch.equal(model.net[1].bias, before)
