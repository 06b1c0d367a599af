"""Your own task, example 4: fine-tune a frozen "pretrained" model with small LoRA adapters.

The pattern of LoRA / PEFT fine-tuning: a large base model stays frozen
(``requires_grad = False``) and only small low-rank adapters train. shoal exchanges only
trainable parameters (and float buffers), so frozen weights never travel: each update on
the wire holds the adapters alone (``bytes_up`` in metrics.jsonl, per result, is 4 bytes
per adapter parameter plus a small header). Aggregation, secure aggregation and DP work on
that exchanged part only.

Run it (from the repository root)::

    shoal simulate --task examples/tasks/adapter.py:task --set simulation.rounds=20

The "pretrained" base is an MLP whose weights are drawn from a fixed generator
(``PRETRAINED_SEED``), the same on every node and for every ``simulation.seed``, as a
downloaded checkpoint would be. The downstream task it is fine-tuned for labels inputs by a
slightly different network: the base with a fixed low-rank change to each weight matrix,
which is what rank-``rank`` adapters can learn. Each client's inputs are centred
differently (a non-IID feature shift). The simulation data are generated from the seed;
this example runs in ``shoal simulate`` only (no ``local_data``).

Task arguments (``[task.args]``): ``rank`` (4), ``alpha`` (8.0: the adapters' output is
scaled by alpha / rank), ``in_dim`` (32), ``hidden`` (256), ``classes`` (10), ``rows``
(200 training rows per client, plus a quarter as many test rows).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shoal.task import SimulationData, Task

PRETRAINED_SEED = 20240601  # the "checkpoint": fixed, whatever the simulation's seed
DOWNSTREAM_SEED = 7  # the low-rank change that defines the task being fine-tuned for


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update: W x + (alpha / r) B A x."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # zero: training starts at the base
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def pretrained_base(in_dim: int, hidden: int, classes: int) -> nn.Sequential:
    """The frozen base: an MLP initialised from PRETRAINED_SEED (not from the global RNG)."""
    g = torch.Generator().manual_seed(PRETRAINED_SEED)
    layers: list[nn.Module] = []
    dims = [in_dim, hidden, hidden, classes]
    for i, (a, b) in enumerate(zip(dims, dims[1:])):
        layer = nn.Linear(a, b)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(b, a, generator=g) * math.sqrt(2.0 / a))
            layer.bias.copy_(0.1 * torch.randn(b, generator=g))
        layers += [layer, nn.ReLU()] if i < len(dims) - 2 else [layer]
    base = nn.Sequential(*layers)
    with torch.no_grad():  # centre the output logits, so that no class dominates the base's predictions
        base[-1].bias.sub_(base(torch.randn(4096, in_dim, generator=g)).mean(0))
    return base.requires_grad_(False)


def downstream_teacher(in_dim: int, hidden: int, classes: int) -> nn.Sequential:
    """The network that labels the downstream data: the base with a rank-2 change per layer."""
    teacher = pretrained_base(in_dim, hidden, classes)
    g = torch.Generator().manual_seed(DOWNSTREAM_SEED)
    with torch.no_grad():
        for layer in teacher:
            if isinstance(layer, nn.Linear):
                out_f, in_f = layer.weight.shape
                u, v = torch.randn(out_f, 2, generator=g), torch.randn(2, in_f, generator=g)
                layer.weight.add_(u @ v * (0.6 / math.sqrt(in_f)))
    return teacher


class Adapted(nn.Module):
    """The base with every linear layer wrapped by a LoRA adapter."""

    def __init__(self, base: nn.Sequential, rank: int, alpha: float):
        super().__init__()
        self.layers = nn.Sequential(*[LoRALinear(m, rank, alpha) if isinstance(m, nn.Linear) else m for m in base])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Adapter(Task):
    def __init__(
        self, rank: int = 4, alpha: float = 8.0, in_dim: int = 32, hidden: int = 256, classes: int = 10, rows: int = 200
    ):
        self.rank, self.alpha, self.rows = rank, alpha, rows
        self.in_dim, self.hidden, self.classes = in_dim, hidden, classes
        self.num_classes = classes

    def describe(self) -> str:
        return f"LoRA rank {self.rank} on a frozen {self.hidden}-wide MLP"

    def model(self) -> nn.Module:
        return Adapted(pretrained_base(self.in_dim, self.hidden, self.classes), self.rank, self.alpha)

    # Default loss (cross-entropy) and metrics (loss, accuracy).

    def simulation_data(self, num_clients: int, seed: int) -> SimulationData:
        teacher = downstream_teacher(self.in_dim, self.hidden, self.classes)
        g = torch.Generator().manual_seed(seed)
        train, tests = [], []
        for _ in range(num_clients):
            centre = 0.5 * torch.randn(self.in_dim, generator=g)  # this client's own input distribution
            x = centre + torch.randn(self.rows + self.rows // 4, self.in_dim, generator=g)
            with torch.no_grad():
                y = teacher(x).argmax(-1)
            train.append((x[: self.rows], y[: self.rows]))
            tests.append((x[self.rows :], y[self.rows :]))
        central = (torch.cat([t[0] for t in tests]), torch.cat([t[1] for t in tests]))
        return SimulationData(train=train, test=central, client_test=tests)


task = Adapter
