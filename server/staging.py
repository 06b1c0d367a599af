"""Where a chunked upload's bytes wait until the last one arrives: an unnamed temporary file.

A chunked upload (server/chunks.py) may be larger than the server wants to hold in memory per
node: its chunks are checked as they arrive and written here, at their offset, so an open
upload costs disk (page cache the kernel may evict), not resident memory. The file has no name
(``O_TMPFILE`` where the system has it): it is gone when closed, and when the process dies.
Once the upload is complete the service reads it back a block at a time (:meth:`Staged.blocks`)
into the round's sum, or whole for the encodings that are decoded whole (small ones).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import torch

#: Bytes read back at once into the round's sum (a multiple of every dtype's width).
READ_BYTES = 4 << 20


class Staged:
    """One upload's bytes on disk (in ``dir``, default the system's temporary directory)."""

    def __init__(self, size: int, dir: str | None = None):
        self.size = size
        self._file = tempfile.TemporaryFile(dir=dir)

    def write_at(self, offset: int, data: memoryview | bytes | bytearray) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._file.fileno(), view[done:], offset + done)

    def read_at(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes from ``offset`` (OSError if the file is shorter)."""
        done = 0
        while done < len(out):
            n = os.preadv(self._file.fileno(), [out[done:]], offset + done)
            if n <= 0:
                raise OSError(f"staged upload ends at byte {offset + done} of {self.size}")
            done += n

    def read_all(self) -> bytearray:
        """The whole body (for an encoding decoded whole: q8, top-k, zstd)."""
        out = bytearray(self.size)
        self.read_at(0, memoryview(out))
        return out

    def blocks(self, start: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """The values from byte ``start`` to the end as ``dtype`` tensors of READ_BYTES each, read into
        one reused buffer (each piece is valid until the next is read)."""
        buf = bytearray(min(READ_BYTES, max(self.size - start, 0)))
        for a in range(start, self.size, READ_BYTES):
            n = min(READ_BYTES, self.size - a)
            self.read_at(a, memoryview(buf)[:n])
            yield torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)

    def close(self) -> None:
        self._file.close()
