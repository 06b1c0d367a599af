"""Secure aggregation messages on the wire (shoal.wire: safetensors + JSON header).

What an HTTP or peer-to-peer transport needs to move the :mod:`secagg` messages: the
masked vector travels as one int32 tensor (the uint32 bits, unchanged), everything
else (32-byte keys, ciphertexts as base64, shares as integer lists) in the header.
Decoding checks kinds, types, sizes and ranges and raises a typed WireError
(``Malformed``) before anything reaches a state machine.
"""

from __future__ import annotations

import base64
from typing import Any, TypeGuard

import numpy as np
import torch

from shoal.errors import Malformed
from shoal.wire import MAX_HEADER_BYTES, decode, encode, read_header

from . import crypto as C
from .protocol import (
    ConsistencyRequest,
    ConsistencySignature,
    EncryptedShares,
    KeyDirectory,
    MaskedInput,
    MaskedSum,
    PeerKeys,
    PublicKeys,
    SecAggParams,
    ShareDelivery,
    UnmaskRequest,
    UnmaskShares,
)

Message = (
    PublicKeys
    | KeyDirectory
    | EncryptedShares
    | ShareDelivery
    | MaskedInput
    | MaskedSum
    | UnmaskRequest
    | UnmaskShares
    | ConsistencyRequest
    | ConsistencySignature
)
SIGNATURE_BYTES = 64


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode()


def _bytes(v: Any, what: str, size: int | None = None) -> bytes:
    try:
        out = base64.b64decode(v, validate=True) if isinstance(v, str) else None
    except ValueError:  # not base64, or a str with non-ASCII characters (b64decode raises ValueError)
        out = None
    if out is None or (size is not None and len(out) != size):
        raise Malformed(f"{what}: expected base64 of {size or 'some'} bytes")
    return out


def _str(v: Any, what: str) -> str:
    if not isinstance(v, str) or not v:
        raise Malformed(f"{what}: expected a non-empty string")
    return v


def _is_ids(v: Any) -> TypeGuard[list[str]]:
    return isinstance(v, list) and all(isinstance(i, str) for i in v)


def _shares(v: Any, what: str) -> np.ndarray:
    if not (
        isinstance(v, list)
        and len(v) == C.CHUNKS
        and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < C.PRIME for x in v)
    ):
        raise Malformed(f"{what}: expected {C.CHUNKS} integers in [0, 2^31 - 1)")
    return np.array(v, dtype=np.int64)


def _dict(v: Any, what: str) -> dict:
    if not isinstance(v, dict):
        raise Malformed(f"{what}: expected an object")
    return v


def encode_message(msg: Message, meta: dict[str, Any] | None = None) -> bytes:
    """One message as a shoal wire body; ``meta`` (JSON) travels beside it in the header
    (the HTTP rounds put the round number and clear-text metadata there)."""
    tensors: dict[str, torch.Tensor] = {}
    h: dict[str, Any]
    if isinstance(msg, PublicKeys):
        h = {"kind": "public_keys", "sender": msg.sender, "enc_key": _b64(msg.enc_key), "mask_key": _b64(msg.mask_key)}
        if msg.signature:
            h["signature"] = _b64(msg.signature)
    elif isinstance(msg, KeyDirectory):
        h = {
            "kind": "key_directory",
            "recipient": msg.recipient,
            "threshold": msg.threshold,
            "peers": {
                v: [p.index, _b64(p.enc_key), _b64(p.mask_key), *([_b64(p.signature)] if p.signature else [])]
                for v, p in msg.peers.items()
            },
        }
    elif isinstance(msg, ConsistencyRequest):
        h = {"kind": "consistency_request", "recipient": msg.recipient, "survivors": list(msg.survivors)}
    elif isinstance(msg, ConsistencySignature):
        h = {"kind": "consistency_signature", "sender": msg.sender, "signature": _b64(msg.signature)}
    elif isinstance(msg, EncryptedShares):
        h = {
            "kind": "encrypted_shares",
            "sender": msg.sender,
            "ciphertexts": {v: _b64(c) for v, c in msg.ciphertexts.items()},
        }
    elif isinstance(msg, ShareDelivery):
        h = {
            "kind": "share_delivery",
            "recipient": msg.recipient,
            "ciphertexts": {v: _b64(c) for v, c in msg.ciphertexts.items()},
        }
    elif isinstance(msg, MaskedInput):
        h = {"kind": "masked_input", "sender": msg.sender}
        tensors["masked"] = torch.from_numpy(np.ascontiguousarray(msg.vector, dtype=np.uint32).view(np.int32))
    elif isinstance(msg, MaskedSum):  # an edge's sum of its nodes' masked inputs (tiers.py)
        h = {"kind": "masked_sum", "origin": msg.origin, "senders": list(msg.senders)}
        tensors["masked"] = torch.from_numpy(np.ascontiguousarray(msg.vector, dtype=np.uint32).view(np.int32))
    elif isinstance(msg, UnmaskRequest):
        h = {
            "kind": "unmask_request",
            "recipient": msg.recipient,
            "survivors": list(msg.survivors),
            "dropped": list(msg.dropped),
        }
        if msg.signatures:
            h["signatures"] = {v: _b64(sig) for v, sig in msg.signatures.items()}
    elif isinstance(msg, UnmaskShares):
        h = {
            "kind": "unmask_shares",
            "sender": msg.sender,
            "self_mask": {v: [int(x) for x in s] for v, s in msg.self_mask.items()},
            "mask_key": {v: [int(x) for x in s] for v, s in msg.mask_key.items()},
        }
    else:
        raise TypeError(f"not a secure aggregation message: {type(msg).__name__}")
    if meta is not None:
        h["meta"] = meta
    return encode(tensors, h)


def message_meta(body: bytes, vector_size: int, max_bytes: int | None = None) -> dict[str, Any]:
    """The ``meta`` object that :func:`encode_message` put beside a message ({} if none)."""
    header, _ = read_header(body, max_bytes or 4 * vector_size + 2 * MAX_HEADER_BYTES)
    return _dict(header.get("meta", {}), "meta")


def params_to_json(params: SecAggParams) -> dict[str, Any]:
    """The round's protocol parameters as a server hands them to its nodes."""
    return {
        "session": _b64(params.session),
        "vector_size": params.vector_size,
        "graph": params.graph,
        "degree": params.degree,
        "threshold_fraction": params.threshold_fraction,
        "expected_dropout": params.expected_dropout,
        "graph_seed": params.graph_seed,
        "malicious": params.malicious,
        "min_inputs": params.min_inputs,
    }


def params_from_json(d: Any) -> SecAggParams:
    """Inverse of :func:`params_to_json`, validated (Malformed on anything off)."""
    d = _dict(d, "secure_aggregation")
    try:
        return SecAggParams(
            session=_bytes(d.get("session"), "session"),
            vector_size=int(d["vector_size"]),
            graph=str(d["graph"]),
            degree=int(d["degree"]),
            threshold_fraction=float(d["threshold_fraction"]),
            expected_dropout=float(d["expected_dropout"]),
            graph_seed=int(d["graph_seed"]),
            malicious=d.get("malicious", False) is True,
            min_inputs=_min_inputs(d.get("min_inputs", 1)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise Malformed(f"secure_aggregation parameters: {e}") from None


def _min_inputs(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**31:
        raise ValueError(f"min_inputs must be an integer >= 1, got {str(v)[:40]}")
    return v


def decode_message(body: bytes, vector_size: int, max_bytes: int | None = None) -> Message:
    """The message in ``body``; ``vector_size`` is the round's masked vector length."""
    limit = max_bytes or 4 * vector_size + 2 * MAX_HEADER_BYTES
    header, _ = read_header(body, limit)
    kind = header.get("kind")
    if kind == "masked_input":
        header, tensors = decode(body, {"masked": (torch.int32, (vector_size,))}, limit)
        return MaskedInput(_str(header.get("sender"), "sender"), tensors["masked"].numpy().view(np.uint32).copy())
    if kind == "masked_sum":
        header, tensors = decode(body, {"masked": (torch.int32, (vector_size,))}, limit)
        senders = header.get("senders")
        if not _is_ids(senders) or not senders or len(set(senders)) != len(senders):
            raise Malformed("senders: expected a list of distinct client ids, at least one")
        if not all(0 < len(s) <= 256 for s in senders):
            raise Malformed("senders: every id is a string of 1 to 256 characters")
        vector = tensors["masked"].numpy().view(np.uint32).copy()
        return MaskedSum(_str(header.get("origin"), "origin"), tuple(senders), vector)
    _, tensors = decode(body, {}, limit)
    if kind == "public_keys":
        sig = header.get("signature")
        return PublicKeys(
            _str(header.get("sender"), "sender"),
            _bytes(header.get("enc_key"), "enc_key", 32),
            _bytes(header.get("mask_key"), "mask_key", 32),
            b"" if sig is None else _bytes(sig, "signature", SIGNATURE_BYTES),
        )
    if kind == "key_directory":
        peers = {}
        for v, p in _dict(header.get("peers"), "peers").items():
            if not (
                isinstance(p, list)
                and len(p) in (3, 4)
                and isinstance(p[0], int)
                and not isinstance(p[0], bool)
                and 1 <= p[0] < C.PRIME
            ):
                raise Malformed(f"peers[{v!r}]: expected [index >= 1, enc_key, mask_key(, signature)]")
            peers[v] = PeerKeys(
                p[0],
                _bytes(p[1], f"peers[{v!r}].enc_key", 32),
                _bytes(p[2], f"peers[{v!r}].mask_key", 32),
                _bytes(p[3], f"peers[{v!r}].signature", SIGNATURE_BYTES) if len(p) == 4 else b"",
            )
        t = header.get("threshold")
        if not isinstance(t, int) or t < 1:
            raise Malformed("threshold: expected an integer >= 1")
        return KeyDirectory(_str(header.get("recipient"), "recipient"), t, peers)
    if kind in ("encrypted_shares", "share_delivery"):
        cts = {v: _bytes(c, f"ciphertexts[{v!r}]") for v, c in _dict(header.get("ciphertexts"), "ciphertexts").items()}
        if kind == "encrypted_shares":
            return EncryptedShares(_str(header.get("sender"), "sender"), cts)
        return ShareDelivery(_str(header.get("recipient"), "recipient"), cts)
    if kind == "unmask_request":
        survivors, dropped = header.get("survivors"), header.get("dropped")
        if not (_is_ids(survivors) and _is_ids(dropped)):
            raise Malformed("survivors and dropped: expected lists of client ids")
        sigs = {
            v: _bytes(b, f"signatures[{v!r}]", SIGNATURE_BYTES)
            for v, b in _dict(header.get("signatures", {}), "signatures").items()
        }
        return UnmaskRequest(_str(header.get("recipient"), "recipient"), survivors, dropped, sigs)
    if kind == "consistency_request":
        survivors = header.get("survivors")
        if not _is_ids(survivors):
            raise Malformed("survivors: expected a list of client ids")
        return ConsistencyRequest(_str(header.get("recipient"), "recipient"), survivors)
    if kind == "consistency_signature":
        return ConsistencySignature(
            _str(header.get("sender"), "sender"), _bytes(header.get("signature"), "signature", SIGNATURE_BYTES)
        )
    if kind == "unmask_shares":
        return UnmaskShares(
            _str(header.get("sender"), "sender"),
            {v: _shares(s, f"self_mask[{v!r}]") for v, s in _dict(header.get("self_mask"), "self_mask").items()},
            {v: _shares(s, f"mask_key[{v!r}]") for v, s in _dict(header.get("mask_key"), "mask_key").items()},
        )
    raise Malformed(f"kind = {kind!r} is not a secure aggregation message")
