"""Where a chunked upload's bytes wait until the last one arrives: an unnamed temporary file.

A chunked upload (server/chunks.py) may be larger than the server wants to hold in memory per
node: its chunks are checked as they arrive and written here, at their offset, so an open
upload costs disk (page cache the kernel may evict), not resident memory (shoal/diskfile.py).
Once the upload is complete the service reads it back a block at a time (:meth:`Staged.blocks`)
into the round's sum, or whole for the encodings that are decoded whole (small ones).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from shoal.diskfile import UnnamedFile

#: Bytes read back at once into the round's sum (a multiple of every dtype's width).
READ_BYTES = 4 << 20


class Staged(UnnamedFile):
    """One upload's bytes on disk (in ``dir``, default the system's temporary directory)."""

    def __init__(self, size: int, dir: str | None = None):
        super().__init__(size, dir, "staged upload")

    def read_all(self) -> bytearray:
        """The whole body (for an encoding decoded whole: q8, top-k, zstd)."""
        return self.read(0, self.size)

    def blocks(self, start: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """The values from byte ``start`` to the end as ``dtype`` tensors of READ_BYTES each, read into
        one reused buffer (each piece is valid until the next is read)."""
        buf = bytearray(min(READ_BYTES, max(self.size - start, 0)))
        for a in range(start, self.size, READ_BYTES):
            n = min(READ_BYTES, self.size - a)
            self.read_at(a, memoryview(buf)[:n])
            yield torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
