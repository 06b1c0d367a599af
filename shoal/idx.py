"""The idx file format of MNIST and Fashion-MNIST (LeCun et al.), gzipped or plain.

An idx file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the values, big-endian, row-major.
Reading checks all of it, so a wrong, truncated or padded file fails with a DataError
that names the file instead of producing garbage images.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np

from .errors import DataError

_TYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES = {dt.newbyteorder("="): code for code, dt in _TYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"


def parse_idx(data: bytes, name: str = "<bytes>") -> np.ndarray:
    """Decode the (already decompressed) bytes of an idx file into a native-endian array."""
    if len(data) < 4:
        raise DataError(f"{name}: not an idx file: {len(data)} bytes, shorter than the 4-byte magic number")
    if data[0] != 0 or data[1] != 0 or data[2] not in _TYPES:
        raise DataError(
            f"{name}: not an idx file: magic number {data[:4].hex()} (expected 0000 then a type code "
            f"{'/'.join(f'{c:02x}' for c in _TYPES)} then the number of dimensions)"
        )
    dtype, ndim = _TYPES[data[2]], data[3]
    if ndim == 0:
        raise DataError(f"{name}: idx header says 0 dimensions")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DataError(f"{name}: truncated idx header: {len(data)} bytes, the header needs {header}")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    got = len(data) - header
    if got != expected:
        what = "truncated" if got < expected else "has trailing bytes"
        raise DataError(f"{name}: idx file {what}: shape {shape} needs {expected} data bytes, found {got}")
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return arr.astype(dtype.newbyteorder("="))  # a writable native-endian copy


def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file, gunzipping it first if it is gzip data (whatever its name)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror or e}") from None
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise DataError(f"{path}: broken gzip data (truncated or corrupt download?): {e}") from None
    return parse_idx(raw, str(path))


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write ``array`` as an idx file (gzipped when the name ends in .gz), e.g. a client's shard."""
    array = np.asarray(array)
    code = _CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        raise DataError(f"idx cannot store dtype {array.dtype}; use uint8, int8, int16, int32, float32 or float64")
    if not 1 <= array.ndim <= 255:
        raise DataError(f"idx stores 1 to 255 dimensions, not {array.ndim}")
    body = (
        bytes([0, 0, code, array.ndim])
        + np.asarray(array.shape, dtype=">u4").tobytes()
        + np.ascontiguousarray(array, dtype=_TYPES[code]).tobytes()
    )
    path = Path(path)
    path.write_bytes(gzip.compress(body, mtime=0) if path.name.endswith(".gz") else body)
