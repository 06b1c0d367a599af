"""The global model a node trains from, kept on disk: a large model costs the node one copy in RAM.

A node whose model is larger than one request (the task's ``upload_chunk_bytes``) and whose
training needs the global model only to start from and to subtract at the end (plain FedAvg:
no proximal term, no algorithm state, no broadcast) downloads it by ranges into a file
(client/transfer.py, :class:`~shoal.client.transfer.OnDisk`), not into memory. Training then
loads the file into the model's own parameter memory a block at a time, and forms the update
``trained - global`` a block at a time into the gradient buffer, which training no longer needs
(client/training.py). In RAM: the parameters and their gradient buffer, which training holds in
any case, and one block.

The file is checked as :func:`shoal.wire.decode_model` checks a body in memory: the safetensors
table (one float32 ``params`` tensor of the model's size), the model kind, the spec hash, the
version, and every value finite.
"""

from __future__ import annotations

import torch

from shoal.errors import Malformed, NonFinite, SpecMismatch, short_repr
from shoal.params import ParamSpec
from shoal.wire import check_tensors, header_length, parse_table

from .transfer import OnDisk

#: Bytes read back at once (a multiple of float32's width).
BLOCK_BYTES = 4 << 20


def read_table(body: OnDisk) -> tuple[int, dict, dict]:
    """``(header length, shoal header, tensor table)`` of a model message in a file, checked as
    :func:`shoal.wire.read_header` checks one in memory."""
    hlen = header_length(body.read(0, 8), body.size)
    header, table = parse_table(body.read(8, hlen), body.size - 8 - hlen)
    return hlen, header, table


class DiskModel:
    """A downloaded, checked model message in an :class:`OnDisk` file."""

    def __init__(self, body: OnDisk, spec: ParamSpec):
        hlen, header, table = read_table(body)
        if header.get("spec_hash") != spec.hash:
            raise SpecMismatch(
                f"spec hash {short_repr(header.get('spec_hash'))} does not match this model's {spec.hash!r} "
                "(different architecture or parameter layout)"
            )
        check_tensors(table, {"params": (torch.float32, (spec.numel,))})
        if header.get("kind") != "model":
            raise Malformed(f"message kind is {short_repr(header.get('kind'))}, expected 'model'")
        version = header.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise Malformed(f"header field 'version' must be an integer >= 0, got {short_repr(version)}")
        self.body = body
        self.header = header
        self.version = version
        self.numel = spec.numel
        self.start = 8 + hlen + int(table["params"]["data_offsets"][0])
        self._buf = bytearray(min(BLOCK_BYTES, 4 * self.numel))
        for a, block in self.blocks():
            if not bool(torch.isfinite(block.sum())) and not bool(torch.isfinite(block).all()):
                bad = int((~torch.isfinite(block)).sum())
                raise NonFinite(f"tensor 'params' has {bad} NaN/Inf values from entry {a}")

    def blocks(self):
        """``(first entry, values)`` over the whole model, read into one reused buffer (each block is
        valid until the next is read)."""
        per = len(self._buf) // 4
        for a in range(0, self.numel, per):
            n = min(per, self.numel - a)
            self.body.read_at(self.start + 4 * a, memoryview(self._buf)[: 4 * n])
            yield a, torch.frombuffer(self._buf, dtype=torch.float32, count=n)

    def read_into(self, flat: torch.Tensor) -> None:
        """``flat[:] = global``, a block at a time."""
        self._check(flat)
        for a, block in self.blocks():
            flat[a : a + block.numel()].copy_(block)

    def subtract_from(self, flat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out[:] = flat - global``, a block at a time; returns ``out``."""
        self._check(flat)
        self._check(out)
        for a, block in self.blocks():
            b = a + block.numel()
            torch.sub(flat[a:b], block.to(flat.device), out=out[a:b])
        return out

    def load(self) -> torch.Tensor:
        """The whole model in memory (a central or federated evaluation of it)."""
        out = torch.empty(self.numel, dtype=torch.float32)
        self.read_into(out)
        return out

    def _check(self, t: torch.Tensor) -> None:
        if t.shape != (self.numel,) or t.dtype != torch.float32:
            raise ValueError(f"a {t.dtype} tensor of shape {tuple(t.shape)}; the model is float32 ({self.numel},)")

    def close(self) -> None:
        self.body.close()
