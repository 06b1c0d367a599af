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
import zstandard
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .aggregation.compression import Encoded, decode_tensors, expected_tensors
from .errors import Malformed, NonFinite, OutOfRange, SpecMismatch, TooLarge, short_repr
from .params import ParamSpec
from .update import Update

FORMAT = "shoal/1"
MAX_HEADER_BYTES = 1 << 20
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}


def default_max_bytes(spec: ParamSpec) -> int:
    """A dense float32 model plus generous room for the header."""
    return spec.nbytes + MAX_HEADER_BYTES + 4096


def encode(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> bytes:
    """safetensors bytes of ``tensors`` with ``header`` as JSON in the metadata."""
    header = {"format": FORMAT, **header}
    payload = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return st_save(payload, metadata={"shoal": json.dumps(header, separators=(",", ":"))})


# Bounds on the JSON a peer can make us parse (the header itself is at most MAX_HEADER_BYTES).
MAX_JSON_DEPTH = 16  # nesting of objects and arrays; our own headers need 4
MAX_INT_DIGITS = 19  # every integer field fits an int64
MAX_RANK = 8  # dimensions of one tensor
MAX_METRICS = 64  # entries of an update's ``metrics``
MAX_NAME = 256  # characters of a sender or metric name
MAX_EXAMPLES = 2**53  # num_examples when the caller sets no lower limit (exact as a float)
# Bytes per element of the safetensors dtypes we accept (a subset of the library's).
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Malformed(f"an integer of {len(text.lstrip('-'))} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise Malformed(f"key {k!r} appears twice in one JSON object")
            seen.add(k)
    return out


def _depth_ok(value: Any, limit: int) -> bool:
    """No object or array nested deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def parse_json(raw: bytes | bytearray | memoryview | str, what: str) -> Any:
    """``json.loads`` for text from the network: UTF-8 only, no duplicate keys, integers
    of at most 19 digits, nesting at most MAX_JSON_DEPTH deep; anything else is Malformed
    (never a RecursionError or a ValueError escaping to the caller)."""
    if not isinstance(raw, str):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise Malformed(f"{what} is not UTF-8: {e}") from None
    try:
        value = json.loads(raw, parse_int=_parse_int, object_pairs_hook=_no_duplicates)
    except RecursionError:
        raise Malformed(f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except ValueError as e:  # JSONDecodeError, and int() limits
        raise Malformed(f"{what} is not valid JSON: {e}") from None
    if not _depth_ok(value, MAX_JSON_DEPTH):
        raise Malformed(f"{what} is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return value


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(body: bytes | bytearray | memoryview, max_bytes: int) -> tuple[dict[str, Any], dict[str, dict]]:
    """Parse and bound-check the safetensors header; returns (shoal header, tensor table).

    The table is checked as the safetensors library checks it (each entry's dtype,
    shape and data_offsets, byte counts that match dtype x shape, tensor data contiguous
    from byte 0 to the end of the body, no hole, no overlap), so a caller that reads
    tensors straight out of the body (``decode(copy=False)``) is as safe as the library."""
    if len(body) > max_bytes:
        raise TooLarge(f"body of {len(body)} bytes is over the limit of {max_bytes} bytes")
    if len(body) < 8:
        raise Malformed(f"body of {len(body)} bytes is truncated: a safetensors body starts with 8 length bytes")
    (hlen,) = struct.unpack("<Q", body[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(body):
        raise Malformed(f"safetensors header length {hlen} does not fit a body of {len(body)} bytes (truncated?)")
    table = parse_json(body[8 : 8 + hlen], "safetensors header")
    if not isinstance(table, dict):
        raise Malformed("safetensors header is not a JSON object")
    meta = table.pop("__metadata__", None)
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise Malformed(
            "safetensors __metadata__ must be an object of string values (with the shoal header "
            "as JSON text under key 'shoal')"
        )
    if "shoal" not in meta:
        raise Malformed("no shoal header in the safetensors metadata (key 'shoal')")
    header = parse_json(meta["shoal"], "shoal header")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else header
        raise Malformed(f"header format is {short_repr(got)}, expected {FORMAT!r}")
    data_len = len(body) - 8 - hlen
    spans = []
    for name, info in table.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise Malformed(f"tensor {name!r}: bad safetensors entry (needs exactly dtype, shape, data_offsets)")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise Malformed(f"tensor {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_SIZES)}")
        if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(map(_uint, shape)):
            raise Malformed(f"tensor {name!r}: shape {shape!r} must be a list of at most {MAX_RANK} integers >= 0")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_uint, offsets))):
            raise Malformed(f"tensor {name!r}: data_offsets {offsets!r} must be two integers >= 0")
        start, end = offsets
        need = math.prod(shape) * DTYPE_SIZES[dtype]
        if end < start or end - start != need:
            raise Malformed(
                f"tensor {name!r}: data_offsets {start}..{end} do not hold the {need} bytes of a "
                f"{dtype} tensor of shape {shape}"
            )
        spans.append((start, end, name))
    pos = 0
    for start, end, name in sorted(spans):
        if start != pos:
            raise Malformed(
                f"tensor {name!r}: data starts at byte {start}, expected {pos} "
                "(tensor data must be contiguous: no hole, no overlap)"
            )
        pos = end
    if pos != data_len:
        raise Malformed(f"body has {data_len} data bytes but the tensors use {pos} (truncated?)")
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
            f"spec hash {short_repr(header.get('spec_hash'))} does not match this model's {spec_hash!r} "
            "(different architecture or parameter layout)"
        )
    if set(table) != set(expect):
        raise SpecMismatch(f"tensors {short_repr(sorted(table))} sent, expected {sorted(expect)}")
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
                name: torch.frombuffer(
                    body, dtype=dtype, count=math.prod(shape), offset=data + table[name]["data_offsets"][0]
                ).view(shape)
                if math.prod(shape)
                else torch.zeros(shape, dtype=dtype)
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
        raise Malformed(f"header field {key!r} must be an integer >= {minimum}, got {short_repr(v)}")
    return v


#: Tensors an update may carry beside its delta (``Update.to_server``), and a model download
#: beside its parameters (an algorithm's broadcast): each a flat float32 vector of the model's size.
UPDATE_AUX = ("scaffold/dc",)
MODEL_AUX = ("scaffold/c",)


def aux_expect(header: dict, allowed: tuple[str, ...], numel: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The extra tensors a header's ``aux`` names (each one of ``allowed``, at most once)."""
    names = header.get("aux", [])
    if (
        not isinstance(names, list)
        or len(names) > len(allowed)
        or len(set(map(str, names))) != len(names)
        or not all(isinstance(n, str) and n in allowed for n in names)
    ):
        raise Malformed(f"header field 'aux' = {short_repr(names)} must list distinct names among {list(allowed)}")
    return {n: (torch.float32, (numel,)) for n in names}


def _check_aux(tensors: dict[str, torch.Tensor], names: dict) -> dict[str, torch.Tensor]:
    for n in names:
        check_delta(tensors[n], encoding=n)
    return {n: tensors[n] for n in names}


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
    if update.to_server:  # dense float32 beside the payload (zstd or not), named in the header
        header["aux"] = sorted(update.to_server)
        tensors = {**tensors, **{n: t.float() for n, t in update.to_server.items()}}
    return encode(tensors, header)


def unzstd(packed: torch.Tensor, max_bytes: int) -> bytes:
    """Decompress at most ``max_bytes`` (a small body must not inflate without bound)."""
    try:
        # the window a frame may ask for is bounded too: memory stays O(max_bytes)
        window = 1 << min(max(max_bytes.bit_length(), 20), 31)
        with zstandard.ZstdDecompressor(max_window_size=window).stream_reader(packed.numpy().tobytes()) as reader:
            return reader.read(max_bytes + 1)
    except zstandard.ZstdError as e:
        raise Malformed(f"tensor 'zstd' is not a valid zstd frame: {e}") from None


def decode_update(
    body: bytes | bytearray | memoryview,
    spec: ParamSpec,
    max_bytes: int | None = None,
    copy: bool = True,
    max_examples: int | None = None,
    max_abs: float = 0.0,
) -> tuple[Update, dict]:
    """Validated Update plus the raw header (for fields a caller adds, e.g. round ids).
    ``copy=False``: a dense delta is a view of ``body`` (see :func:`decode`).

    The header's ``encoding`` (dense | q8 | topk, plus ``zstd``) says which tensors must
    be present, with which dtypes and shapes; every one is checked, then the values
    (aggregation/compression.py), then the dense delta they decode to: finite (a q8
    scale whose every field is finite can still decode to Inf) and, with ``max_abs``
    > 0, no entry above it in magnitude. ``num_examples`` must be in [1, max_examples]
    (OutOfRange above it: one node must not outweigh a round by claiming 10^300).
    Tensors the header's ``aux`` names (:data:`UPDATE_AUX`) come back in ``Update.to_server``,
    checked finite."""
    max_bytes = max_bytes or default_max_bytes(spec)
    header, table = read_header(body, max_bytes)
    expect = expected_tensors(header, spec.numel)
    aux = aux_expect(header, UPDATE_AUX, spec.numel)
    zstd = header.get("zstd", False)
    if not isinstance(zstd, bool):
        raise Malformed(f"header field 'zstd' = {short_repr(zstd)} must be true or false")
    if zstd:
        size = table.get("zstd", {}).get("shape", [0])
        header, outer = decode(body, {"zstd": (torch.uint8, tuple(size)), **aux}, max_bytes, spec.hash)
        to_server = _check_aux(outer, aux)
        inner = unzstd(outer["zstd"], max_bytes)
        if len(inner) > max_bytes:
            raise TooLarge(f"zstd payload inflates to more than the limit of {max_bytes} bytes")
        _, tensors = decode(inner, expect, max_bytes)
    else:  # a dense delta is the tensor itself: check_delta below finds a NaN/Inf in the same pass as its range
        dense = header.get("encoding", "dense") == "dense"
        header, tensors = decode(body, {**expect, **aux}, max_bytes, spec.hash, check_finite=not dense, copy=copy)
        to_server = _check_aux(tensors, aux)
    if header.get("kind") != "update":
        raise Malformed(f"message kind is {short_repr(header.get('kind'))}, expected 'update'")
    fields = update_fields(header, max_examples)
    delta = decode_tensors(header, tensors, spec.numel)
    check_delta(delta, max_abs, header.get("encoding", "dense"))
    return Update(delta=delta, **fields, to_server=to_server), header


def update_fields(header: dict, max_examples: int | None = None) -> dict[str, Any]:
    """The scalar fields of an update header, each type- and range-checked."""
    limit = MAX_EXAMPLES if max_examples is None else max_examples
    n = header.get("num_examples")
    if isinstance(n, int) and not isinstance(n, bool) and n > limit:
        raise OutOfRange(
            f"header field 'num_examples' = {n} is above the limit of {limit} "
            "(server.max_examples; raise it if a node really trains on more per round)"
        )
    metrics = header.get("metrics", {})
    if (
        not isinstance(metrics, dict)
        or len(metrics) > MAX_METRICS
        or not all(
            isinstance(k, str)
            and len(k) <= MAX_NAME
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            for k, v in metrics.items()
        )
    ):
        raise Malformed(f"header field 'metrics' must map at most {MAX_METRICS} names to finite numbers")
    sender = header.get("sender", "")
    if not isinstance(sender, str) or len(sender) > MAX_NAME:
        raise Malformed(f"header field 'sender' must be a string of at most {MAX_NAME} characters")
    if "round" in header:
        _int_field(header, "round", 0)
    if not isinstance(header.get("spec_hash"), str):
        raise Malformed("header field 'spec_hash' must be a string")
    return dict(
        num_examples=_int_field(header, "num_examples", 1),
        base_version=_int_field(header, "base_version", 0),
        sender=sender,
        metrics={k: float(v) for k, v in metrics.items()},
    )


def check_delta(delta: torch.Tensor, max_abs: float = 0.0, encoding: str = "dense") -> None:
    """NonFinite unless every entry of the decoded delta is finite; OutOfRange if one is
    above ``max_abs`` in magnitude (``max_abs`` <= 0: no bound). One pass, no temporary."""
    if delta.numel() == 0:
        return
    low, high = (float(v) for v in torch.aminmax(delta))
    if not (math.isfinite(low) and math.isfinite(high)):  # aminmax propagates NaN
        bad = int((~torch.isfinite(delta)).sum())
        raise NonFinite(f"the {encoding} update decodes to {bad} NaN/Inf values")
    if max_abs > 0 and max(-low, high) > max_abs:
        raise OutOfRange(
            f"the {encoding} update has an entry of magnitude {max(-low, high):.4g}, above the limit "
            f"of {max_abs:g} (server.max_delta_abs)"
        )


def encode_model(
    flat: torch.Tensor,
    spec: ParamSpec,
    version: int,
    extra: dict[str, Any] | None = None,
    aux: dict[str, torch.Tensor] | None = None,
) -> bytes:
    """The model as a message; ``aux``: an algorithm's broadcast beside it (:data:`MODEL_AUX`)."""
    header = {"kind": "model", "spec_hash": spec.hash, "version": int(version), "spec": spec.to_json(), **(extra or {})}
    if aux:
        header["aux"] = sorted(aux)
    return encode({"params": flat.float(), **{n: t.float() for n, t in (aux or {}).items()}}, header)


def decode_model(body: bytes, spec: ParamSpec, max_bytes: int | None = None) -> tuple[torch.Tensor, dict]:
    """Validated flat parameters plus the header (``version`` among its fields); the broadcast
    tensors its ``aux`` names are in the header's ``"aux_tensors"``."""
    max_bytes = max_bytes or (default_max_bytes(spec) + 64 * len(spec.entries)) * (1 + len(MODEL_AUX))
    header, table = read_header(body, max_bytes)
    aux = aux_expect(header, MODEL_AUX, spec.numel)
    header, tensors = decode(body, {"params": (torch.float32, (spec.numel,)), **aux}, max_bytes, spec.hash)
    if header.get("kind") != "model":
        raise Malformed(f"message kind is {short_repr(header.get('kind'))}, expected 'model'")
    _int_field(header, "version", 0)
    if aux:
        header["aux_tensors"] = {n: tensors[n] for n in aux}
    return tensors["params"], header
