"""Local training: E epochs of minibatch SGD from the global model on one client's data.

The model's parameters are views of one flat buffer (shoal.params), so the optimizer
step (momentum, weight decay, the FedProx proximal term) is a handful of vector ops on
that buffer, and the client's update is one subtraction. One trainer (one model
instance) serves every simulated client in turn: clients are data, not model copies.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from shoal.config import TrainConfig
from shoal.params import ParamSpec, bind_module, trainable_mask
from shoal.update import Update


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """``train.precision``: fp32 runs as is; bf16 runs the forward pass under autocast.

    Parameters, gradients and optimizer state stay float32 (mixed precision); only the
    matmuls/convolutions run in bfloat16, which tensor-core GPUs do several times faster.
    """
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class LocalTrainer:
    """Trains one bound model from a given global vector; reused across clients."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.spec = ParamSpec.of(self.model)
        self.flat, self.grad = bind_module(self.model, self.spec)
        self._momentum = torch.zeros_like(self.flat) if cfg.momentum > 0 else None
        # Weight decay and the proximal term act on trainable entries only.
        self._train_mask = trainable_mask(self.model, self.spec).to(self.device)
        self._all_trainable = bool(self._train_mask.all())

    def train(
        self,
        global_flat: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        seed: int,
        base_version: int = 0,
        sender: str = "",
    ) -> Update:
        """Run local training on (x, y) starting from ``global_flat``; return the Update.

        ``x``/``y`` should already be on the trainer's device (the simulator keeps all
        client data there once). Deterministic for a given seed on CPU.
        """
        cfg = self.cfg
        flat, grad, model = self.flat, self.grad, self.model
        global_flat = global_flat.to(self.device)
        flat.copy_(global_flat)
        if self._momentum is not None:
            self._momentum.zero_()
        n = int(y.shape[0])
        bs = cfg.batch(n)
        gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
        loss_sum = torch.zeros((), device=self.device)
        steps = 0
        model.train()
        for _ in range(cfg.epochs):
            perm = torch.randperm(n, generator=gen).to(self.device)
            for start in range(0, n, bs):
                idx = perm[start : start + bs]
                grad.zero_()
                with autocast(self.device, cfg.precision):
                    out = model(x[idx])
                loss = F.cross_entropy(out.float(), y[idx])
                loss.backward()
                self._step(global_flat)
                loss_sum += loss.detach()
                steps += 1
        delta = flat - global_flat
        metrics = {"train_loss": float(loss_sum) / max(steps, 1), "local_steps": float(steps)}
        return Update(delta=delta, num_examples=n, base_version=base_version, sender=sender, metrics=metrics)

    def _step(self, global_flat: torch.Tensor) -> None:
        cfg, flat, grad = self.cfg, self.flat, self.grad
        if cfg.weight_decay:
            grad.add_(self._masked(flat), alpha=cfg.weight_decay)
        if cfg.prox_mu:  # FedProx: gradient of (mu/2)||w - w_global||^2
            grad.add_(self._masked(flat - global_flat), alpha=cfg.prox_mu)
        step = grad
        if self._momentum is not None:
            step = self._momentum.mul_(cfg.momentum).add_(grad)
        flat.add_(step, alpha=-cfg.lr)

    def _masked(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._all_trainable else t * self._train_mask

    @torch.no_grad()
    def evaluate(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048) -> dict[str, float]:
        """Loss and accuracy of ``params`` on (x, y); leaves the trainer's buffer changed."""
        self.flat.copy_(params.to(self.device))
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        n = int(y.shape[0])
        for start in range(0, n, batch_size):
            xb, yb = x[start : start + batch_size].to(self.device), y[start : start + batch_size].to(self.device)
            out = self.model(xb)
            loss_sum += F.cross_entropy(out, yb, reduction="sum").double()
            correct += (out.argmax(1) == yb).sum()
        return {"loss": float(loss_sum) / max(n, 1), "accuracy": float(correct) / max(n, 1)}
