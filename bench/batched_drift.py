"""Why the batched and one-by-one simulator paths drift apart at some learning rates.

`python bench/batched_drift.py [--lr 0.01 0.05] [--rounds 3]`: logistic regression on
Synthetic(1,1), 100 clients all selected, B = 10, seed 5 (OMP_NUM_THREADS=1 for repeatable
figures). For each lr it prints the largest difference between the two paths' global models
after each round; then, from the one-by-one model after round 1, it trains every client both
ways, takes the client whose two updates differ most, and compares each with a float64
reference (the same batches, plain SGD through autograd), and the reference with itself
started one float32 rounding away. Where local training is stable the two float32 paths agree
with each other and with float64 to ~1e-7; where a client's local training is unstable (its
loss rises) every float32 rounding grows step by step, in either path: the gap is the dynamics,
not the batching (docs: README "batch_clients").
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from shoal.client.batched import BatchedTrainer
from shoal.config import load_config
from shoal.simulations.inprocess import InProcessSimulation


def config(lr: float, batch: str):
    return load_config(
        None,
        [
            "simulation.num_clients=100",
            "simulation.clients_per_round=100",
            "simulation.seed=5",
            "simulation.progress=false",
            f"simulation.batch_clients={batch}",
            f"train.lr={lr}",
            "train.batch_size=10",
        ],
    )


def sgd64(model, start: torch.Tensor, x, y, seed: int, lr: float, bs: int) -> tuple[list[torch.Tensor], list[float]]:
    """Plain SGD in float64 with LocalTrainer's batches: the parameters after each step, the losses."""
    m = copy.deepcopy(model).double()
    ps = list(m.parameters())
    with torch.no_grad():
        off = 0
        for p in ps:
            p.copy_(start[off : off + p.numel()].view_as(p))
            off += p.numel()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    trace, losses = [], []
    for s in range(0, len(y), bs):
        idx = perm[s : s + bs]
        loss = F.cross_entropy(m(x[idx].double()), y[idx])
        m.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in ps:
                p.add_(p.grad, alpha=-lr)
        trace.append(torch.cat([p.detach().flatten() for p in ps]).clone())
        losses.append(float(loss.detach()))
    return trace, losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[0.01, 0.05])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for lr in args.lr:
        one = InProcessSimulation.from_config(config(lr, "1"))
        bat = InProcessSimulation.from_config(config(lr, "auto"))
        diffs = []
        for _ in range(args.rounds):
            one.run_round()
            bat.run_round()
            diffs.append(float((one.global_params - bat.global_params).abs().max()))
        print(f"lr {lr}: global models, batched vs one by one, after rounds 1..{args.rounds}: "
              + ", ".join(f"{d:.2g}" for d in diffs))  # fmt: skip

        sim = InProcessSimulation.from_config(config(lr, "1"))
        sim.run_round()
        g, tr = sim.global_params.clone(), sim.trainer
        n = len(sim.shards)
        x, y, starts, sizes = sim.shards.gather(list(range(n)))
        seeds = [1000 + i for i in range(n)]
        batched = dict(BatchedTrainer(tr.model, tr.spec, tr.cfg, "cpu", n).train(g, x, y, starts, sizes, seeds))
        worst = (-1.0, 0, g, g)
        for i in range(n):
            a, k = starts[i], sizes[i]
            d1 = tr.train(g, x[a : a + k], y[a : a + k], seeds[i]).delta
            gap = float((d1 - batched[i].delta).abs().max())
            if gap > worst[0]:
                worst = (gap, i, d1, batched[i].delta)
        gap, i, d1, db = worst
        a, k = starts[i], sizes[i]
        trace, losses = sgd64(tr.model, g.double(), x[a : a + k], y[a : a + k], seeds[i], lr, tr.cfg.batch_size)
        ref = trace[-1] - g.double()
        nudge = g.double() * 2.0**-24 * torch.randn(g.numel(), generator=torch.Generator().manual_seed(0)).sign()
        moved, _ = sgd64(tr.model, g.double() + nudge, x[a : a + k], y[a : a + k], seeds[i], lr, tr.cfg.batch_size)
        growth = [float((p - q).abs().max()) for p, q in zip(trace, moved)]
        print(f"  worst client {i}: {k} examples, {len(losses)} steps, loss first {losses[0]:.3g}, "
              f"max {max(losses):.3g}, last {losses[-1]:.3g}")  # fmt: skip
        print(f"    one by one vs batched {gap:.2g}; vs float64: one by one {float((d1.double() - ref).abs().max()):.2g}, "
              f"batched {float((db.double() - ref).abs().max()):.2g}")  # fmt: skip
        marks = [s for s in (1, 10, 50, 100, len(growth)) if s <= len(growth)]
        print(f"    float64 started {float(nudge.abs().max()):.2g} away (one float32 rounding): after steps "
              + ", ".join(f"{s}: {growth[s - 1]:.2g}" for s in marks))  # fmt: skip


if __name__ == "__main__":
    main()
