"""Client-epochs per second of simulated local training: batched vs sequential vs bare torch.

One "round" = K clients, each starting from the same global model and running one local
epoch of SGD (B = 10) over its own samples, followed by the streaming weighted mean of
their deltas (what InProcessSimulation does per round). Three ways, side by side:

- ``bare``: the textbook loop (load_state_dict, torch.optim.SGD, zero_grad/backward/step)
  a user would write, one client after another;
- ``seq``: shoal's LocalTrainer (flat parameter buffer, one client after another);
- ``batched``: shoal's BatchedTrainer (K stacked models: the hand-written Linear/ReLU
  chain path for logreg and the 2NN in fp32, torch.func vmap otherwise), in chunks of the
  size ``simulation.batch_clients = auto`` picks (``--chunks`` times other sizes).

Data is MNIST-shaped random tensors (1x28x28, 10 classes) resident on the device, as in
the simulator; throughput does not depend on the pixel values. ``bare`` and ``seq`` cost
the same per client at any K, so for large K they are timed on the first ``--seq-cap``
clients only (printed); ``batched`` always trains all K. On CUDA the achieved FLOP/s
(counted with torch.utils.flop_counter on one step) is printed against the GPU's peak.

    python bench/sim_throughput.py                 # CPU: logreg, 2nn (K up to 1000), cnn (K up to 10)
    python bench/sim_throughput.py --quick         # logreg and 2nn at K = 10, 100 with 1 and 2 torch threads
    python bench/sim_throughput.py --models 2nn --ks 100 --chunks 1,4,12,25,100   # chunk-size sweep
    python bench/sim_throughput.py --device cuda   # all models up to K = 1000, 600 samples per client

The CPU header prints the load average: the machine may be shared, and every cell is the
best of ``--repeats`` runs, the three ways taking turns within each repeat.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shoal.aggregation.mean import WeightedMean  # noqa: E402
from shoal.client.batched import BatchedTrainer, clients_per_chunk  # noqa: E402
from shoal.client.device import select_device  # noqa: E402
from shoal.client.training import LocalTrainer, autocast  # noqa: E402
from shoal.config import TrainConfig  # noqa: E402
from shoal.models import build_model  # noqa: E402
from shoal.params import ParamSpec  # noqa: E402

SHAPE, CLASSES = (1, 28, 28), 10

# Dense peak TFLOP/s by GPU name fragment and precision, from the vendors' data sheets (SXM parts,
# without sparsity): fp32 without tensor cores, tf32 and bf16 on tensor cores. A missing entry is unknown.
PEAK_TFLOPS = {
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0},
    "A10G": {"fp32": 31.2, "bf16": 70.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.0},
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_clients(k: int, n: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    x = torch.rand((k * n, *SHAPE), generator=gen).to(device)
    y = torch.randint(0, CLASSES, (k * n,), generator=gen).to(device)
    return x, y, [i * n for i in range(k)], [n] * k


def run_bare(model, global_flat, spec, x, y, starts, sizes, cfg, device):
    """The loop one writes from the PyTorch tutorial, one client after another."""
    views = spec.views(global_flat)
    acc = WeightedMean(spec.numel, device)
    for i, (a, n) in enumerate(zip(starts, sizes)):
        model.load_state_dict(views)
        opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # fresh state per client
        gen = torch.Generator().manual_seed(i)
        perm = torch.randperm(n, generator=gen).to(device) + a
        for s in range(0, n, cfg.batch(n)):
            idx = perm[s : s + cfg.batch(n)]
            opt.zero_grad()
            with autocast(device, cfg.precision):
                out = model(x[idx])
            F.cross_entropy(out.float(), y[idx]).backward()
            opt.step()
        local = torch.cat([p.detach().flatten() for p in model.parameters()])
        acc.add(local - global_flat, n)
    return acc.mean()


def run_seq(trainer, global_flat, spec, x, y, starts, sizes, device):
    acc = WeightedMean(spec.numel, device)
    for i, (a, n) in enumerate(zip(starts, sizes)):
        u = trainer.train(global_flat, x[a : a + n], y[a : a + n], seed=i)
        acc.add(u.delta, u.num_examples)
    return acc.mean()


def run_batched(batched, global_flat, spec, x, y, starts, sizes, device):
    acc = WeightedMean(spec.numel, device)
    for _, u in batched.train(global_flat, x, y, starts, sizes, list(range(len(sizes)))):
        acc.add(u.delta, u.num_examples)
    return acc.mean()


def timed(fns, device, repeats: int) -> list[float]:
    """Best of ``repeats`` wall times of each of ``fns``, run in turn within each repeat.

    Interleaving puts the ways under the same load from other jobs on a shared machine;
    the minimum is the least disturbed run.
    """
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def flops_per_sample(model, cfg: TrainConfig, device: torch.device) -> float:
    """Forward + backward FLOPs of one training sample (torch.utils.flop_counter)."""
    from torch.utils.flop_counter import FlopCounterMode

    b = 10
    x = torch.rand((b, *SHAPE), device=device)
    y = torch.randint(0, CLASSES, (b,), device=device)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=False)
    return counter.get_total_flops() / b


def card_peak(card: str, precision: str) -> float | None:
    """The dense data-sheet peak (TFLOP/s) for ``precision`` of the card named ``card`` (as
    torch.cuda.get_device_name gives it), or None where the table does not know it."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in card:
            return peaks.get(precision)
    return None


def peak_tflops(device: torch.device, precision: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "given with --peak-tflops"
    name = torch.cuda.get_device_name(device)
    peak = card_peak(name, precision)
    if peak is not None:
        return peak, f"{name}, {precision} dense data-sheet peak"
    return None, f"{name}: {precision} peak unknown, pass --peak-tflops"


def print_result(name, k, samples, cfg, device, s_round, over_seq, flop_round, graphs, eager=None, conv="grouped"):
    """One cell as a ``RESULT {json}`` line, which bench/gpu_summary.py reads for the GPU suite's summary.
    ``eager``: the same round's seconds with CUDA graphs off, when timed beside it."""
    import json

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    fields = {"bench": "sim_throughput", "card": card, "model": name, "k": k, "samples": samples}
    fields |= {"batch_size": cfg.batch_size, "precision": cfg.precision, "s_per_round": s_round, "cuda_graphs": graphs}
    fields |= {"eager_s_per_round": eager, "conv": conv}
    print("RESULT " + json.dumps(fields | {"batched_over_seq": over_seq, "flop_per_round": flop_round}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--models", default="", help="default: logreg,2nn,cnn (--quick: logreg,2nn)")
    ap.add_argument("--ks", default="", help="clients per round (default 1,10,100,1000; --quick: 10,100)")
    ap.add_argument("--samples", type=int, default=0, help="samples per client (default: 600 on CUDA, 60 on CPU)")
    ap.add_argument("--batch-size", type=int, default=10)
    ap.add_argument("--precision", default="fp32", choices=("fp32", "tf32", "bf16"))
    ap.add_argument(
        "--batched-conv",
        default="grouped",
        help="simulation.batched_conv for the batched path: grouped, matmul, or both as grouped,matmul",
    )
    ap.add_argument(
        "--cuda-graphs",
        default="on",
        choices=("on", "off", "both"),
        help="batched steps as CUDA graph replays (on, as the simulator runs), eagerly (off), or both side by side",
    )
    ap.add_argument("--momentum", type=float, default=0.0, help="local SGD momentum (0: plain SGD, the fused update)")
    ap.add_argument(
        "--seq-cap", type=int, default=0, help="time bare/seq on at most this many clients (default 100 CUDA, 20 CPU)"
    )
    ap.add_argument("--cnn-all", action="store_true", help="on CPU also run the CNN at K >= 100 (slow)")
    ap.add_argument("--repeats", type=int, default=3, help="time each way this many times, keep the best")
    ap.add_argument(
        "--threads", default="", help="torch CPU threads to run with, e.g. 1,2 (--quick: 1,2; default: torch's)"
    )
    ap.add_argument("--chunks", default="", help="clients per batched chunk to time (default: what auto picks)")
    ap.add_argument("--vmap", action="store_true", help="batch Linear chains with vmap too (to compare the two paths)")
    ap.add_argument("--quick", action="store_true", help="logreg and 2nn, K = 10, 100, with 1 and 2 threads")
    ap.add_argument(
        "--no-cudnn-benchmark",
        action="store_true",
        help="turn off cuDNN's autotuner (select_device turns it on for a GPU, as the simulator runs)",
    )
    ap.add_argument("--tf32-matmul", action="store_true", help="torch.backends.cuda.matmul.allow_tf32 = True")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak, if not in the table")
    args = ap.parse_args()

    device = select_device(args.device)
    cuda = device.type == "cuda"
    if args.no_cudnn_benchmark:
        torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = args.tf32_matmul
    samples = args.samples or (600 if cuda else 60)
    models = (args.models or ("logreg,2nn" if args.quick else "logreg,2nn,cnn")).split(",")
    ks = [int(k) for k in (args.ks or ("10,100" if args.quick else "1,10,100,1000")).split(",")]
    default_threads = "1,2" if args.quick and not cuda else str(torch.get_num_threads())
    threads = [int(t) for t in (args.threads or default_threads).split(",")]
    seq_cap = args.seq_cap or (100 if cuda else 20)
    cfg = TrainConfig(epochs=1, batch_size=args.batch_size, lr=0.05, momentum=args.momentum, precision=args.precision)
    peak, peak_note = peak_tflops(device, args.precision, args.peak_tflops) if cuda else (None, "")
    print(
        f"device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if cuda else f" ({os.cpu_count()} cores)")
        + f", {samples} samples per client, B = {args.batch_size}, 1 local epoch, momentum {args.momentum}, {args.precision}"
        + (f", cudnn.benchmark {torch.backends.cudnn.benchmark}, TF32 matmul {args.tf32_matmul}" if cuda else "")
        + (f", CUDA graphs {args.cuda_graphs}" if cuda else "")
    )
    if cuda:
        print(f"peak: {peak} TFLOP/s ({peak_note})")
    head = (
        f"{'model':7} {'thr':>3} {'K':>5} {'path':>5} {'chunk':>5} {'bare ce/s':>10} {'seq ce/s':>9} {'batched ce/s':>12} "
        f"{'seq s/round':>11} {'batched s/round':>15} {'batched/seq':>11} {'batched/bare':>12} {'load':>5}"
    )
    if cuda:
        head += f" {'TFLOP/s':>8} {'of peak':>8}"
    print(head)
    notes: dict[str, str] = {}
    for n_threads in threads:
        if not cuda:
            torch.set_num_threads(n_threads)
        for name in models:
            torch.manual_seed(0)
            model = build_model(name, SHAPE, CLASSES).to(device)
            fps = flops_per_sample(model, cfg, device)
            trainer = LocalTrainer(model, cfg, device)
            spec: ParamSpec = trainer.spec
            g = trainer.flat.detach().clone()
            bare_model = build_model(name, SHAPE, CLASSES).to(device)
            fit = clients_per_chunk(trainer.model, spec, SHAPE, args.batch_size, device)
            for k in ks:
                if name == "cnn" and k >= 100 and not cuda and not args.cnn_all:
                    print(f"{name:7} {n_threads:>3} {k:>5}  skipped on CPU (pass --cnn-all)")
                    continue
                x, y, starts, sizes = make_clients(k, samples, device)
                m = min(k, seq_cap)
                chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [fit]
                convs = args.batched_conv.split(",") if name == "cnn" else ["grouped"]
                for chunk, conv in [(c, v) for c in chunks for v in convs]:
                    graphs = args.cuda_graphs != "off"
                    size = min(k, chunk)
                    batched = BatchedTrainer(trainer.model, spec, cfg, device, size, cuda_graphs=graphs, conv=conv)
                    eager = None
                    if args.cuda_graphs == "both" and cuda:
                        eager = BatchedTrainer(trainer.model, spec, cfg, device, size, cuda_graphs=False, conv=conv)
                    if args.vmap:
                        batched.chain = None
                        if eager is not None:
                            eager.chain = None
                    # warm-up (kernels, allocator) on a few clients, then best of r rounds each
                    w = min(k, 4)
                    run_bare(bare_model, g, spec, x, y, starts[:w], sizes[:w], cfg, device)
                    run_seq(trainer, g, spec, x, y, starts[:w], sizes[:w], device)
                    run_batched(batched, g, spec, x, y, starts[:w], sizes[:w], device)
                    ways = [
                        lambda: run_bare(bare_model, g, spec, x, y, starts[:m], sizes[:m], cfg, device),
                        lambda: run_seq(trainer, g, spec, x, y, starts[:m], sizes[:m], device),
                        lambda: run_batched(batched, g, spec, x, y, starts, sizes, device),
                    ]
                    if eager is not None:
                        run_batched(eager, g, spec, x, y, starts[:w], sizes[:w], device)
                        ways.append(lambda: run_batched(eager, g, spec, x, y, starts, sizes, device))
                    t_bare, t_seq, t_bat, *t_eager = timed(ways, device, args.repeats)
                    r_bare, r_seq, r_bat = m / t_bare, m / t_seq, k / t_bat
                    path = "chain" if batched.chain is not None else ("vmap" if conv == "grouped" else "mm")
                    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
                    line = (
                        f"{name:7} {n_threads if not cuda else '-':>3} {k:>5} {path:>5} {batched.max_clients:>5} "
                        f"{r_bare:>10.1f} {r_seq:>9.1f} {r_bat:>12.1f} {k / r_seq:>11.3f} {t_bat:>15.3f} "
                        f"{r_bat / r_seq:>10.2f}x {r_bat / r_bare:>11.2f}x {load:>5.1f}"
                    )
                    if cuda:
                        achieved = fps * samples * k / t_bat / 1e12
                        line += f" {achieved:>8.2f} " + (f"{100 * achieved / peak:>7.2f}%" if peak else f"{'?':>8}")
                    if m < k:
                        line += f"  (bare/seq timed on {m} of {k} clients)"
                    print(line, flush=True)
                    graphs_on = graphs and cuda and batched.step_graphs is not None
                    if t_eager:
                        print(
                            f"  CUDA graphs: {t_bat:.3f} s per round, eagerly {t_eager[0]:.3f} s: "
                            f"{t_eager[0] / t_bat:.2f}x"
                            + ("" if graphs_on else " (a capture failed: both ran eagerly)")
                        )
                    flop = fps * samples * k
                    t_off = t_eager[0] if t_eager else None
                    print_result(name, k, samples, cfg, device, t_bat, r_bat / r_seq, flop, graphs_on, t_off, conv)
                    if name == "cnn" and k == 1000 and samples == 600 and args.batch_size == 10:
                        limit = 1.0 if args.precision == "bf16" else 2.0
                        verdict = "met" if t_bat <= limit else "NOT met"
                        print(
                            f"  target: 1000 clients x 600 samples, CNN, B = 10, {args.precision}, {conv} convolutions: "
                            f"{t_bat:.2f} s per "
                            f"round (<= {limit:g} s: {verdict})"
                        )
                    batched = eager = None  # free the chunk before the next one
                x = y = None  # free the clients before the next K
            notes[name] = f"  {name}: {spec.numel:,} parameters, {fps / 1e6:.2f} MFLOP per training sample (fwd+bwd)"
    print("\n".join(notes.values()))
    print(
        f"ce/s = client-epochs per second; s/round = K clients' local epoch + the mean of their deltas (seq: "
        f"extrapolated from the clients timed); best of {args.repeats}; ratios are side by side in this run; "
        f"thr = torch threads; load = 1-minute load average after the cell."
    )


if __name__ == "__main__":
    main()
