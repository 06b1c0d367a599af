"""Gossip model messages on the wire, optionally compressed per ``[compression]``.

A gossip message carries a whole model, not a delta against a model both sides hold,
so of the three update encodings (aggregation/compression.py) two apply:

- ``dense``: the float32 model, tensor ``params`` (the plain ``shoal.wire`` model
  message, so uncompressed peers and old readers see no difference);
- ``q8``: the model itself stochastically quantized to 8 bits with one scale per chunk
  (unbiased: ``E[decoded] = model``), about a quarter of the bytes;
- ``zstd`` on top of either (header ``"zstd": true``).

``topk`` is refused (config): keeping the k largest coordinates of a *model* throws the
rest of it away, and error feedback needs a reference both sides share (the previous
model exchanged between the two peers), which push-pull with random partners does not
keep. The header names the encoding, so a receiver decodes whatever a sender chose;
every field and tensor is checked (shoal.wire + compression.expected_tensors) before
the dense model is built, and a model with NaN/Inf is rejected.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
import zstandard

from shoal.aggregation.compression import Compressor, Encoded, decode_tensors, expected_tensors
from shoal.config import CompressionConfig
from shoal.errors import Malformed, SpecMismatch, TooLarge
from shoal.params import ParamSpec
from shoal.wire import decode, decode_model, encode, encode_model, read_header, unzstd

if TYPE_CHECKING:
    from .group_average import SliceMessage
    from .secure_group import SecureMessage

MODEL_ENCODINGS = ("dense", "float16", "bfloat16", "q8")


def encode_gossip_model(
    params: torch.Tensor,
    spec: ParamSpec,
    version: int,
    extra: dict[str, Any],
    cfg: CompressionConfig | None = None,
    seed: int = 0,
) -> bytes:
    """The model as a message body; q8 and zstd per ``cfg`` (dense when None)."""
    cfg = cfg or CompressionConfig()
    if cfg.encoding not in MODEL_ENCODINGS:
        raise ValueError(f"compression.encoding = {cfg.encoding!r} does not apply to gossip models ({MODEL_ENCODINGS})")
    if cfg.encoding == "dense" and not cfg.zstd:
        return encode_model(params, spec, version, extra)
    if cfg.encoding != "dense":  # q8 quantizes the model itself; float16 / bfloat16 round it to half precision
        payload = Compressor(cfg).encode(params, seed=seed)
    else:
        payload = Encoded("dense", {"params": params.detach().float()})
    tensors = payload.tensors
    header = {
        "kind": "model",
        "spec_hash": spec.hash,
        "version": int(version),
        "encoding": cfg.encoding,
        **payload.header,
        **extra,
    }
    if cfg.zstd:
        packed = zstandard.ZstdCompressor(level=cfg.zstd_level).compress(encode(tensors, {"kind": "payload"}))
        tensors = {"zstd": torch.frombuffer(bytearray(packed), dtype=torch.uint8)}
        header["zstd"] = True
    return encode(tensors, header)


def decode_gossip_model(body: bytes, spec: ParamSpec, max_bytes: int) -> tuple[torch.Tensor, dict]:
    """Validated dense float32 model plus the header, whatever encoding the header names."""
    header, table = read_header(body, max_bytes)
    encoding = header.get("encoding", "dense")
    zstd = header.get("zstd", False)
    if not isinstance(zstd, bool):
        raise Malformed(f"header field 'zstd' = {zstd!r} must be true or false")
    if encoding == "dense" and not zstd:
        return decode_model(body, spec, max_bytes)
    if encoding not in MODEL_ENCODINGS:
        raise Malformed(
            f"header field 'encoding' = {encoding!r}: a gossip model is one of {', '.join(MODEL_ENCODINGS)}"
        )
    expect: dict[str, tuple[torch.dtype, tuple[int, ...]]] = (
        {"params": (torch.float32, (spec.numel,))} if encoding == "dense" else expected_tensors(header, spec.numel)
    )
    if zstd:
        size = table.get("zstd", {}).get("shape", [0])
        header, outer = decode(body, {"zstd": (torch.uint8, tuple(size))}, max_bytes, spec.hash)
        inner = unzstd(outer["zstd"], max_bytes)
        if len(inner) > max_bytes:
            raise TooLarge(f"zstd payload inflates to more than the limit of {max_bytes} bytes")
        _, tensors = decode(inner, expect, max_bytes)
    else:
        header, tensors = decode(body, expect, max_bytes, spec.hash)
    if header.get("kind") != "model":
        raise Malformed(f"message kind is {header.get('kind')!r}, expected 'model'")
    version = header.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise Malformed(f"header field 'version' must be an integer >= 0, got {version!r}")
    params = tensors["params"] if encoding == "dense" else decode_tensors(header, tensors, spec.numel)
    return params.float(), header


# --- group averaging: one slice of a model (p2p/group_average.py) ---------------------------

SLICE_KIND = "group_slice"
MAX_GROUP_MEMBERS = 1024


def encode_slice(msg: SliceMessage, spec: ParamSpec) -> bytes:
    """A group-averaging slice message: the float32 slice and its protocol fields in the header."""
    header = {
        "kind": SLICE_KIND,
        "spec_hash": spec.hash,
        "sender": msg.sender,
        "target": msg.target,
        "round": msg.round,
        "group": msg.group,
        "members": list(msg.members),
        "slice": msg.slice,
        "phase": msg.phase,
        "weight": msg.weight,
        "count": msg.count,
        "level": msg.level,
    }
    return encode({"data": msg.data.detach().float()}, header)


def _field(header: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    v = header.get(key)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise Malformed(f"header field {key!r} = {v!r} must be {getattr(kind, '__name__', kind)}")
    return v


def decode_slice(body: bytes, spec: ParamSpec, max_bytes: int) -> SliceMessage:
    """A validated slice message (size, spec hash, fields, a finite float32 vector no longer
    than the model); whether it fits the receiver's group is the protocol's check."""
    from .group_average import SliceMessage

    header, table = read_header(body, max_bytes)
    if header.get("kind") != SLICE_KIND:
        raise Malformed(f"message kind is {header.get('kind')!r}, expected {SLICE_KIND!r}")
    shape = table.get("data", {}).get("shape")
    if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int) and 0 <= shape[0] <= spec.numel):
        raise Malformed(f"tensor 'data' must be a vector of at most {spec.numel} values, got shape {shape!r}")
    header, tensors = decode(body, {"data": (torch.float32, (shape[0],))}, max_bytes, spec.hash)
    members = _field(header, "members", list)
    if not 2 <= len(members) <= MAX_GROUP_MEMBERS or not all(isinstance(m, str) and 0 < len(m) <= 256 for m in members):
        raise Malformed(f"header field 'members' must list 2..{MAX_GROUP_MEMBERS} peer ids")
    weight = _field(header, "weight", (int, float))
    strings = {k: _field(header, k, str) for k in ("sender", "target", "group", "phase")}
    ints = {k: _field(header, k, int) for k in ("round", "slice", "count", "level")}
    if ints["round"] < 0 or not 0 <= ints["level"] < 64:
        raise Malformed("header fields 'round' must be >= 0 and 'level' in [0, 64)")
    return SliceMessage(
        strings["sender"],
        strings["target"],
        ints["round"],
        strings["group"],
        tuple(members),
        ints["slice"],
        strings["phase"],
        float(weight),
        tensors["data"].float(),
        ints["count"],
        ints["level"],
    )


# --- secure groups: a secure aggregation message between a group's members (p2p/secure_group.py) --


def encode_secure(msg: SecureMessage, spec: ParamSpec) -> bytes:
    """A secure group message: secagg messages as shoal.aggregation.secagg.wire writes them, the
    group's mean as a float32 tensor; routing and example counts in ``meta``."""
    from shoal.aggregation.secagg.wire import encode_message

    meta = {
        "spec_hash": spec.hash,
        "sender": msg.sender,
        "target": msg.target,
        "round": msg.round,
        "group": msg.group,
        "members": list(msg.members),
        "kind": msg.kind,
        "meta": dict(msg.meta),
    }
    if msg.kind == "mean":
        return encode({"mean": msg.payload.detach().float()}, {"kind": "secure_group_mean", "meta": meta})
    if msg.kind == "abort":
        return encode({}, {"kind": "secure_group_abort", "meta": meta})
    return encode_message(msg.payload, meta)


def decode_secure(body: bytes, spec: ParamSpec, max_bytes: int) -> SecureMessage:
    """A validated secure group message (wire checks, spec hash, routing fields, payload kind)."""
    from shoal.aggregation.secagg.wire import decode_message

    from .secure_group import TO_MEMBER, TO_RELAY, SecureMessage

    header, _ = read_header(body, max_bytes)
    meta = header.get("meta")
    if not isinstance(meta, dict):
        raise Malformed("a secure group message carries a 'meta' object")
    if meta.get("spec_hash") != spec.hash:
        raise SpecMismatch(
            f"the message has spec hash {meta.get('spec_hash')!r}, this peer's model {spec.hash!r}: "
            "another task, [task.args] or architecture"
        )
    kind = _field(meta, "kind", str)
    if kind not in TO_RELAY + TO_MEMBER:
        raise Malformed(f"kind {kind!r} is not a secure group message")
    members = _field(meta, "members", list)
    if not 2 <= len(members) <= MAX_GROUP_MEMBERS or not all(isinstance(m, str) and 0 < len(m) <= 256 for m in members):
        raise Malformed(f"meta field 'members' must list 2..{MAX_GROUP_MEMBERS} peer ids")
    extra = meta.get("meta", {})
    if not isinstance(extra, dict) or len(json.dumps(extra)) > 4096:
        raise Malformed("meta field 'meta' must be a small object")
    if kind == "mean":
        _, tensors = decode(body, {"mean": (torch.float32, (spec.numel,))}, max_bytes)
        payload: Any = tensors["mean"]
    elif kind == "abort":
        decode(body, {}, max_bytes)
        payload = None
    else:
        payload = decode_message(body, spec.numel + 1, max_bytes)
    return SecureMessage(
        _field(meta, "sender", str),
        _field(meta, "target", str),
        _field(meta, "round", int),
        _field(meta, "group", str),
        tuple(members),
        kind,
        payload,
        extra,
    )
