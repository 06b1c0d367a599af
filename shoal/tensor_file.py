"""safetensors files written in one canonical form: tensors in name order, metadata sorted by key.

``safetensors.torch.save_file`` orders a file's metadata as its hash map happens to, so two saves
of the same tensors and metadata can differ in their bytes; a file written here is the same bytes
for the same content (a resumed run's final model compares byte for byte). It is also written from
the tensors' own memory, a slice at a time, with no serialised copy of the model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: safetensors' names of the dtypes a file may hold.
_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: Bytes of a tensor written at once (views of its memory, no copy).
WRITE_BYTES = 16 << 20


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes as a view of its own memory (a contiguous CPU tensor: no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy().data).cast("B")


def write_safetensors(f, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors file of ``tensors`` (name order) written to the open binary file ``f`` from
    the tensors' own memory, a slice at a time: no serialised copy of the model is made (what
    ``safetensors.torch.save`` would build whole before it is written)."""
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}  # same tensors, same bytes
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    f.write(len(head).to_bytes(8, "little"))
    f.write(head)
    for name in sorted(tensors):
        raw = _raw(tensors[name])
        for a in range(0, len(raw), WRITE_BYTES):
            f.write(raw[a : a + WRITE_BYTES])


def save_file(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``tensors`` (contiguous, any device) to ``path`` in the canonical form."""
    cpu = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    with open(path, "wb") as f:
        write_safetensors(f, cpu, metadata or {})
