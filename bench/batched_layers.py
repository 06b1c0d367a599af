"""Seconds per round of the batched trainer's stand-in layers against training one by one.

Two cases, each side by side in one run (the ways take turns within every repeat; best of
``--repeats``):

- ``gru``: a GRU classifier (nn.GRU 4 -> 32, batch_first, a linear head on the last step;
  sequences of 20 steps of 4 features, 5 classes), 400 clients of which 100 train a round:
  ``seq`` is LocalTrainer one client after another (torch's fused GRU kernel: cuDNN on a
  GPU), ``batched`` is BatchedTrainer as ``simulation.batch_clients = "auto"`` builds it
  (the GRU as the time loop of batched matmuls of client/batched_layers.py);
- ``attn``: a one-layer transformer-encoder classifier (d_model 32, 4 heads, sequences of 20,
  dropout 0) on the GRU's data, batched with the attention stand-in against batched with
  torch's own nn.MultiheadAttention under vmap (whose CPU attention kernel has no batching
  rule: vmap runs it client by client) and one by one;
- ``cnn``: McMahan et al.'s MNIST CNN (1x28x28, 1.66M parameters), K clients batched with
  ``simulation.batched_conv = "grouped"`` (vmap's grouped convolution) and ``"matmul"``
  (im2col + bmm), and one by one on the first ``--seq-cap`` of them (extrapolated to K).

Data is random tensors made here (timing does not depend on the values), resident on the
device as in the simulator. Every round starts from the same global model; each cell also
prints how far the batched round's mean update is from the one-by-one one (they should agree
to float32 rounding).

    python bench/batched_layers.py --device cpu --quick   # CPU: ~1 min on a shared 2-core machine
    python bench/batched_layers.py --device cuda          # GPU: 600 samples per client, CNN at K = 100
    python bench/batched_layers.py --device cuda --no-cuda-graphs   # the batched steps eager

On a GPU the batched steps are replayed as CUDA graphs, as ``simulation.cuda_graphs`` does.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sim_throughput import timed  # noqa: E402 - bench/ is not a package (its folder is put on the path above)

from shoal.aggregation.mean import WeightedMean  # noqa: E402
from shoal.client.batched import BatchedTrainer, make_batched_trainer  # noqa: E402
from shoal.client.device import select_device  # noqa: E402
from shoal.client.training import LocalTrainer  # noqa: E402
from shoal.config import TrainConfig  # noqa: E402
from shoal.models import build_model  # noqa: E402

SEQ, FEATURES, HIDDEN, SEQ_CLASSES = 20, 4, 32, 5


class GRUClassifier(nn.Module):
    """nn.GRU(4 -> 32) over (N, 20, 4) sequences and a linear head on the last step's output."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(FEATURES, HIDDEN, batch_first=True)
        self.head = nn.Linear(HIDDEN, SEQ_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class EncoderClassifier(nn.Module):
    """A linear embedding of the 4 features to 32, one transformer-encoder layer, mean over time, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, SEQ_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.inp(x)).mean(1))


def data(n: int, shape: tuple[int, ...], classes: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((n, *shape), generator=gen)
    y = torch.randint(0, classes, (n,), generator=gen)
    return x.to(device), y.to(device)


def round_seq(trainer: LocalTrainer, g, x, y, starts, sizes, device) -> torch.Tensor:
    acc = WeightedMean(trainer.spec.numel, device)
    for i, (a, n) in enumerate(zip(starts, sizes)):
        u = trainer.train(g, x[a : a + n], y[a : a + n], seed=i)
        acc.add(u.delta, u.num_examples)
    return acc.mean()


def round_batched(batched: BatchedTrainer, g, x, y, starts, sizes, device) -> torch.Tensor:
    acc = WeightedMean(batched.spec.numel, device)
    for _, u in batched.train(g, x, y, starts, sizes, list(range(len(sizes)))):
        acc.add(u.delta, u.num_examples)
    return acc.mean()


def print_result(case: str, device: torch.device, s_round: float, over_seq: float) -> None:
    """One case as a ``RESULT {json}`` line, which bench/gpu_summary.py reads for the GPU suite's summary."""
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fields = {"bench": "batched_layers", "card": card, "case": case, "s_per_round": s_round}
    print("RESULT " + json.dumps(fields | {"x_one_by_one": over_seq}), flush=True)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"


def bench_gru(args, device: torch.device, cfg: TrainConfig) -> None:
    torch.manual_seed(0)
    trainer = LocalTrainer(GRUClassifier().to(device), cfg, device)
    n = args.samples
    x, y = data(args.clients * n, (SEQ, FEATURES), SEQ_CLASSES, device)
    batched = make_batched_trainer(
        "auto", trainer.model, trainer.spec, cfg, device, (SEQ, FEATURES), args.per_round, n, not args.no_cuda_graphs
    )
    if batched is None:
        print("gru: the batched trainer declined this model (see the log line above)")
        return
    g = trainer.flat.detach().clone()
    rounds = [sorted(random.Random(r).sample(range(args.clients), args.per_round)) for r in range(args.repeats)]
    picks = iter(rounds * 2)
    cohort: list[int] = []

    def next_round() -> tuple[list[int], list[int]]:
        return [i * n for i in cohort], [n] * len(cohort)

    cohort = rounds[0]
    w = next_round()
    round_seq(trainer, g, x, y, w[0][:2], w[1][:2], device)  # warm-up: kernels, allocator
    want = round_seq(trainer, g, x, y, *w, device)
    got = round_batched(batched, g, x, y, *w, device)
    diff = (got - want).abs().max().item()

    def seq() -> None:
        nonlocal cohort
        cohort = next(picks)
        round_seq(trainer, g, x, y, *next_round(), device)

    def bat() -> None:
        round_batched(batched, g, x, y, *next_round(), device)  # the same cohort as seq just had

    t_seq, t_bat = timed([seq, bat], device, args.repeats)
    print(
        f"gru  {args.clients} clients, {args.per_round} a round, {n} sequences each, chunk {batched.max_clients}: "
        f"one by one {t_seq:.3f} s/round, batched {t_bat:.3f} s/round, batched is {t_seq / t_bat:.2f}x faster "
        f"(max |batched - one by one| of the mean update {diff:.1e}; load {load()})",
        flush=True,
    )
    print_result("gru", device, t_bat, t_seq / t_bat)


def bench_attn(args, device: torch.device, cfg: TrainConfig) -> None:
    torch.manual_seed(0)
    trainer = LocalTrainer(EncoderClassifier().to(device), cfg, device)
    k, n = args.per_round, args.samples
    x, y = data(k * n, (SEQ, FEATURES), SEQ_CLASSES, device)
    starts, sizes = [i * n for i in range(k)], [n] * k
    g = trainer.flat.detach().clone()
    graphs = not args.no_cuda_graphs
    standin = BatchedTrainer(trainer.model, trainer.spec, cfg, device, k, graphs)
    stock = BatchedTrainer(trainer.model, trainer.spec, cfg, device, k, graphs)
    stock.batchable = copy.deepcopy(trainer.model).train()  # torch's attention under vmap, nothing swapped
    m = min(k, args.seq_cap)
    round_seq(trainer, g, x, y, starts[:1], sizes[:1], device)  # warm-up
    round_batched(standin, g, x, y, starts[:2], sizes[:2], device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vmap's "performance drop" warning for the stock kernel
        round_batched(stock, g, x, y, starts[:2], sizes[:2], device)
        t_seq, t_standin, t_stock = timed(
            [
                lambda: round_seq(trainer, g, x, y, starts[:m], sizes[:m], device),
                lambda: round_batched(standin, g, x, y, starts, sizes, device),
                lambda: round_batched(stock, g, x, y, starts, sizes, device),
            ],
            device,
            args.repeats,
        )
    seq_round = t_seq * k / m
    print(
        f"attn {k} clients, {n} sequences each: one by one {seq_round:.3f} s/round"
        + (f" (timed on {m})" if m < k else "")
        + f", batched with torch's attention {t_stock:.3f} s/round ({seq_round / t_stock:.2f}x), "
        f"batched with the stand-in {t_standin:.3f} s/round ({seq_round / t_standin:.2f}x; load {load()})",
        flush=True,
    )
    print_result("attn", device, t_standin, seq_round / t_standin)


def bench_cnn(args, device: torch.device, cfg: TrainConfig) -> None:
    torch.manual_seed(0)
    shape = (1, 28, 28)
    trainer = LocalTrainer(build_model("cnn", shape, 10).to(device), cfg, device)
    k, n = args.cnn_clients, args.cnn_samples
    x, y = data(k * n, shape, 10, device)
    starts, sizes = [i * n for i in range(k)], [n] * k
    g = trainer.flat.detach().clone()
    trainers = {
        conv: BatchedTrainer(trainer.model, trainer.spec, cfg, device, k, not args.no_cuda_graphs, conv)
        for conv in ("grouped", "matmul")
    }
    m = min(k, args.seq_cap)
    round_seq(trainer, g, x, y, starts[:1], sizes[:1], device)  # warm-up
    want = round_seq(trainer, g, x, y, starts, sizes, device) if m == k else None
    diffs = {}
    for conv, b in trainers.items():
        got = round_batched(b, g, x, y, starts, sizes, device)
        diffs[conv] = f"{(got - want).abs().max().item():.1e}" if want is not None else "-"
    t_seq, t_grouped, t_matmul = timed(
        [
            lambda: round_seq(trainer, g, x, y, starts[:m], sizes[:m], device),
            lambda: round_batched(trainers["grouped"], g, x, y, starts, sizes, device),
            lambda: round_batched(trainers["matmul"], g, x, y, starts, sizes, device),
        ],
        device,
        args.repeats,
    )
    seq_round = t_seq * k / m
    print(
        f"cnn  {k} clients, {n} images each: one by one {seq_round:.3f} s/round"
        + (f" (timed on {m})" if m < k else "")
        + f", grouped {t_grouped:.3f} s/round ({seq_round / t_grouped:.2f}x), matmul {t_matmul:.3f} s/round "
        f"({seq_round / t_matmul:.2f}x); matmul / grouped time {t_matmul / t_grouped:.2f} "
        f"(max |batched - one by one| grouped {diffs['grouped']}, matmul {diffs['matmul']}; load {load()})",
        flush=True,
    )
    print_result("cnn_grouped", device, t_grouped, seq_round / t_grouped)
    print_result("cnn_matmul", device, t_matmul, seq_round / t_matmul)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--cases", default="gru,attn,cnn", help="any of gru, attn, cnn")
    ap.add_argument("--clients", type=int, default=400, help="gru: clients in the pool")
    ap.add_argument("--per-round", type=int, default=100, help="gru, attn: clients a round")
    ap.add_argument("--samples", type=int, default=0, help="gru, attn: sequences per client (default 600 CUDA, 60 CPU)")
    ap.add_argument("--cnn-clients", type=int, default=0, help="cnn: clients a round (default 100 CUDA, 10 CPU)")
    ap.add_argument("--cnn-samples", type=int, default=0, help="cnn: images per client (default 600 CUDA, 20 CPU)")
    ap.add_argument("--seq-cap", type=int, default=0, help="cnn: time one by one on at most this many (default 20)")
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3, help="time each way this many times, keep the best")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's)")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="batched steps eager on a GPU (default: replayed)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke size: 100 clients, 20 a round, 2 repeats")
    args = ap.parse_args()
    device = select_device(args.device)
    cuda = device.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.clients, args.per_round, args.repeats = 100, 20, 2
    args.samples = args.samples or (600 if cuda else 60)
    args.cnn_clients = args.cnn_clients or (100 if cuda else 10)
    args.cnn_samples = args.cnn_samples or (600 if cuda else 20)
    args.seq_cap = args.seq_cap or 20
    cfg = TrainConfig(epochs=1, batch_size=args.batch_size, lr=0.05)
    print(
        f"device {device}"
        + (
            f" ({torch.cuda.get_device_name(device)})"
            if cuda
            else f" ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
        )
        + f", B = {args.batch_size}, 1 local epoch, plain SGD, fp32, best of {args.repeats}"
        + (f", CUDA graphs {'off' if args.no_cuda_graphs else 'on'}" if cuda else "")
    )
    cases = args.cases.split(",")
    if "gru" in cases:
        bench_gru(args, device, cfg)
    if "attn" in cases:
        bench_attn(args, device, cfg)
    if "cnn" in cases:
        bench_cnn(args, device, cfg)


if __name__ == "__main__":
    main()
