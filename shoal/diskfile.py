"""Bytes kept on disk instead of in memory: an unnamed temporary file read and written at offsets.

A large model's bytes in such a file cost disk and page cache the kernel may evict, not resident
memory. The file has no name (``O_TMPFILE`` where the system has it): it is gone when closed, and
when the process dies. The server stages chunked uploads in one (server/staging.py), a node keeps
a large downloaded model in one (client/transfer.py).
"""

from __future__ import annotations

import os
import tempfile


class UnnamedFile:
    """``size`` bytes on disk (in ``dir``, default the system's temporary directory); ``what``
    names them in errors."""

    def __init__(self, size: int, dir: str | None = None, what: str = "file"):
        self.size = size
        self.what = what
        self._file = tempfile.TemporaryFile(dir=dir)

    def __len__(self) -> int:
        return self.size

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
                raise OSError(f"{self.what} ends at byte {offset + done} of {self.size}")
            done += n

    def read(self, offset: int, n: int) -> bytearray:
        """Up to ``n`` bytes from ``offset`` (fewer at the end)."""
        out = bytearray(max(min(n, self.size - offset), 0))
        self.read_at(offset, memoryview(out))
        return out

    def close(self) -> None:
        self._file.close()
