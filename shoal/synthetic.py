"""Synthetic(alpha, beta) of Li et al. 2020 (FedProx, Section 5.1): tunable heterogeneity.

Follows the semantics of the FedProx generator (``data/synthetic_*/generate_synthetic.py``):
for device k, u_k ~ N(0, alpha) and B_k ~ N(0, beta); W_k (10x60) and b_k ~ N(u_k, 1)
elementwise; v_k[j] ~ N(B_k, 1); x ~ N(v_k, Sigma) with Sigma diagonal, Sigma_jj = j^-1.2;
y = argmax(softmax(W_k x + b_k)). As in that code, alpha and beta are standard
deviations (the same as variances at the usual 0 and 1). alpha controls how much the
local models differ, beta how much the local inputs differ. The IID variant shares one
W, b ~ N(0, 1) and uses v_k = 0 on every device.

Device sizes follow FedProx's power law, lognormal(4, 2) + 50, capped at
``MAX_SAMPLES_PER_DEVICE``: the uncapped tail reaches tens of thousands of samples on
one device, which would make the default 30-client experiment slow for no insight.
"""

from __future__ import annotations

import numpy as np
import torch

from .seeding import rng
from .task import Population

DIMENSION = 60
NUM_CLASSES = 10
MAX_SAMPLES_PER_DEVICE = 2000
# streams of SyntheticPopulation (apart from each other and from client sampling)
_SIZES, _SHARED, _CLIENT = 0x512E, 0x5A4ED, 0xC11E


def device_sizes(num_devices: int, rng: np.random.Generator) -> np.ndarray:
    """Samples per device: FedProx's lognormal(4, 2) + 50, capped (see module docstring)."""
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    return np.minimum(sizes, MAX_SAMPLES_PER_DEVICE)


def generate(
    num_devices: int,
    alpha: float,
    beta: float,
    iid: bool,
    rng: np.random.Generator,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One (x float32 (n_k, 60), y int64 (n_k,)) pair per device."""
    sizes = device_sizes(num_devices, rng)
    std_x = np.arange(1, DIMENSION + 1, dtype=np.float64) ** -0.6  # sqrt of Sigma_jj = j^-1.2
    if iid:
        w_shared = rng.normal(0.0, 1.0, (NUM_CLASSES, DIMENSION))
        b_shared = rng.normal(0.0, 1.0, NUM_CLASSES)
    else:
        u = rng.normal(0.0, alpha, num_devices)
        big_b = rng.normal(0.0, beta, num_devices)
    devices = []
    for k, n in enumerate(sizes):
        if iid:
            w, b, v = w_shared, b_shared, np.zeros(DIMENSION)
        else:
            w = rng.normal(u[k], 1.0, (NUM_CLASSES, DIMENSION))
            b = rng.normal(u[k], 1.0, NUM_CLASSES)
            v = rng.normal(big_b[k], 1.0, DIMENSION)
        x = v + rng.standard_normal((int(n), DIMENSION)) * std_x
        y = np.argmax(x @ w.T + b, axis=1)  # softmax is monotone: its argmax is the logits'
        devices.append((x.astype(np.float32), y.astype(np.int64)))
    return devices


class SyntheticPopulation(Population):
    """Synthetic(alpha, beta) as a population whose client k is generated from ``(seed, k)``
    alone, so any client can be made on demand, in any process, without the others.

    Sizes come from one lognormal stream drawn once for all clients (a prefix of the same
    stream for fewer clients, so client k has the same size in every population size);
    each client's model, input mean and samples from its own stream. The last fifth of a
    client's samples (``n // 5``) is its test data. Same distributions as :func:`generate`,
    different draws.
    """

    def __init__(self, num_clients: int, alpha: float = 1.0, beta: float = 1.0, iid: bool = False, seed: int = 0):
        self.n, self.alpha, self.beta, self.iid, self.seed = num_clients, alpha, beta, iid, seed
        self.sizes = device_sizes(num_clients, rng(seed, _SIZES))
        shared = rng(seed, _SHARED)
        self.w_shared = shared.normal(0.0, 1.0, (NUM_CLASSES, DIMENSION))
        self.b_shared = shared.normal(0.0, 1.0, NUM_CLASSES)

    def __len__(self) -> int:
        return self.n

    def client_id(self, i: int) -> str:
        return f"client-{i:05d}"

    def num_examples(self, i: int) -> int:
        n = int(self.sizes[i])
        return n - n // 5

    def samples(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """All of client k's samples (train then test), from its own stream."""
        g = rng(self.seed, _CLIENT, k)
        if self.iid:
            w, b, v = self.w_shared, self.b_shared, np.zeros(DIMENSION)
        else:
            u, big_b = g.normal(0.0, self.alpha), g.normal(0.0, self.beta)
            w = g.normal(u, 1.0, (NUM_CLASSES, DIMENSION))
            b = g.normal(u, 1.0, NUM_CLASSES)
            v = g.normal(big_b, 1.0, DIMENSION)
        std_x = np.arange(1, DIMENSION + 1, dtype=np.float64) ** -0.6
        x = v + g.standard_normal((int(self.sizes[k]), DIMENSION)) * std_x
        y = np.argmax(x @ w.T + b, axis=1)
        return x.astype(np.float32), y.astype(np.int64)

    def train_data(self, i: int):
        x, y = self.samples(i)
        n = self.num_examples(i)
        return torch.from_numpy(x[:n]), torch.from_numpy(y[:n])

    def test_data(self, i: int):
        x, y = self.samples(i)
        n = self.num_examples(i)
        return torch.from_numpy(x[n:]), torch.from_numpy(y[n:])
