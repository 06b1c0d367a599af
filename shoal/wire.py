"""Wire format: safetensors bytes whose metadata holds a small JSON header.

One body carries both, so a message is self-describing and nothing is ever unpickled.
Decoding checks everything before trusting anything: total size, safetensors header
bounds, the spec hash, tensor names, dtypes, shapes, byte ranges, then finiteness.
Each failure raises a typed :class:`~shoal.errors.WireError` with a message that says
what was expected.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch
from safetensors.torch import load as st_load
import zstandard
from safetensors.torch import save as st_save

from .aggregation.compression import Encoded, decode_tensors, expected_tensors
from .errors import Malformed, NonFinite, SpecMismatch, TooLarge
from .params import ParamSpec
from .update import Update

FORMAT = "shoal/1"
MAX_HEADER_BYTES = 1 << 20
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
           "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}


def default_max_bytes(spec: ParamSpec) -> int:
    """A dense float32 model plus generous room for the header."""
    return spec.nbytes + MAX_HEADER_BYTES + 4096


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """safetensors bytes of ``tensors`` with ``header`` as JSON in the metadata."""
    header = {"format": FORMAT, **header}
    payload = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return st_save(payload, metadata={"shoal": json.dumps(header, separators=(",", ":"))})


def read_header(body: bytes, max_bytes: int) -> tuple[dict[str, Any], dict[str, dict]]:
    """Parse and bound-check the safetensors header; returns (shoal header, tensor table)."""
    if len(body) > max_bytes:
        raise TooLarge(f"body of {len(body)} bytes is over the limit of {max_bytes} bytes")
    if len(body) < 8:
        raise Malformed(f"body of {len(body)} bytes is truncated: a safetensors body starts with 8 length bytes")
    (hlen,) = struct.unpack("<Q", body[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(body):
        raise Malformed(f"safetensors header length {hlen} does not fit a body of {len(body)} bytes (truncated?)")
    try:
        table = json.loads(bytes(body[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Malformed(f"safetensors header is not JSON: {e}") from None
    if not isinstance(table, dict):
        raise Malformed("safetensors header is not a JSON object")
    meta = table.pop("__metadata__", None) or {}
    try:
        header = json.loads(meta["shoal"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise Malformed("no shoal header in the safetensors metadata (key 'shoal')") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise Malformed(f"header format is {header.get('format') if isinstance(header, dict) else header!r}, expected {FORMAT!r}")
    data_len = len(body) - 8 - hlen
    end_max = 0
    for name, info in table.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise Malformed(f"tensor {name!r}: bad safetensors entry")
        start, end = info["data_offsets"]
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= data_len):
            raise Malformed(f"tensor {name!r}: byte range {start}..{end} outside the {data_len} data bytes (truncated?)")
        end_max = max(end_max, end)
    if end_max != data_len:
        raise Malformed(f"body has {data_len} data bytes but the tensors use {end_max}")
    return header, table


def decode(
    body: bytes | bytearray | memoryview,
    expect: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    max_bytes: int,
    spec_hash: str | None = None,
    check_finite: bool = True,
    copy: bool = True,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Validate and load a message whose tensors must be exactly ``expect``.

    ``copy=False`` on a writable buffer (bytearray, or a memoryview of one) returns
    tensors that are views of it: no model-sized copy, for a server that streams each
    body into its aggregate; the caller must not reuse the buffer while they live."""
    header, table = read_header(body, max_bytes)
    if spec_hash is not None and header.get("spec_hash") != spec_hash:
        raise SpecMismatch(
            f"spec hash {header.get('spec_hash')!r} does not match this model's {spec_hash!r} "
            "(different architecture or parameter layout)"
        )
    if set(table) != set(expect):
        raise SpecMismatch(f"tensors {sorted(table)} sent, expected {sorted(expect)}")
    for name, (dtype, shape) in expect.items():
        info = table[name]
        got = _DTYPES.get(info["dtype"])
        if got != dtype:
            raise SpecMismatch(f"tensor {name!r} has dtype {info['dtype']}, expected {dtype}")
        if tuple(info["shape"]) != tuple(shape):
            raise SpecMismatch(f"tensor {name!r} has shape {info['shape']}, expected {list(shape)}")
    try:
        if copy or isinstance(body, bytes):
            tensors = st_load(bytes(body))
        else:
            data = 8 + struct.unpack("<Q", body[:8])[0]
            tensors = {
                name: torch.frombuffer(body, dtype=dtype, count=math.prod(shape), offset=data + table[name]["data_offsets"][0])
                .view(shape) if math.prod(shape) else torch.zeros(shape, dtype=dtype)
                for name, (dtype, shape) in expect.items()
            }
    except Exception as e:  # the library's own checks, should ours have missed one
        raise Malformed(f"safetensors body rejected: {e}") from None
    if check_finite:
        for name, t in tensors.items():
            # A sum is finite only if every element is (or it overflowed): one reduction
            # without a temporary, and the exact elementwise test only when it is not.
            if t.is_floating_point() and not bool(torch.isfinite(t.sum())) and not bool(torch.isfinite(t).all()):
                bad = int((~torch.isfinite(t)).sum())
                raise NonFinite(f"tensor {name!r} has {bad} NaN/Inf values")
    return header, tensors


def _int_field(header: dict, key: str, minimum: int) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise Malformed(f"header field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def encode_update(
    update: Update,
    spec: ParamSpec,
    extra: dict[str, Any] | None = None,
    payload: Encoded | None = None,
    zstd_level: int = 0,
) -> bytes:
    """The update as a message. ``payload`` is a compressed form of ``update.delta``
    (aggregation/compression.py; dense float32 when None); the header names its
    encoding. With ``zstd_level`` > 0 the payload's tensors travel zstd-compressed in
    one uint8 tensor ``zstd`` and the header says ``"zstd": true``."""
    payload = payload or Encoded("dense", {"delta": update.delta.float()})
    header = {
        "kind": "update",
        "spec_hash": spec.hash,
        "encoding": payload.encoding,
        **payload.header,
        "base_version": int(update.base_version),
        "num_examples": int(update.num_examples),
        "sender": update.sender,
        "metrics": {k: float(v) for k, v in update.metrics.items()},
        **(extra or {}),
    }
    tensors = payload.tensors
    if zstd_level:
        inner = encode(tensors, {"kind": "payload"})
        packed = zstandard.ZstdCompressor(level=zstd_level).compress(inner)
        tensors = {"zstd": torch.frombuffer(bytearray(packed), dtype=torch.uint8)}
        header["zstd"] = True
    return encode(tensors, header)


def _unzstd(packed: torch.Tensor, max_bytes: int) -> bytes:
    """Decompress at most ``max_bytes`` (a small body must not inflate without bound)."""
    try:
        with zstandard.ZstdDecompressor().stream_reader(packed.numpy().tobytes()) as reader:
            return reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise Malformed(f"tensor 'zstd' is not a valid zstd frame: {e}") from None


def decode_update(body: bytes | bytearray | memoryview, spec: ParamSpec, max_bytes: int | None = None,
                  copy: bool = True) -> tuple[Update, dict]:
    """Validated Update plus the raw header (for fields a caller adds, e.g. round ids).
    ``copy=False``: a dense delta is a view of ``body`` (see :func:`decode`).

    The header's ``encoding`` (dense | q8 | topk, plus ``zstd``) says which tensors must
    be present, with which dtypes and shapes; every one is checked, then the values
    (aggregation/compression.py), before the dense delta is built."""
    max_bytes = max_bytes or default_max_bytes(spec)
    header, table = read_header(body, max_bytes)
    expect = expected_tensors(header, spec.numel)
    zstd = header.get("zstd", False)
    if not isinstance(zstd, bool):
        raise Malformed(f"header field 'zstd' = {zstd!r} must be true or false")
    if zstd:
        size = table.get("zstd", {}).get("shape", [0])
        header, outer = decode(body, {"zstd": (torch.uint8, tuple(size))}, max_bytes, spec.hash)
        inner = _unzstd(outer["zstd"], max_bytes)
        if len(inner) > max_bytes:
            raise TooLarge(f"zstd payload inflates to more than the limit of {max_bytes} bytes")
        _, tensors = decode(inner, expect, max_bytes)
    else:
        header, tensors = decode(body, expect, max_bytes, spec.hash, copy=copy)
    if header.get("kind") != "update":
        raise Malformed(f"message kind is {header.get('kind')!r}, expected 'update'")
    delta = decode_tensors(header, tensors, spec.numel)
    metrics = header.get("metrics", {})
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) for k, v in metrics.items()
    ):
        raise Malformed("header field 'metrics' must map names to numbers")
    sender = header.get("sender", "")
    if not isinstance(sender, str) or len(sender) > 256:
        raise Malformed("header field 'sender' must be a string of at most 256 characters")
    update = Update(
        delta=delta,
        num_examples=_int_field(header, "num_examples", 1),
        base_version=_int_field(header, "base_version", 0),
        sender=sender,
        metrics={k: float(v) for k, v in metrics.items()},
    )
    return update, header


def encode_model(flat: torch.Tensor, spec: ParamSpec, version: int, extra: dict[str, Any] | None = None) -> bytes:
    header = {"kind": "model", "spec_hash": spec.hash, "version": int(version), "spec": spec.to_json(), **(extra or {})}
    return encode({"params": flat.float()}, header)


def decode_model(body: bytes, spec: ParamSpec, max_bytes: int | None = None) -> tuple[torch.Tensor, dict]:
    """Validated flat parameters plus the header (``version`` among its fields)."""
    max_bytes = max_bytes or default_max_bytes(spec) + 64 * len(spec.entries)
    header, tensors = decode(body, {"params": (torch.float32, (spec.numel,))}, max_bytes, spec.hash)
    if header.get("kind") != "model":
        raise Malformed(f"message kind is {header.get('kind')!r}, expected 'model'")
    _int_field(header, "version", 0)
    return tensors["params"], header
