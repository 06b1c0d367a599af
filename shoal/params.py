"""Model parameters as one contiguous float32 buffer plus a spec.

Aggregation, masking, clipping and compression work on the flat buffer (one vector op
instead of one per layer); torch sees its usual state_dict, whose tensors are views of
that buffer after :func:`bind_module`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from math import prod

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    """One named tensor inside the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return prod(self.shape)


def frozen_digest(module: nn.Module) -> str:
    """SHA-256 of the frozen parameters' names, shapes, dtypes and values ("" when none is
    frozen): a node and a server whose base checkpoints differ would otherwise average adapter
    updates made for different models without noticing."""
    h = hashlib.sha256()
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        t = p.detach().contiguous().cpu()
        h.update(f"{name}:{list(t.shape)}:{t.dtype}:".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16] if seen else ""


@dataclass(frozen=True)
class ParamSpec:
    """Names, shapes and offsets of a model's float tensors in one flat buffer."""

    entries: tuple[Entry, ...]
    #: digest of the parameters that never travel (frozen, e.g. a pretrained base under adapters):
    #: part of :attr:`hash`, so two ends with other base weights do not exchange updates
    base: str = ""

    @property
    def numel(self) -> int:
        if not self.entries:
            return 0
        last = self.entries[-1]
        return last.offset + last.numel

    @property
    def nbytes(self) -> int:
        return 4 * self.numel

    @property
    def hash(self) -> str:
        """Short stable digest of the layout: two ends agree on it before any tensor moves."""
        desc = json.dumps([[e.name, list(e.shape)] for e in self.entries], separators=(",", ":"))
        base = f"base:{self.base}:" if self.base else ""
        return hashlib.sha256((base + "float32:" + desc).encode()).hexdigest()[:16]

    @classmethod
    def of(cls, module: nn.Module, exchange_buffers: bool = True) -> ParamSpec:
        """The exchanged state of ``module``, in state_dict order: every trainable parameter,
        and float buffers unless ``exchange_buffers`` is False (FedBN keeps BatchNorm
        statistics local). Frozen parameters (``requires_grad = False``, e.g. a pretrained
        base under small adapters) never travel; a tensor shared under two names (tied
        weights) appears once."""
        trainable = {id(p) for p in module.parameters() if p.requires_grad}
        params = {id(p) for p in module.parameters()}
        entries, offset, seen = [], 0, set()
        for name, t in module.state_dict(keep_vars=True).items():
            if not t.is_floating_point() or id(t) in seen:
                continue  # integer buffers (e.g. BatchNorm's num_batches_tracked) stay local
            if id(t) in params and id(t) not in trainable:
                continue  # frozen parameter
            if id(t) not in params and not exchange_buffers:
                continue  # a buffer kept on the client
            seen.add(id(t))
            entries.append(Entry(name, tuple(t.shape), offset))
            offset += t.numel()
        return cls(tuple(entries))

    def with_base(self, module: nn.Module) -> ParamSpec:
        """This spec, bound to ``module``'s frozen parameters by :func:`frozen_digest`."""
        return ParamSpec(self.entries, frozen_digest(module))

    def to_json(self) -> list:
        return [[e.name, list(e.shape)] for e in self.entries]

    @classmethod
    def from_json(cls, data: list) -> ParamSpec:
        entries, offset = [], 0
        for name, shape in data:
            e = Entry(str(name), tuple(int(s) for s in shape), offset)
            entries.append(e)
            offset += e.numel
        return cls(tuple(entries))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into ``flat`` (no copies)."""
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}


def flatten(module: nn.Module, spec: ParamSpec | None = None) -> torch.Tensor:
    """A new flat float32 copy of the module's float state (on the module's device)."""
    spec = spec or ParamSpec.of(module)
    sd = module.state_dict()
    return torch.cat([sd[e.name].detach().reshape(-1).float() for e in spec.entries])


def bind_module(module: nn.Module, spec: ParamSpec | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Make the module's parameters and float buffers views of one flat buffer.

    Returns ``(flat, flat_grad)``: gradients of the parameters land in ``flat_grad``
    (entries of buffers stay zero there), so an optimizer step is one vector op. Keep
    gradients in place with ``zero_grad(set_to_none=False)`` or ``flat_grad.zero_()``.
    """
    spec = spec or ParamSpec.of(module)
    device = next(iter(module.state_dict().values())).device
    flat = flatten(module, spec).to(device)
    views = spec.views(flat)
    for name, p in module.named_parameters():
        if name in views:
            p.data = views[name]
            p.grad = None
    for mod_name, mod in module.named_modules():
        for b_name, b in list(mod._buffers.items()):
            full = f"{mod_name}.{b_name}" if mod_name else b_name
            if b is not None and full in views:
                mod._buffers[b_name] = views[full]
    # the gradient buffer is made once the module's own tensors are let go: binding a large model
    # peaks at twice its size, not three times
    flat_grad = torch.zeros_like(flat)
    grads = spec.views(flat_grad)
    for name, p in module.named_parameters():
        if name in grads:
            p.grad = grads[name]
    return flat, flat_grad


def trainable_mask(module: nn.Module, spec: ParamSpec) -> torch.Tensor:
    """Bool mask over the flat buffer: True where the entry is a trainable parameter."""
    names = {n for n, p in module.named_parameters() if p.requires_grad}
    mask = torch.zeros(spec.numel, dtype=torch.bool)
    for e in spec.entries:
        if e.name in names:
            mask[e.offset : e.offset + e.numel] = True
    return mask
