"""The one parser for everything a peer receives: bodies in, typed messages out, or a WireError.

Every body from the network (a pushed or answered model, a D-PSGD model, a group slice, a
secure group message, a shuffle, another peer's error answer) comes through here and
nowhere else. Each check is the server's (shoal.wire: size, safetensors bounds, JSON with
bounded nesting, integers of at most 19 digits, no duplicate keys, spec hash, dtypes,
shapes, finite values), plus the peer's own:

- every peer address (sender, target, shuffle entry, group member) passes
  p2p/addresses.py ``check_url`` (https only unless insecure, no userinfo, valid host);
- ages, versions, steps, rounds and counts are integers (``true`` is not 1) in
  ``0..MAX_COUNT``, so nothing a peer adopts can outgrow the wire;
- weights are finite and positive; every model value is finite and within ``max_abs``
  (``gossip.max_abs``; decoded values included: a q8 scale can decode to Inf).

Nothing here touches the peer's state: a message that fails any check leaves no trace.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from shoal.errors import Malformed, OutOfRange, ShoalError, WireError
from shoal.params import ParamSpec
from shoal.wire import MAX_HEADER_BYTES, parse_json

from .addresses import check_url
from .dpsgd import MixMessage
from .gossip import MAX_COUNT, ModelMessage
from .group_average import PHASES, SliceMessage
from .membership import ShuffleRequest, ShuffleResponse
from .model_wire import MAX_GROUP_MEMBERS, decode_gossip_model, decode_secure, decode_slice
from .secure_group import SecureMessage

MAX_SHUFFLE_BYTES = 64 * 1024
MAX_ERROR_BYTES = 4096

_Shuffle = TypeVar("_Shuffle", ShuffleRequest, ShuffleResponse)


@dataclass(frozen=True)
class Limits:
    """What a peer accepts: its model's spec, the body limit, whether plain http is allowed,
    the largest absolute model value and the shuffle's entry count."""

    spec: ParamSpec
    max_bytes: int
    insecure: bool = False
    max_abs: float = 1e4
    max_entries: int = 8


class Refused(ShoalError):
    """Another peer answered our message with an error (its code and detail)."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"HTTP {status} {code}: {detail}")
        self.status, self.code, self.detail = status, code, detail


def count(value: Any, key: str, minimum: int = 0) -> int:
    """An integer field in ``minimum..MAX_COUNT`` (a bool is no integer)."""
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_COUNT:
        raise OutOfRange(f"field {key!r} must be an integer in {minimum}..{MAX_COUNT}, got {str(value)[:40]!r}")
    return value


def address(value: Any, key: str, lim: Limits) -> str:
    try:
        return check_url(value, lim.insecure)
    except Malformed as e:
        raise Malformed(f"field {key!r}: {e}") from None


def check_values(t: torch.Tensor, lim: Limits, what: str) -> torch.Tensor:
    """``t`` if every value is finite and within ``lim.max_abs`` (0: finite only)."""
    if t.numel() == 0:
        return t
    if not bool(torch.isfinite(t).all()):
        raise OutOfRange(f"{what} holds NaN or Inf after decoding")
    if lim.max_abs > 0 and float(t.abs().max()) > lim.max_abs:
        raise OutOfRange(f"{what} holds a value beyond {lim.max_abs:g} in absolute value (gossip.max_abs)")
    return t


def peek_spec_hash(body: bytes | bytearray) -> str | None:
    """The ``spec_hash`` a message names in its header (a model's, or a secure message's ``meta``),
    read from its first bytes even when the body is too large or broken; None if it names none."""
    try:
        if len(body) < 8:
            return None
        (hlen,) = struct.unpack("<Q", bytes(body[:8]))
        if hlen > MAX_HEADER_BYTES or hlen > len(body) - 8:
            return None
        table = parse_json(bytes(body[8 : 8 + hlen]), "safetensors header")
        meta = table.get("__metadata__") if isinstance(table, dict) else None
        text = meta.get("shoal") if isinstance(meta, dict) else None
        header = parse_json(text, "shoal header") if isinstance(text, str) else None
    except WireError:
        return None
    if not isinstance(header, dict):
        return None
    value = header.get("spec_hash")
    if value is None and isinstance(header.get("meta"), dict):
        value = header["meta"].get("spec_hash")
    return value if isinstance(value, str) else None


def parse_model(body: bytes, lim: Limits, target: str, reply: bool) -> ModelMessage:
    """A pushed model (``POST /gossip``) or the answer to ours."""
    params, header = decode_gossip_model(body, lim.spec, lim.max_bytes)
    return ModelMessage(
        address(header.get("sender"), "sender", lim),
        target,
        check_values(params, lim, "the model"),
        count(header.get("age"), "age"),
        count(header.get("version"), "version"),
        count(header.get("num_examples"), "num_examples", 1),
        reply,
        count(header.get("seq"), "seq", 1),
    )


def parse_mix(body: bytes, lim: Limits, target: str, reply: bool) -> MixMessage:
    """A D-PSGD model for one mixing step (``POST /dpsgd``) or the answer to ours. The mix does not
    use the sender's age, example count or version, but they are checked like a pushed model's."""
    params, header = decode_gossip_model(body, lim.spec, lim.max_bytes)
    count(header.get("age"), "age")
    count(header.get("version"), "version")
    count(header.get("num_examples"), "num_examples", 1)
    return MixMessage(
        address(header.get("sender"), "sender", lim),
        target,
        count(header.get("step"), "step"),
        check_values(params, lim, "the model"),
        reply,
        count(header.get("seq"), "seq", 1),
    )


def _members(members: tuple[str, ...], lim: Limits) -> tuple[str, ...]:
    out = tuple(address(m, "members", lim) for m in members)
    if len(set(out)) != len(out):
        raise Malformed("a group names a member twice")
    return out


def parse_slice(body: bytes, lim: Limits) -> SliceMessage:
    """A group averaging slice (``POST /group``); whether it fits our group is the protocol's check."""
    msg = decode_slice(body, lim.spec, lim.max_bytes)
    if msg.phase not in PHASES:
        raise Malformed(f"phase {msg.phase[:40]!r} is not one of {PHASES}")
    if not (math.isfinite(msg.weight) and 0 < msg.weight <= 2.0**60):
        raise OutOfRange(f"weight {msg.weight!r} must be finite and positive")
    if len(msg.group) > 256:
        raise Malformed("field 'group' is over 256 characters")
    count(msg.count, "count", 1)
    count(msg.round, "round")
    if not 0 <= msg.slice < MAX_GROUP_MEMBERS:
        raise OutOfRange(f"slice {msg.slice} is not in 0..{MAX_GROUP_MEMBERS - 1}")
    return SliceMessage(
        address(msg.sender, "sender", lim),
        address(msg.target, "target", lim),
        msg.round,
        msg.group,
        _members(msg.members, lim),
        msg.slice,
        msg.phase,
        msg.weight,
        check_values(msg.data, lim, "the slice"),
        msg.count,
        msg.level,
    )


def parse_secure(body: bytes, lim: Limits) -> SecureMessage:
    """A secure group message (``POST /secure``); the secagg payload is checked by its own decoder."""
    msg = decode_secure(body, lim.spec, lim.max_bytes)
    count(msg.round, "round")
    if len(msg.group) > 256:
        raise Malformed("field 'group' is over 256 characters")
    payload = msg.payload
    if msg.kind == "mean":
        payload = check_values(payload, lim, "the group mean")
    return SecureMessage(
        address(msg.sender, "sender", lim),
        address(msg.target, "target", lim),
        msg.round,
        msg.group,
        _members(msg.members, lim),
        msg.kind,
        payload,
        msg.meta,
    )


def parse_shuffle(body: bytes, lim: Limits, kind: type[_Shuffle], target: str) -> _Shuffle:
    """A Cyclon shuffle request or answer: ``{"sender": URL, "entries": [[URL, age], ...], "seq": counter}``."""
    if len(body) > MAX_SHUFFLE_BYTES:
        raise Malformed(f"shuffle body of {len(body)} bytes is over {MAX_SHUFFLE_BYTES}")
    data = parse_json(body, "shuffle body")
    if not isinstance(data, dict) or set(data) != {"sender", "entries", "seq"} or not isinstance(data["entries"], list):
        raise Malformed("shuffle body must be {'sender': URL, 'entries': [[URL, age], ...], 'seq': counter}")
    if len(data["entries"]) > lim.max_entries:
        raise Malformed(f"a shuffle carries at most {lim.max_entries} entries (gossip.view_size)")
    sender = address(data["sender"], "sender", lim)
    entries: dict[str, int] = {}
    for item in data["entries"]:
        if not (isinstance(item, list) and len(item) == 2):
            raise Malformed("each shuffle entry must be [URL, age]")
        entries[address(item[0], "entry", lim)] = count(item[1], "entry age")
    return kind(sender, target, tuple(entries.items()), count(data["seq"], "seq", 1))


def parse_refusal(status: int, body: bytes) -> Refused:
    """Another peer's error answer, as a Refused (whatever the body holds)."""
    try:
        data = parse_json(body[:MAX_ERROR_BYTES], "error answer")
        if isinstance(data, dict) and isinstance(data.get("error"), str):
            return Refused(status, data["error"][:64], str(data.get("detail", ""))[:500])
    except WireError:
        pass
    return Refused(status, "error", body[:200].decode(errors="replace"))
