"""The model a bundle's run starts from, as data: how a server runs a bundle it never imports.

A bundle's task is the researcher's code, which the server never imports. What the server needs
of it is the exchanged state's layout (names, shapes) and initial values, so `shoal run submit
--bundle` builds the model on the researcher's machine (seeded as every engine seeds it) and packs
that state as the bundle's ``initial.safetensors``. The server's stand-in task
(:class:`BundledModel`) builds a module of exactly those tensors from the file: its layout hash is
the one nodes compute from the real model, so a node whose import of the task builds another model
is told at its first request, and nothing of the researcher's code runs on the server.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from .bundle import BundleError
from .params import ParamSpec, flatten
from .task import Task

MAX_HEADER = 16 << 20


def initial_state(model: nn.Module, exchange_buffers: bool = True) -> bytes:
    """The exchanged state of ``model`` as safetensors bytes, its layout in the metadata."""
    spec = ParamSpec.of(model, exchange_buffers=exchange_buffers).with_base(model)
    if spec.base:
        raise BundleError(
            "the model has frozen parameters (requires_grad = False); a bundle carries only exchanged state, so "
            "such a task is installed on the nodes and registered on the server instead"
        )
    flat = flatten(model, spec)
    tensors = {name: view.clone() for name, view in spec.views(flat).items()}
    return save_tensors(tensors, metadata={"spec": json.dumps(spec.to_json(), separators=(",", ":"))})


def _layout(data: bytes) -> list[tuple[str, tuple[int, ...]]]:
    """The file's declared layout (its metadata), read with limits before any tensor is."""
    if len(data) < 8:
        raise BundleError("the bundle's initial model is not a safetensors file")
    (n,) = struct.unpack_from("<Q", data)
    if n > min(MAX_HEADER, len(data) - 8):
        raise BundleError("the bundle's initial model has a header past its end")
    try:
        header = json.loads(data[8 : 8 + n])
        spec = json.loads(header["__metadata__"]["spec"])
        layout = [(name, tuple(shape)) for name, shape in spec]
    except (ValueError, KeyError, TypeError):
        raise BundleError(
            "the bundle's initial model carries no layout (`shoal run submit --bundle` writes it)"
        ) from None
    ok = all(isinstance(name, str) and all(type(s) is int and s >= 0 for s in shape) for name, shape in layout)
    if not ok or len({name for name, _ in layout}) != len(layout) or not layout:
        raise BundleError("the bundle's initial model has a malformed layout")
    return layout


def state_module(data: bytes, max_parameters: int = 0) -> nn.Module:
    """A module holding exactly the file's tensors, as parameters, in the file's layout order (so its
    ParamSpec, and the spec hash, are those of the model the file was made from)."""
    layout = _layout(data)
    numel = sum(int(torch.Size(shape).numel()) for _, shape in layout)
    if max_parameters and numel > max_parameters:
        raise BundleError(f"the bundle's model has {numel} parameters, over the limit of {max_parameters}")
    try:
        tensors = load_tensors(data)
    except Exception as e:  # safetensors' parser: a damaged file is a refusal, never a crash
        raise BundleError(f"the bundle's initial model cannot be read: {type(e).__name__}") from None
    if set(tensors) != {name for name, _ in layout}:
        raise BundleError("the bundle's initial model holds other tensors than its layout names")
    root = nn.Module()
    for name, shape in layout:
        t = tensors[name]
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not torch.isfinite(t).all():
            raise BundleError(f"the bundle's initial model: tensor {name[:80]!r} is not finite float32 of {shape}")
        *path, leaf = name.split(".")
        if not leaf or not all(path) or any(not p.isidentifier() and not p.isdigit() for p in [*path, leaf]):
            raise BundleError(f"the bundle's initial model: tensor name {name[:80]!r} is not a module path")
        try:
            _place(root, path, leaf, t)
        except (KeyError, TypeError, AttributeError):  # a name torch refuses ("training", "__class__", a clash)
            raise BundleError(
                f"the bundle's initial model: tensor name {name[:80]!r} cannot name a module's tensor"
            ) from None
    if [e.name for e in ParamSpec.of(root).entries] != [name for name, _ in layout]:
        raise BundleError("the bundle's initial model's layout is not in a module's state order")
    return root


def _place(root: nn.Module, path: list[str], leaf: str, t: torch.Tensor) -> None:
    module = root
    for part in path:
        child = module.get_submodule(part) if part in dict(module.named_children()) else None
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if hasattr(module, leaf):
        raise KeyError(leaf)
    module.register_parameter(leaf, nn.Parameter(t.clone()))


class BundledModel(Task):
    """The server's stand-in for a bundle's task: the model is the bundle's initial state; no data,
    no code of the researcher's. Figures a task derives (``summarize``) are the default ones here."""

    def __init__(self, model_bytes: bytes, max_parameters: int = 0):
        self.model_bytes, self.max_parameters = model_bytes, max_parameters
        self.exchange_buffers = True  # every tensor of the file is exchanged: the file holds nothing else

    def model(self) -> nn.Module:
        return state_module(self.model_bytes, self.max_parameters)

    def local_data(self, path: Any) -> Any:
        raise BundleError("a bundle's stand-in task has no data: the nodes run the bundle's own task")
