"""Local differential privacy on a client: DP-SGD (Abadi et al. 2016) with Opacus.

Each local step draws a Poisson sample of the client's examples (rate q = B / n_k, or
``privacy.local_sampling_rate``: the accountant's assumption), and Opacus computes per-sample
gradients (``GradSampleModule``), clips each to ``privacy.clip_norm`` and adds N(0, z² C²) to
their sum (``DPOptimizer``), divided by the expected batch size B. The update the client sends
is then differentially private with respect to each of its examples, whatever the server
does with it. A round is a fixed number of such steps by default (``privacy.local_schedule =
"steps"``), so how long it takes does not tell how many examples the client holds.

The flat-buffer binding stays: the model's parameters remain views of the trainer's
flat buffer, Opacus writes fresh ``.grad`` tensors and torch's SGD updates the
parameters in place, so the update is still ``flat - global`` with no copy. Models Opacus
cannot handle (BatchNorm mixes examples of a batch) are fixed with
``ModuleValidator.fix`` (BatchNorm -> GroupNorm), with a log message; the server's global
model must be built the same way (the simulator builds one model for both).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from opacus import GradSampleModule
from opacus.optimizers import DPOptimizer
from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
from opacus.validators import ModuleValidator
from torch import nn

from shoal.accounting_dpsgd import local_schedule
from shoal.client.training import LocalTrainer, Objective
from shoal.config import PrivacyConfig, TrainConfig
from shoal.errors import ConfigError
from shoal.noise import NoiseSource
from shoal.seeding import derive_seed
from shoal.task import LOSS_PART, Task, call_part
from shoal.update import Update

log = logging.getLogger(__name__)


def fix_for_opacus(model: nn.Module) -> nn.Module:
    """The model, or a copy Opacus can train (e.g. BatchNorm -> GroupNorm), with a message."""
    if not ModuleValidator.validate(model, strict=False):
        return model
    fixed = ModuleValidator.fix(model)
    before = Counter(type(m).__name__ for m in model.modules())
    after = Counter(type(m).__name__ for m in fixed.modules())
    log.warning(
        "DP-SGD: the model was changed so that per-sample gradients exist: %s replaced by %s; "
        "the server's global model uses the same layers",
        ", ".join(sorted((before - after).elements())),
        ", ".join(sorted((after - before).elements())),
    )
    remaining = ModuleValidator.validate(fixed, strict=False)
    if remaining:
        raise ConfigError(f"model.name: Opacus cannot train this model even after fixing it: {remaining}")
    return fixed


class CsprngDPOptimizer(DPOptimizer):
    """Opacus' DPOptimizer whose per-step noise comes from a :class:`~shoal.noise.NoiseSource` (an
    AES-CTR CSPRNG keyed from the OS, each entry a sum of four Box-Muller draws against the
    floating-point attack) when :attr:`noise_source` is set; Opacus' own draw from its torch
    generator otherwise (``privacy.reproducible``). One CSPRNG call covers all the model's
    parameters of a step; on a CUDA device the noise is made there from the source's device stream
    (ChaCha20 keyed from its AES stream, shoal/chacha20.py), so no keystream crosses the bus."""

    noise_source: NoiseSource | None = None

    def add_noise(self) -> None:  # noqa: D102
        src = self.noise_source
        if src is None:
            super().add_noise()
            return
        params = self.params
        for p in params:
            _check_processed_flag(p.summed_grad)
        first = params[0].summed_grad
        noise = torch.empty(sum(p.summed_grad.numel() for p in params), dtype=first.dtype, device=first.device)
        src.gaussian_into(noise, self.noise_multiplier * self.max_grad_norm)
        offset = 0
        for p in params:
            g = p.summed_grad
            p.grad = (g + noise[offset : offset + g.numel()].view_as(g).to(g.device, g.dtype)).view_as(p)
            offset += g.numel()
            _mark_as_processed(p.summed_grad)


class DpSgdTrainer(LocalTrainer):
    """LocalTrainer whose steps are DP-SGD: per-sample clipping + Gaussian noise (Opacus)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: TrainConfig,
        privacy: PrivacyConfig,
        device: torch.device | str = "cpu",
        task: Task | None = None,
    ):
        if cfg.prox_mu:
            raise ConfigError("train.prox_mu must be 0 with privacy.mode = 'local' (DP-SGD trains plain SGD)")
        if task is not None and task.optimizer is not None:
            raise ConfigError(
                f"task optimizer = {task.optimizer!r} with privacy.mode = 'local': DP-SGD brings its "
                "own optimizer (Opacus' DPOptimizer over SGD); leave the task's optimizer unset"
            )
        super().__init__(fix_for_opacus(model), cfg, device, task=task)
        self.privacy = privacy
        if privacy.local_schedule == "epochs":
            log.warning(
                "DP-SGD: privacy.local_schedule = 'epochs' runs train.epochs * round(n / B) steps a round, so "
                "the round's duration reveals this client's example count n (not covered by the epsilon); "
                "the default 'steps' runs a fixed number"
            )
        self.grad_sample_module = GradSampleModule(self.model, loss_reduction="mean")
        self._sgd = torch.optim.SGD(
            self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
        # The canary audit's hook (simulations/canary_audit.py): the flat per-example gradient of
        # one extra example, Poisson-sampled like the others and clipped and noised with them
        self.gradient_canary: torch.Tensor | None = None
        self._noise_gen = torch.Generator(device=self.device)
        self._dp_opt = CsprngDPOptimizer(
            self._sgd,
            noise_multiplier=privacy.noise_multiplier,
            max_grad_norm=privacy.clip_norm,
            expected_batch_size=1,
            loss_reduction="mean",
            generator=self._noise_gen,
            # privacy.reproducible: Opacus' single draw per entry from the seeded generator, so seeded runs
            # repeat the numbers they gave before; otherwise train() sets a CSPRNG noise source per task
            secure_mode=False,
        )

    def train_dataset(self, global_flat, dataset, seed, base_version=0, sender="", objective=None):  # noqa: D102
        raise ConfigError(
            "privacy.mode = 'local' (DP-SGD) needs the client's data as (x, y) tensors: Poisson "
            "sampling of examples draws from the whole local set; return tensors from the task"
        )

    def train(
        self,
        global_flat: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        seed: int,
        base_version: int = 0,
        sender: str = "",
        objective: Objective | None = None,
    ) -> Update:
        """DP-SGD steps on Poisson samples from ``global_flat``, on the schedule the accountant charges
        (:func:`~shoal.accounting_dpsgd.local_schedule`): by default ``privacy.local_steps`` steps of rate
        B / n (or ``privacy.local_sampling_rate``), whatever n is."""
        if objective is not None:  # config rules refuse [algorithm] with privacy.mode = 'local'
            raise ConfigError("DP-SGD (privacy.mode = 'local') trains plain local SGD; it takes no algorithm objective")
        cfg, flat = self.cfg, self.flat
        global_flat = global_flat.to(self.device)
        flat.copy_(global_flat)
        self._sgd.state.clear()  # momentum starts at zero for every client
        n = int(y.shape[0])
        q, steps = local_schedule(n, cfg, self.privacy)
        # the noisy sum is divided by B; with a fixed rate or a fixed step count by the configured B (never by
        # n_k: the step's scale would then depend on the data, outside the analysis)
        fixed = self.privacy.local_sampling_rate > 0 or self.privacy.local_schedule == "steps"
        self._dp_opt.expected_batch_size = self._public_batch() if fixed else cfg.batch(n)
        # privacy.reproducible: noise and batches from the task's seed; otherwise both from a CSPRNG
        # (shoal.noise) keyed with 256 bits from the OS
        src = None if self.privacy.reproducible else NoiseSource()
        self._dp_opt.noise_source = src
        if src is None:
            self._noise_gen.manual_seed(derive_seed(seed, 1))
        gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
        loss_sum, sampled = 0.0, 0
        canary = self.gradient_canary
        self.grad_sample_module.train()
        for _ in range(steps):
            m = n + (canary is not None)
            draws = torch.rand(m, generator=gen) < q if src is None else torch.from_numpy(src.uniform(m) < q)
            idx = torch.nonzero(draws[:n]).squeeze(1).to(self.device)
            self._dp_opt.zero_grad(set_to_none=True)
            if len(idx) == 0:
                # An empty Poisson sample still takes a step: zero gradient, full noise.
                for p in self.model.parameters():
                    p.grad_sample = torch.zeros((1, *p.shape), device=p.device, dtype=p.dtype)  # type: ignore[attr-defined]  # Opacus's per-sample gradient field
            else:
                loss = call_part(self.task, LOSS_PART, self.task.loss, self.grad_sample_module, x[idx], y[idx])
                loss.backward()
                self._zero_non_finite_examples()
                loss_sum += float(loss.detach()) * len(idx)
                sampled += len(idx)
            if canary is not None and bool(draws[n]):
                self._add_sample_gradient(canary)
            self._dp_opt.step()
        self._dp_opt.zero_grad(set_to_none=True)
        delta = flat - global_flat
        metrics = {"train_loss": loss_sum / max(sampled, 1), "local_steps": float(steps)}
        return Update(delta=delta, num_examples=n, base_version=base_version, sender=sender, metrics=metrics)

    def _zero_non_finite_examples(self) -> None:
        """An example whose per-sample gradient has a NaN or Inf entry contributes 0 (before Opacus clips):
        the clipped sum is then defined for every example (sensitivity C), so the noised update, and
        anything judged from it, never tells that one example's gradient went non-finite."""
        params = [p for p in self.model.parameters() if getattr(p, "grad_sample", None) is not None]
        bad: torch.Tensor | None = None
        for p in params:
            gs = p.grad_sample  # type: ignore[attr-defined]  # Opacus's per-sample gradient field
            row_bad = ~torch.isfinite(gs.reshape(gs.shape[0], -1)).all(dim=1)
            bad = row_bad if bad is None else bad | row_bad
        if bad is not None and bool(bad.any()):
            for p in params:
                p.grad_sample[bad] = 0  # type: ignore[attr-defined]

    def _public_batch(self) -> int:
        """train.batch_size as a number that does not depend on the data (config rules refuse a full batch)."""
        b = self.cfg.batch_size
        if not b or b == float("inf"):
            raise ConfigError(
                "privacy.mode = 'local' with privacy.local_schedule = 'steps' or privacy.local_sampling_rate needs "
                "a finite train.batch_size B: the noisy gradient sum is divided by B, which must not depend on a "
                "client's example count"
            )
        return int(b)

    def _add_sample_gradient(self, flat_grad: torch.Tensor) -> None:
        """One more per-sample gradient row (a flat vector over the model) before Opacus clips."""
        views = self.spec.views(flat_grad.to(self.device, self.flat.dtype))
        for name, p in self.model.named_parameters():
            if name in views and p.requires_grad:
                row = views[name].reshape(1, *p.shape)
                have = getattr(p, "grad_sample", None)
                p.grad_sample = row if have is None else torch.cat([have, row])  # type: ignore[attr-defined]
