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
from typing import Any, cast

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
    hlen = header_length(body, len(body))
    return parse_table(body[8 : 8 + hlen], len(body) - 8 - hlen)


def header_length(prefix: bytes | bytearray | memoryview, size: int) -> int:
    """The safetensors header's length from a body's first 8 bytes (``size``: the whole body's)."""
    if size < 8 or len(prefix) < 8:
        raise Malformed(f"body of {size} bytes is truncated: a safetensors body starts with 8 length bytes")
    (hlen,) = struct.unpack("<Q", prefix[:8])
    if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
        raise Malformed(f"safetensors header length {hlen} does not fit a body of {size} bytes (truncated?)")
    return hlen


def parse_table(raw: bytes | bytearray | memoryview, data_len: int) -> tuple[dict[str, Any], dict[str, dict]]:
    """The shoal header and the tensor table of a safetensors header's JSON ``raw``, for a body
    with ``data_len`` bytes of tensor data after it (see :func:`read_header`)."""
    table = parse_json(raw, "safetensors header")
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


def check_tensors(table: dict[str, dict], expect: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """SpecMismatch unless the table holds exactly the ``expect`` tensors, with their dtypes and shapes."""
    if set(table) != set(expect):
        raise SpecMismatch(f"tensors {short_repr(sorted(table))} sent, expected {sorted(expect)}")
    for name, (dtype, shape) in expect.items():
        info = table[name]
        got = _DTYPES.get(info["dtype"])
        if got != dtype:
            raise SpecMismatch(f"tensor {name!r} has dtype {info['dtype']}, expected {dtype}")
        if tuple(info["shape"]) != tuple(shape):
            raise SpecMismatch(f"tensor {name!r} has shape {info['shape']}, expected {list(shape)}")


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
    check_tensors(table, expect)
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


def update_header(update: Update, spec: ParamSpec, payload: Encoded, extra: dict[str, Any] | None) -> dict[str, Any]:
    """An update message's header: its encoding's fields, the update's scalars, then ``extra``."""
    return {
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
    header = update_header(update, spec, payload, extra)
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


#: Encodings whose one tensor ``delta`` is the dense update itself, in this dtype: their values are
#: checked as the bytes arrive (:class:`UpdateStream`) and can be summed a block at a time.
STREAMED_DTYPES = {"dense": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: Values checked at once while an update streams in: 1 MiB of float32 (it stays in cache).
STREAM_CHECK_BYTES = 1 << 20


class UpdateStream:
    """Checks an update's body as its bytes arrive, in order (sans-I/O: :meth:`feed` them).

    As soon as the safetensors header is complete it is checked as :func:`decode_update` checks
    it (bounds, spec hash, tensor names, dtypes and shapes, kind, the scalar fields); for a dense
    or half-precision delta (``STREAMED_DTYPES``) every value is then checked as it comes (finite,
    and at most ``max_abs`` in magnitude), so a bad update is refused at its first bad chunk and
    a complete one needs no second look at its values. Other encodings (q8, top-k, zstd) are
    small: their values are checked whole at the end (``dtype`` is None). A WireError names the
    first fault; nothing of the body is kept but its header."""

    def __init__(self, spec: ParamSpec, size: int, max_bytes: int, max_examples: int | None, max_abs: float = 0.0):
        if size > max_bytes:
            raise TooLarge(f"an update of {size} bytes is over the limit of {max_bytes} bytes")
        self.spec, self.size, self.max_examples, self.max_abs = spec, size, max_examples, max_abs
        self.received = 0
        self.header: dict[str, Any] | None = None
        self.data_start = 0  # where the tensor data begins in the body, once the header is read
        self.dtype: torch.dtype | None = None  # the streamed delta's dtype (None: checked whole at the end)
        self._head = bytearray()
        self._carry = bytearray()  # the bytes of a value split across two feeds

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The body's next bytes (in order); a WireError at the first fault."""
        view = memoryview(data).cast("B")
        if self.received + len(view) > self.size:
            raise Malformed(f"the body is longer than the {self.size} bytes it was announced with")
        self.received += len(view)
        if self.header is None:
            if len(self._head) < 8:
                take = min(8 - len(self._head), len(view))
                self._head += view[:take]
                view = view[take:]
                if len(self._head) < 8:
                    return
                self.data_start = 8 + header_length(self._head, self.size)
            take = min(self.data_start - len(self._head), len(view))
            self._head += view[:take]
            view = view[take:]
            if len(self._head) < self.data_start:
                return
            self._read_header()
        if self.dtype is not None and len(view):
            self._check_values(view)

    def _read_header(self) -> None:
        header, table = parse_table(memoryview(self._head)[8:], self.size - self.data_start)
        if header.get("spec_hash") != self.spec.hash:
            raise SpecMismatch(
                f"spec hash {short_repr(header.get('spec_hash'))} does not match this model's {self.spec.hash!r} "
                "(different architecture or parameter layout)"
            )
        if header.get("kind") != "update":
            raise Malformed(f"message kind is {short_repr(header.get('kind'))}, expected 'update'")
        zstd = header.get("zstd", False)
        if not isinstance(zstd, bool):
            raise Malformed(f"header field 'zstd' = {short_repr(zstd)} must be true or false")
        aux = aux_expect(header, UPDATE_AUX, self.spec.numel)  # an algorithm's tensors beside the delta
        if zstd:
            check_tensors(table, {"zstd": (torch.uint8, tuple(table.get("zstd", {}).get("shape", [0]))), **aux})
        else:
            check_tensors(table, {**expected_tensors(header, self.spec.numel), **aux})
        update_fields(header, self.max_examples)
        self.header = header
        encoding = header.get("encoding", "dense")
        # streamed: one delta tensor that is all the data; anything else is checked whole at the end
        self.dtype = None if zstd or aux else STREAMED_DTYPES.get(encoding)
        self._head = bytearray()

    def _check_values(self, view: memoryview) -> None:
        assert self.dtype is not None
        width = self.dtype.itemsize
        if self._carry:  # complete the value the previous feed split
            take = min(width - len(self._carry), len(view))
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) < width:
                return
            check_delta(torch.frombuffer(bytearray(self._carry), dtype=self.dtype), self.max_abs, self._encoding)
            self._carry = bytearray()
        whole = len(view) - len(view) % width
        for a in range(0, whole, STREAM_CHECK_BYTES):
            b = min(a + STREAM_CHECK_BYTES, whole)
            block = view[a:b] if not view.readonly else bytearray(view[a:b])  # torch reads writable buffers
            check_delta(torch.frombuffer(block, dtype=self.dtype), self.max_abs, self._encoding)
        self._carry += view[whole:]

    @property
    def _encoding(self) -> str:
        return str((self.header or {}).get("encoding", "dense"))

    @property
    def complete(self) -> bool:
        return self.received == self.size and self.header is not None


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


def tensor_parts(name: str, tensor: torch.Tensor, header: dict[str, Any]) -> tuple[bytes, memoryview]:
    """A message of one flat tensor in two parts, ``(head, data)``: the safetensors header (with
    ``header`` as its shoal header), and the tensor's own memory (no copy; the tensor stays alive
    while ``data`` does). Their concatenation is a body :func:`decode` reads, so a model or an
    update of any size is sent without being built, and a range of it without the rest."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    dtype = next((k for k, v in _DTYPES.items() if v == t.dtype), None)
    if dtype is None:
        raise ValueError(f"a {t.dtype} tensor has no wire dtype")
    table = {
        "__metadata__": {"shoal": json.dumps({"format": FORMAT, **header}, separators=(",", ":"))},
        name: {"dtype": dtype, "shape": [t.numel()], "data_offsets": [0, t.numel() * t.element_size()]},
    }
    raw = json.dumps(table, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    data = memoryview(cast(Any, t.view(torch.uint8).numpy())) if t.numel() else memoryview(b"")
    return struct.pack("<Q", len(raw)) + raw, data


def model_parts(
    flat: torch.Tensor, spec: ParamSpec, version: int, extra: dict[str, Any] | None = None
) -> tuple[bytes, memoryview]:
    """:func:`encode_model` as ``(head, data)`` parts (:func:`tensor_parts`): the float32 parameters' own memory."""
    header = {"kind": "model", "spec_hash": spec.hash, "version": int(version), "spec": spec.to_json(), **(extra or {})}
    return tensor_parts("params", flat.float(), header)


def update_parts(
    update: Update,
    spec: ParamSpec,
    extra: dict[str, Any] | None = None,
    payload: Encoded | None = None,
    zstd_level: int = 0,
) -> list[bytes | memoryview]:
    """:func:`encode_update` as parts whose concatenation is the body: a dense or half-precision
    delta as the header and the tensor's own memory (no copy of the update); other encodings
    (small) as one encoded body."""
    payload = payload or Encoded("dense", {"delta": update.delta.float()})
    whole = zstd_level or update.to_server or set(payload.tensors) != {"delta"}
    if whole or payload.encoding not in STREAMED_DTYPES:  # several tensors (or small ones): one body
        return [encode_update(update, spec, extra, payload, zstd_level)]
    header = update_header(update, spec, payload, extra)
    head, data = tensor_parts("delta", payload.tensors["delta"], header)
    return [head, data]


def decode_model(
    body: bytes | bytearray | memoryview, spec: ParamSpec, max_bytes: int | None = None, copy: bool = True
) -> tuple[torch.Tensor, dict]:
    """Validated flat parameters plus the header (``version`` among its fields); the broadcast
    tensors its ``aux`` names are in the header's ``"aux_tensors"``. ``copy=False`` on a writable
    buffer: the parameters are a view of it (see :func:`decode`)."""
    max_bytes = max_bytes or (default_max_bytes(spec) + 64 * len(spec.entries)) * (1 + len(MODEL_AUX))
    header, table = read_header(body, max_bytes)
    aux = aux_expect(header, MODEL_AUX, spec.numel)
    header, tensors = decode(body, {"params": (torch.float32, (spec.numel,)), **aux}, max_bytes, spec.hash, copy=copy)
    if header.get("kind") != "model":
        raise Malformed(f"message kind is {short_repr(header.get('kind'))}, expected 'model'")
    _int_field(header, "version", 0)
    if aux:
        header["aux_tensors"] = {n: tensors[n] for n in aux}
    return tensors["params"], header
