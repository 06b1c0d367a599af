"""The batched trainer's stand-in layers (client/batched_layers.py) compute what the torch layers
they replace compute, forward and backward, and make recurrent, attention and matmul-conv models
train in BatchedTrainer exactly as LocalTrainer trains each client alone."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.func import functional_call, vmap

from shoal.client.batched import BatchedTrainer, make_batched_trainer, unsupported_reason, vmap_blocker
from shoal.client.batched_layers import (
    BatchableGRU,
    BatchableLSTM,
    BatchableMultiheadAttention,
    MatmulConv2d,
    batchable,
    random_layers,
)
from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig
from shoal.params import ParamSpec

TOL = dict(atol=1e-5, rtol=0)


def same_forward_and_grads(layer: nn.Module, conv: str, *inputs, pick=lambda out: out):
    """``batchable(layer)`` gives the layer's outputs and the same gradients for its parameters
    and inputs (a random linear function of every output tensor as the loss)."""
    standin = batchable(layer, conv)
    assert [type(m) for m in standin.modules()] != [type(m) for m in layer.modules()]  # a layer was swapped
    results = []
    for m in (layer, standin):
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = pick(m(*xs))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o is not None]
        outs = [t for o in outs for t in (o if isinstance(o, tuple) else (o,))]
        g = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in outs)
        params = list(m.parameters())
        leaves = params + [x for x in xs if x.requires_grad]
        results.append((outs, torch.autograd.grad(loss, leaves)))
    (want, gw), (got, gg) = results
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert a.shape == b.shape and torch.allclose(a, b, **TOL)
    for a, b in zip(gw, gg):
        assert torch.allclose(a, b, **TOL)


@pytest.mark.parametrize("kind", [nn.GRU, nn.LSTM, nn.RNN])
@pytest.mark.parametrize(
    "flags",
    [
        dict(batch_first=True),
        dict(batch_first=False, num_layers=2, bidirectional=True),
        dict(batch_first=True, num_layers=2, bias=False),
        dict(batch_first=True, bidirectional=True, initial=True),
        dict(batch_first=False, unbatched=True, initial=True),
    ],
    ids=["batch_first", "2-layer-bidirectional", "no-bias", "initial-state", "unbatched"],
)
def test_recurrent_stand_ins_equal_torch(kind, flags):
    flags = dict(flags)
    initial, unbatched = flags.pop("initial", False), flags.pop("unbatched", False)
    torch.manual_seed(0)
    layer = kind(4, 6, **flags)
    if kind is nn.RNN:
        layer = nn.RNN(4, 6, nonlinearity="relu", **flags)
    dirs, layers = 2 if layer.bidirectional else 1, layer.num_layers
    x = torch.randn(3, 5, 4) if layer.batch_first else torch.randn(5, 3, 4)
    if unbatched:
        x = x[:, 0]
    state_shape = (dirs * layers, 6) if unbatched else (dirs * layers, 3, 6)
    inputs = [x]
    if initial:
        h0 = torch.randn(state_shape)
        inputs.append((h0, torch.randn(state_shape)) if kind is nn.LSTM else h0)
    if kind is nn.LSTM and initial:  # (h0, c0) is a tuple: pass it through a closure
        h0, c0 = inputs[1]
        x_in = inputs[0]

        class Wrap(nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn = layer

            def forward(self, x, h, c):
                return self.rnn(x, (h, c))

        same_forward_and_grads(Wrap(), "grouped", x_in, h0, c0)
    else:
        same_forward_and_grads(layer, "grouped", *inputs)


@pytest.mark.parametrize(
    "flags",
    [
        dict(batch_first=True),
        dict(batch_first=False, kdim=5, vdim=3),
        dict(batch_first=True, bias=False, masks=True),
        dict(batch_first=True, unbatched=True),
    ],
    ids=["self", "cross-kdim-vdim", "masks-no-bias", "unbatched"],
)
def test_attention_stand_in_equals_torch(flags):
    flags = dict(flags)
    masks, unbatched = flags.pop("masks", False), flags.pop("unbatched", False)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, **flags)
    kd, vd = flags.get("kdim", 8), flags.get("vdim", 8)
    bf = mha.batch_first
    q = torch.randn((3, 4, 8) if bf else (4, 3, 8))
    k = torch.randn((3, 6, kd) if bf else (6, 3, kd))
    v = torch.randn((3, 6, vd) if bf else (6, 3, vd))
    if unbatched:
        q, k, v = q[0], k[0], v[0]
    if masks:
        attn_mask = torch.randn(4, 6)  # float masks are added, bool ones block
        pad = torch.zeros(3, 6)
        pad[0, -2:] = float("-inf")

        class Wrap(nn.Module):
            def __init__(self):
                super().__init__()
                self.mha = mha

            def forward(self, q, k, v):
                return self.mha(q, k, v, key_padding_mask=pad, attn_mask=attn_mask, average_attn_weights=False)

        same_forward_and_grads(Wrap(), "grouped", q, k, v)
    else:
        same_forward_and_grads(mha, "grouped", q, k, v)


@pytest.mark.parametrize(
    "flags",
    [
        dict(kernel_size=5, padding=2),
        dict(kernel_size=3, stride=2, bias=False),
        dict(kernel_size=(2, 3), padding="same", dilation=2),
        dict(kernel_size=3, padding=(1, 0), stride=(1, 2), unbatched=True),
    ],
    ids=["same-padding-5x5", "stride-no-bias", "same-even-kernel-dilated", "unbatched"],
)
def test_matmul_conv_equals_torch(flags):
    flags = dict(flags)
    unbatched = flags.pop("unbatched", False)
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, **flags)
    x = torch.randn(2, 3, 9, 8)
    same_forward_and_grads(conv, "matmul", x[0] if unbatched else x)
    assert type(batchable(conv, "grouped")) is nn.Conv2d  # the default keeps torch's convolution


def test_stand_ins_batch_under_vmap():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(1, 2), nn.GRU(6, 5, batch_first=True))
    swapped = batchable(model, "matmul")
    assert [type(m) for m in swapped] == [MatmulConv2d, nn.Flatten, BatchableGRU]
    x = torch.randn(4, 1, 8, 8)
    rows = {n: torch.stack([p.detach(), p.detach() + 0.1 * torch.randn_like(p)]) for n, p in model.named_parameters()}
    out, h = vmap(lambda p: functional_call(swapped, p, (x,)))(rows)
    for i in range(2):
        want, want_h = functional_call(model, {n: r[i] for n, r in rows.items()}, (x,))
        assert torch.allclose(out[i], want, **TOL) and torch.allclose(h[i], want_h, **TOL)


def test_batchable_leaves_the_model_alone_and_shares_its_tensors():
    model = nn.Sequential(nn.LSTM(3, 4), nn.MultiheadAttention(4, 2))
    swapped = batchable(model)
    assert type(model[0]) is nn.LSTM and type(model[1]) is nn.MultiheadAttention
    assert type(swapped[0]) is BatchableLSTM and type(swapped[1]) is BatchableMultiheadAttention
    assert all(a is b for a, b in zip(model.parameters(), swapped.parameters()))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in swapped.named_parameters()]
    with pytest.raises(ValueError, match="batched_conv"):
        batchable(model, "fft")


def test_layers_without_an_exact_stand_in_stay_and_randomness_is_named():
    kept = [
        nn.GRU(3, 4, num_layers=2, dropout=0.5),
        nn.LSTM(3, 4, proj_size=2),
        nn.MultiheadAttention(4, 2, add_zero_attn=True),
        nn.MultiheadAttention(4, 2, dropout=0.1),
    ]
    for layer in kept:
        assert type(batchable(layer)) is type(layer), layer
    assert type(batchable(nn.Conv2d(2, 2, 3, groups=2), "matmul")) is nn.Conv2d
    assert type(batchable(nn.GRU(3, 4, dropout=0.5))) is BatchableGRU  # one layer: torch applies no dropout
    assert random_layers(nn.Sequential(nn.Dropout(0.0), nn.Dropout2d(0.0), nn.GRU(3, 4, dropout=0.5))) == []
    assert random_layers(nn.Sequential(nn.Dropout(0.5), *kept)) == [
        "Dropout",
        "GRU(dropout=0.5)",
        "MultiheadAttention(dropout=0.1)",
    ]


class Recurrent(nn.Module):
    """A sequence classifier: a recurrent layer over (N, L, 4) features, a linear head on the last
    step's output (and, for an LSTM, its final cell state)."""

    def __init__(self, kind, **flags):
        super().__init__()
        self.rnn = kind(4, 5, batch_first=True, **flags)
        width = 5 * (2 if self.rnn.bidirectional else 1)
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        out, state = self.rnn(x)
        logits = self.head(out[:, -1])
        if isinstance(state, tuple):  # LSTM: (h_n, c_n)
            logits = logits + state[1].sum((0, 2)).unsqueeze(-1)
        return logits


class Encoder(nn.Module):
    """A small transformer-encoder classifier (dropout 0: its Dropout modules are no-ops)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.head(self.enc(self.inp(x)).mean(1))


def small_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 1 * 1, CLASSES),
    )


CLASSES = 3
SIZES = [13, 5, 1, 9]  # uneven, one smaller than a batch, one single example
MODELS = {
    "gru": (lambda: Recurrent(nn.GRU), (6, 4), "grouped"),
    "lstm": (lambda: Recurrent(nn.LSTM), (6, 4), "grouped"),
    "gru-2-layer-bidirectional": (lambda: Recurrent(nn.GRU, num_layers=2, bidirectional=True), (6, 4), "grouped"),
    "transformer-encoder": (Encoder, (6, 4), "grouped"),
    "cnn-matmul-conv": (small_cnn, (1, 6, 6), "matmul"),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_batched_trainer_equals_local_trainer(name):
    build, shape, conv = MODELS[name]
    torch.manual_seed(0)
    cfg = TrainConfig(epochs=2, batch_size=4, lr=0.1, momentum=0.5, weight_decay=1e-3)
    trainer = LocalTrainer(build(), cfg)
    model, before = trainer.model, [type(m) for m in trainer.model.modules()]
    assert unsupported_reason(model, cfg) is None
    g = torch.Generator().manual_seed(0)
    x = torch.randn((sum(SIZES), *shape), generator=g)
    y = torch.randint(0, CLASSES, (sum(SIZES),), generator=g)
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    assert vmap_blocker(model, shape, conv) is None
    batched = make_batched_trainer(3, model, trainer.spec, cfg, torch.device("cpu"), shape, 4, 13, conv=conv)
    assert batched is not None and batched.chain is None and batched.max_clients == 3
    flat = trainer.flat.clone() + 0.01 * torch.randn(trainer.spec.numel, generator=g)
    seeds = [7 + i for i in range(len(SIZES))]
    got = dict(batched.train(flat, x, y, starts, SIZES, seeds))
    for i, (a, n) in enumerate(zip(starts, SIZES)):
        want = trainer.train(flat, x[a : a + n], y[a : a + n], seeds[i])
        assert got[i].delta.abs().max() > 0
        assert torch.allclose(got[i].delta, want.delta, **TOL), (i, (got[i].delta - want.delta).abs().max())
        assert got[i].metrics["train_loss"] == pytest.approx(want.metrics["train_loss"], abs=1e-5)
    assert [type(m) for m in model.modules()] == before  # the user's model keeps its layers


def test_refusals_say_why(caplog):
    cfg = TrainConfig()
    for model, why in [
        (nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.5)), "Dropout layers that draw random numbers"),
        (nn.GRU(4, 3, num_layers=2, dropout=0.2), "GRU(dropout=0.2)"),
        (nn.MultiheadAttention(4, 2, dropout=0.1), "MultiheadAttention(dropout=0.1)"),
    ]:
        assert why in unsupported_reason(model, cfg)
    assert unsupported_reason(nn.Sequential(nn.Linear(4, 3), nn.Dropout(0.0)), cfg) is None
    proj = Recurrent(nn.LSTM, proj_size=2)
    proj.head = nn.Linear(2, CLASSES)
    assert "aten::lstm" in vmap_blocker(proj, (6, 4))  # no stand-in: vmap's own refusal, word for word
    with caplog.at_level(logging.WARNING, logger="shoal.client.batched"):
        assert make_batched_trainer(4, proj, ParamSpec.of(proj), cfg, torch.device("cpu"), (6, 4), 4, 10) is None
    assert any("one by one" in r.getMessage() and "lstm" in r.getMessage() for r in caplog.records)
    assert "PackedSequence" in vmap_blocker(Packed(), (6, 4))
    with pytest.raises(ValueError, match="batched_conv"):
        BatchedTrainer(small_cnn(), ParamSpec.of(small_cnn()), cfg, "cpu", 2, conv="fft")


class Packed(nn.Module):
    """Packs its (full-length) sequences before the GRU: the stand-in refuses a PackedSequence."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(4, 5, batch_first=True), nn.Linear(5, CLASSES)

    def forward(self, x):
        lengths = torch.full((x.shape[0],), x.shape[1])
        _, h = self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))
        return self.head(h[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gru", "lstm", "transformer-encoder", "cnn-matmul-conv"])
def test_stand_ins_replay_as_cuda_graphs_and_equal_local_trainer(name):
    """On a GPU the batched steps are recorded and replayed (simulation.cuda_graphs): the stand-ins
    capture without falling back, and each client equals LocalTrainer's (cuDNN's fused GRU/LSTM
    and convolutions against the stand-ins' matmuls, TF32 off)."""
    build, shape, conv = MODELS[name]
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        cfg = TrainConfig(epochs=1, batch_size=4, lr=0.1, momentum=0.5)
        trainer = LocalTrainer(build().cuda(), cfg, "cuda")
        sizes = [40, 40, 36]  # 10, 10 and 9 steps: long enough runs to be recorded
        g = torch.Generator().manual_seed(0)
        x = torch.randn((sum(sizes), *shape), generator=g).cuda()
        y = torch.randint(0, CLASSES, (sum(sizes),), generator=g).cuda()
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        batched = BatchedTrainer(trainer.model, trainer.spec, cfg, "cuda", 3, True, conv)
        start = trainer.flat.clone()
        got = dict(batched.train(start, x, y, starts, sizes, [1, 2, 3]))
        assert batched.step_graphs is not None  # no capture failed
        for i, (a, n) in enumerate(zip(starts, sizes)):
            want = trainer.train(start, x[a : a + n], y[a : a + n], i + 1)
            assert torch.allclose(got[i].delta, want.delta, atol=1e-4, rtol=0), (
                i,
                (got[i].delta - want.delta).abs().max(),
            )
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
