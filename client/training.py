"""Local training: E epochs of minibatch SGD from the global model on one client's data.

The model's parameters are views of one flat buffer (shoal.params), so the optimizer
step (momentum, weight decay, the FedProx proximal term) is a handful of vector ops on
that buffer, and the client's update is one subtraction. One trainer (one model
instance) serves every simulated client in turn: clients are data, not model copies.

The loss, metrics and (optionally) the optimizer come from the task (shoal/task.py).
Data held as tensors is sliced in place (the fast path); any other torch Dataset is read
through a DataLoader whose sampler draws the same permutation from the same seed, so
both paths give the same update for the same data.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from shoal.config import TrainConfig
from shoal.params import ParamSpec, bind_module, trainable_mask
from shoal.seeding import derive_seed
from shoal.task import (
    LOSS_PART,
    ClientData,
    Task,
    TaskError,
    as_tensors,
    call_part,
    num_examples,
    split_batch,
    task_name,
    user_batches,
)
from shoal.update import Update

from .disk_model import DiskModel
from .runlog import RunTag

log = logging.getLogger(__name__)
log.addFilter(RunTag())  # lines of a federation run's work name the run


def autocast(device: torch.device, precision: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """``train.precision``: fp32 runs as is; bf16 runs the forward pass under autocast.

    Parameters, gradients and optimizer state stay float32 (mixed precision); only the
    matmuls/convolutions run in bfloat16, which tensor-core GPUs do several times faster.
    ``cache=False`` recasts the weights at every use: what a step recorded as a CUDA graph needs.
    """
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)
    return contextlib.nullcontext()


@contextlib.contextmanager
def matmul_precision(device: torch.device, precision: str) -> Iterator[None]:
    """``train.precision = "tf32"`` on a CUDA GPU: matmuls and convolutions, forward and backward, in
    TensorFloat-32 (fp32 range, a 10-bit mantissa, tensor cores) while training, torch's settings put
    back after. Parameters, gradients and optimizer state stay float32. Nothing changes on a CPU."""
    if precision != "tf32" or device.type != "cuda":
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def summarize_means(task: Task, means: dict[str, float]) -> dict[str, float]:
    """``task.summarize`` of example-weighted means, as one clear TaskError if it fails."""
    out = call_part(task, "summarize(means)", task.summarize, dict(means))
    if not isinstance(out, dict):
        raise TaskError(f"task {task_name(task)}: summarize() returned a {type(out).__name__}, expected a dict")
    return {k: float(v) for k, v in out.items()}


_DROPOUT_STREAM = 0xD209  # seeds torch's global RNG (dropout) apart from the batch order


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device) -> Iterator[None]:
    """torch's global RNG seeded from a client-round's ``seed`` for one client's training (what
    dropout and other random layers draw from), then put back as it was: the client's update does
    not depend on what ran before it in the process (other clients, another run, a Ray worker's
    history), and nothing after it sees its draws."""
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        s = derive_seed(seed, _DROPOUT_STREAM) % (1 << 63)
        torch.random.default_generator.manual_seed(s)
        if devices:
            with torch.cuda.device(devices[0]):
                torch.cuda.manual_seed(s)
        yield


@dataclass
class Objective:
    """What an algorithm changes in plain local SGD (client/algorithms.py); None keeps the default.

    The step on the flat buffer becomes ``w -= lr * (m(g + correction + wd w + mu (w - anchor)) + drift)``
    (``m`` the momentum, masked by ``mask``): SCAFFOLD's drift ``c - c_i`` (outside the momentum:
    option II estimates the c's at the scale of the momentum step), FedDyn's ``-grad_k`` with
    ``mu = alpha``, Ditto's personal model (``start`` v_k, ``anchor`` the
    global model, ``mu = lambda``), FedRep's phases (``mask``: the entries that move)."""

    start: torch.Tensor | None = None  # start here, not at the global model
    anchor: torch.Tensor | None = None  # the proximal term's centre (default: the global model)
    prox_mu: float | None = None  # replaces train.prox_mu
    correction: torch.Tensor | None = None  # added to every gradient (before the momentum)
    drift: torch.Tensor | None = None  # added to every step after the momentum: w -= lr (m + drift)
    mask: torch.Tensor | None = None  # float 0/1 over the flat buffer: only entries with 1 move
    epochs: int | None = None  # replaces train.epochs
    max_steps: int | None = None  # stop after this many steps (personalised fine-tuning)


class SeededPermutations(Sampler[int]):
    """One ``torch.randperm(n)`` per pass from a generator seeded once: LocalTrainer.train's order."""

    def __init__(self, n: int, seed: int):
        self.n = n
        self.gen = torch.Generator().manual_seed(int(seed) % (1 << 63))

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.gen).tolist())


class LocalTrainer:
    """Trains one bound model from a given global vector; reused across clients."""

    def __init__(
        self, model: nn.Module, cfg: TrainConfig, device: torch.device | str = "cpu", task: Task | None = None
    ):
        self.cfg = cfg
        self.task = task if task is not None else Task()
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.spec = ParamSpec.of(self.model, exchange_buffers=self.task.exchange_buffers).with_base(self.model)
        self.flat, self.grad = bind_module(self.model, self.spec)
        self._momentum = torch.zeros_like(self.flat) if cfg.momentum > 0 else None
        self._next_momentum: torch.Tensor | None = None  # set_momentum(): the next training's start
        # Weight decay and the proximal term act on trainable entries only.
        # every exchanged entry a trainable parameter: no mask is made (a quarter of the model's size)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        self._all_trainable = all(e.name in trainable for e in self.spec.entries)
        self._mask = None if self._all_trainable else trainable_mask(self.model, self.spec).to(self.device)
        self._optim_name = self.task.optimizer
        # Entries of the model that are neither exchanged nor frozen: buffers kept local (FedBN).
        spec_names = {e.name for e in self.spec.entries}
        self.local_names = [n for n, b in self.model.named_buffers() if n not in spec_names and b.is_floating_point()]

    @property
    def _train_mask(self) -> torch.Tensor:
        """Bool over the flat buffer: True where the entry is trainable (made when asked if all are:
        a quarter of the model's size not held for nothing)."""
        if self._mask is not None:
            return self._mask
        return trainable_mask(self.model, self.spec).to(self.device)

    # --- local state (buffers a task keeps on the client) -----------------------------

    def local_state(self) -> dict[str, torch.Tensor]:
        """Copies of the model's client-local buffers (empty unless exchange_buffers = False)."""
        bufs = dict(self.model.named_buffers())
        return {n: bufs[n].detach().clone() for n in self.local_names}

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        bufs = dict(self.model.named_buffers())
        for n, t in state.items():
            bufs[n].copy_(t)

    # --- training -----------------------------------------------------------------------

    def set_momentum(self, momentum: torch.Tensor | None) -> None:
        """Start the next local training with this momentum buffer instead of zeros (a client's
        optimizer state kept between its rounds); None: zeros."""
        self._next_momentum = momentum

    def momentum(self) -> torch.Tensor | None:
        """A copy of the momentum buffer as the last local training left it (None without momentum)."""
        return None if self._momentum is None else self._momentum.detach().clone()

    def fit(
        self,
        global_flat: torch.Tensor,
        data: ClientData,
        seed: int,
        base_version: int = 0,
        sender: str = "",
        objective: Objective | None = None,
    ) -> Update:
        """Train on ``data`` (tensors: the fast path; a Dataset: through a DataLoader)."""
        extra = {} if objective is None else {"objective": objective}  # DP-SGD's trainer takes none
        pair = as_tensors(data)
        if pair is not None:
            x, y = pair
            return self.train(global_flat, self._on_device(x), self._on_device(y), seed, base_version, sender, **extra)
        return self.train_dataset(global_flat, data, seed, base_version, sender, **extra)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

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
        """Run local training on (x, y) starting from ``global_flat``; return the Update.

        ``x``/``y`` should already be on the trainer's device (the simulator keeps all
        client data there once). Deterministic for a given seed on CPU.
        """
        n = int(y.shape[0])
        bs = self.cfg.batch(n)
        gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
        epochs = self.cfg.epochs if objective is None or objective.epochs is None else objective.epochs

        def batches():
            for _ in range(epochs):
                perm = torch.randperm(n, generator=gen).to(self.device)
                for start in range(0, n, bs):
                    idx = perm[start : start + bs]
                    yield x[idx], y[idx]

        return self._run(global_flat, batches(), n, base_version, sender, objective)

    def train_dataset(
        self,
        global_flat: torch.Tensor,
        dataset: Any,
        seed: int,
        base_version: int = 0,
        sender: str = "",
        objective: Objective | None = None,
    ) -> Update:
        """Local training on a torch Dataset through a DataLoader (workers, pinned memory on GPU)."""
        n = len(dataset)
        task = self.task
        # The sampler draws each epoch's permutation exactly as the tensor path does; the
        # loader's own generator (worker seeds) is separate, so the global RNG is untouched.
        loader = DataLoader(
            dataset,
            batch_size=self.cfg.batch(n),
            sampler=SeededPermutations(n, seed),
            drop_last=False,
            num_workers=task.num_workers,
            pin_memory=self.device.type == "cuda",
            collate_fn=task.collate_fn,
            generator=torch.Generator().manual_seed(derive_seed(seed, 0xDA7A) % (1 << 63)),
        )

        epochs = self.cfg.epochs if objective is None or objective.epochs is None else objective.epochs

        def batches():
            for _ in range(epochs):
                for batch in user_batches(task, loader):
                    yield split_batch(task.to_device(batch, self.device))

        return self._run(global_flat, batches(), n, base_version, sender, objective)

    def _run(
        self,
        global_flat: torch.Tensor | DiskModel,
        batches,
        n: int,
        base_version: int,
        sender: str,
        objective: Objective | None = None,
    ) -> Update:
        with matmul_precision(self.device, self.cfg.precision):
            return self._train_steps(global_flat, batches, n, base_version, sender, objective)

    def _train_steps(
        self,
        global_flat: torch.Tensor | DiskModel,
        batches,
        n: int,
        base_version: int,
        sender: str,
        objective: Objective | None = None,
    ) -> Update:
        obj = objective or Objective()
        mu = self.cfg.prox_mu if obj.prox_mu is None else obj.prox_mu
        # a large model's node keeps the global model on disk (client/disk_model.py)
        disk = global_flat if isinstance(global_flat, DiskModel) else None
        if disk is not None and (objective is not None or mu or self.device.type != "cpu"):
            raise ValueError("a global model on disk trains plain SGD on the CPU: no objective, no prox_mu")
        if disk is not None and self._momentum is None and not self._optim_name:
            return self._run_lean(disk, batches, n, base_version, sender)
        self._bind_grad()
        cfg, flat, grad, model, task = self.cfg, self.flat, self.grad, self.model, self.task
        if disk is not None:
            disk.read_into(flat)
            start = anchor = flat  # anchor unused: mu is 0
        else:
            assert isinstance(global_flat, torch.Tensor)
            start = global_flat.to(self.device)
            flat.copy_(start if obj.start is None else obj.start.to(self.device))
            anchor = start if obj.anchor is None else obj.anchor.to(self.device)
        if self._momentum is not None:
            if self._next_momentum is not None:  # a client's momentum from its last round
                self._momentum.copy_(self._next_momentum.to(self.device))
            else:
                self._momentum.zero_()
        self._next_momentum = None
        optim = self._make_optimizer() if self._optim_name else None
        loss_sum = torch.zeros((), device=self.device)
        steps = 0
        model.train()
        for xb, yb in batches:
            if obj.max_steps is not None and steps >= obj.max_steps:
                break
            grad.zero_()
            with autocast(self.device, cfg.precision):
                loss = call_part(task, LOSS_PART, task.loss, model, xb, yb)
            loss.float().backward()
            if obj.correction is not None:
                grad.add_(self._masked(obj.correction))
            if optim is None:
                self._step(anchor, mu, obj.mask)
            else:
                if mu:  # FedProx term with any optimizer
                    grad.add_(self._masked(flat - anchor), alpha=mu)
                if obj.mask is not None:
                    grad.mul_(obj.mask)
                optim.step()
            if obj.drift is not None:
                with torch.no_grad():
                    flat.add_(self._masked(obj.drift), alpha=-cfg.lr)
            loss_sum += loss.detach().float()
            steps += 1
        if disk is not None:  # the gradients are spent: the update takes their memory (used before the next training)
            delta = disk.subtract_from(flat, out=grad)
        else:
            delta = flat - start
        metrics = {"train_loss": float(loss_sum) / max(steps, 1), "local_steps": float(steps)}
        return Update(delta=delta, num_examples=n, base_version=base_version, sender=sender, metrics=metrics)

    def _run_lean(self, disk: DiskModel, batches, n: int, base_version: int, sender: str) -> Update:
        """Plain SGD (``lr``, ``weight_decay``) from a global model on disk, the same steps as
        :meth:`_run` takes, in about half its memory. No gradient buffer is bound: each parameter
        takes its step as soon as backward has its whole gradient (a post-accumulate-grad hook;
        autograd runs it once every use of the parameter in the graph is summed, so nothing that
        still needs the old value sees the new one), and that gradient is let go at once. Training
        holds the parameters and the gradients backward holds at one time (at most one parameter's
        beside its activations' for a stack of layers), then the parameters and the update."""
        cfg, flat, model, task = self.cfg, self.flat, self.model, self.task
        self._drop_grad()
        disk.read_into(flat)
        params = [p for p in model.parameters() if p.requires_grad]

        def step(p: torch.Tensor) -> None:
            assert p.grad is not None  # the hook runs once backward has put it there
            with torch.no_grad():
                if cfg.weight_decay:
                    p.grad.add_(p, alpha=cfg.weight_decay)
                p.add_(p.grad, alpha=-cfg.lr)
            p.grad = None

        hooks = [p.register_post_accumulate_grad_hook(step) for p in params]
        loss_sum = torch.zeros((), device=self.device)
        steps = 0
        model.train()
        try:
            for xb, yb in batches:
                with autocast(self.device, cfg.precision):
                    loss = call_part(task, LOSS_PART, task.loss, model, xb, yb)
                loss.float().backward()
                loss_sum += loss.detach().float()
                steps += 1
        finally:
            for h in hooks:
                h.remove()
            for p in params:
                p.grad = None
        delta = disk.subtract_from(flat, out=torch.empty_like(flat))
        metrics = {"train_loss": float(loss_sum) / max(steps, 1), "local_steps": float(steps)}
        return Update(delta=delta, num_examples=n, base_version=base_version, sender=sender, metrics=metrics)

    def _drop_grad(self) -> None:
        """Let the bound gradient buffer go (:meth:`_run_lean`); :meth:`_bind_grad` makes it again."""
        for p in self.model.parameters():
            p.grad = None
        self.grad = torch.empty(0, device=self.device)

    def _bind_grad(self) -> None:
        """The parameters' gradients as views of one flat buffer (shoal.params.bind_module), made
        again if :meth:`_drop_grad` let it go."""
        if self.grad.numel() == self.flat.numel():
            return
        self.grad = torch.zeros_like(self.flat)
        views = self.spec.views(self.grad)
        for name, p in self.model.named_parameters():
            if name in views:
                p.grad = views[name]

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """A fresh torch.optim optimizer per local training (its state never leaves the client)."""
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[self._optim_name or "sgd"]
        args = {"lr": self.cfg.lr, **self.task.optimizer_args}
        params = [p for p in self.model.parameters() if p.requires_grad]
        try:
            return cls(params, **args)
        except (TypeError, ValueError) as e:
            raise TaskError(f"task {task_name(self.task)}: optimizer {self._optim_name}({args}) failed: {e}") from None

    def _step(self, anchor: torch.Tensor, mu: float, mask: torch.Tensor | None = None) -> None:
        cfg, flat, grad = self.cfg, self.flat, self.grad
        if cfg.weight_decay:
            grad.add_(self._masked(flat), alpha=cfg.weight_decay)
        if mu:  # FedProx: gradient of (mu/2)||w - anchor||^2 (anchor: the global model)
            grad.add_(self._masked(flat - anchor), alpha=mu)
        if mask is not None:
            grad.mul_(mask)
        step = grad
        if self._momentum is not None:
            step = self._momentum.mul_(cfg.momentum).add_(grad)
        flat.add_(step, alpha=-cfg.lr)

    def _masked(self, t: torch.Tensor) -> torch.Tensor:
        return t if self._all_trainable else t * self._train_mask

    # --- evaluation ---------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(
        self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int = 2048
    ) -> dict[str, float]:
        """The task's metrics of ``params`` on (x, y); leaves the trainer's buffer changed."""
        n = int(y.shape[0])
        return self._evaluate(params, ((x[s : s + batch_size], y[s : s + batch_size]) for s in range(0, n, batch_size)))

    @torch.no_grad()
    def evaluate_data(
        self, params: torch.Tensor, data: ClientData, batch_size: int = 2048, summarize: bool = True
    ) -> dict[str, float]:
        """Metrics on tensors or a Dataset (DataLoader, no shuffling); adds ``num_examples``.

        ``summarize=False`` returns the raw example-weighted means: what a client reports for
        federated evaluation, so that the aggregator averages means and summarizes once
        (the mean of clients' perplexities is not the perplexity of the mean loss)."""
        pair = as_tensors(data)
        if pair is not None:
            n = int(pair[1].shape[0])
            x, y = pair
            out = self._evaluate(
                params, ((x[s : s + batch_size], y[s : s + batch_size]) for s in range(0, n, batch_size)), summarize
            )
        else:
            task = self.task
            assert isinstance(data, Dataset)  # not a tensor pair (as_tensors gave None)
            loader = DataLoader(
                data,
                batch_size=batch_size,
                shuffle=False,
                num_workers=task.num_workers,
                pin_memory=self.device.type == "cuda",
                collate_fn=task.collate_fn,
                generator=torch.Generator().manual_seed(0),
            )  # leaves the global RNG alone
            out = self._evaluate(params, user_batches(task, loader), summarize)
        return {**out, "num_examples": float(num_examples(data))}

    def _evaluate(self, params: torch.Tensor, batches, summarize: bool = True) -> dict[str, float]:
        self.flat.copy_(params.to(self.device))
        self.model.eval()
        task = self.task
        sums: dict[str, torch.Tensor] = {}
        n = 0
        for batch in batches:
            xb, yb = split_batch(task.to_device(batch, self.device))
            k = int(yb.shape[0])
            if k == 0:
                continue
            with autocast(self.device, self.cfg.precision):
                means = call_part(task, "metrics(model, x, y)", task.metrics, self.model, xb, yb)
            for name, v in means.items():
                v = torch.as_tensor(v, device=self.device).detach().double()
                if v.dim() != 0:
                    raise TaskError(
                        f"task {task_name(task)}: metrics() gave {name!r} of shape {tuple(v.shape)}; "
                        "each metric must be a scalar (the batch mean)"
                    )
                sums[name] = sums.get(name, 0) + v * k
            n += k
        means = {name: float(v) / max(n, 1) for name, v in sums.items()}
        return summarize_means(task, means) if summarize else means
