"""Compressed client updates: what is sent instead of the dense float32 delta.

Three encodings, named in the wire header's ``encoding`` field (shoal/wire.py):

- ``dense``: the float32 delta, ``4n`` bytes.
- ``q8``: unbiased 8-bit stochastic quantization with one float32 scale per chunk of
  ``chunk`` coordinates (QSGD-style stochastic rounding, Alistarh et al. 2017): with
  ``s = max|x| / 127`` over the chunk, ``q = floor(x / s + u)``, ``u ~ U[0, 1)``, so
  ``E[q s] = x``. ``n + 4 n / chunk`` bytes.
- ``float16`` / ``bfloat16``: the delta in half precision, ``2n`` bytes, summed in the server's
  float32/float64 sum. float16 keeps 11 significant bits but holds only |x| <= 65504 (a node
  refuses to send an update beyond it rather than send Inf); bfloat16 keeps float32's range with
  8 significant bits.
- ``topk``: the k largest-magnitude coordinates as sorted int32 indices and float32
  values, ``8k`` bytes, with error feedback (Stich et al. 2018, "Sparsified SGD with
  Memory"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"): what a client does
  not send is added to its next update. The sent coordinates count as delivered only once
  the upload is accepted (:meth:`Compressor.accepted`); an upload that is refused, late,
  aborted or never sent is reported with :meth:`Compressor.not_accepted` and its values fold
  back into the residual, so nothing is lost, only delayed.

Half precision rounds each coordinate to nearest (deterministic, not unbiased): a relative error
of at most 2^-11 (float16) or 2^-8 (bfloat16) per coordinate.

Decoding (:func:`expected_tensors`, :func:`decode_tensors`) trusts no header field:
a wrong ``k`` or ``chunk`` shows up as a tensor shape mismatch, a scale that is not a
finite number >= 0, a quantized value outside [-127, 127], or indices out of range,
unsorted or repeated raise a typed :class:`~shoal.errors.WireError` naming the fault.

Secure aggregation (pairwise masks that cancel in the sum) needs the server to add
encoded updates as integers or reals before decoding: ``dense`` commutes with it;
``q8`` with a per-client scale does not (the sum of ``q_i s_i`` is not a function of
the sum of the masked ``q_i``); ``topk`` does not (clients send different index sets).
Quantization with one scale shared by all clients of the round (agreed in advance)
does commute; it is not implemented here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shoal.config import CompressionConfig, choices
from shoal.errors import Malformed, NonFinite, short_repr

ENCODINGS = choices(CompressionConfig, "encoding")  # declared once, on the config field
HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # encodings of the delta in half precision
FLOAT16_MAX = 65504.0
Q8_MAX = 127
MAX_CHUNK = 1 << 24


@dataclass
class Encoded:
    """An update's payload: its tensors plus the header fields that describe them."""

    encoding: str
    tensors: dict[str, torch.Tensor]
    header: dict[str, Any] = field(default_factory=dict)


def quantize_q8(
    x: torch.Tensor, chunk: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased stochastic 8-bit quantization of a flat vector: (int8 codes, float32 scales)."""
    x = x.detach().float().cpu()
    n = x.numel()
    chunks = math.ceil(n / chunk)
    padded = torch.zeros(chunks * chunk)
    padded[:n] = x
    rows = padded.view(chunks, chunk)
    scale = rows.abs().amax(dim=1) / Q8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = torch.rand(rows.shape, generator=generator)
    q = torch.floor(rows / safe[:, None] + u).clamp_(-Q8_MAX, Q8_MAX)
    return q.to(torch.int8).view(-1)[:n].clone(), scale


def dequantize_q8(q: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    n = q.numel()
    return (q.float() * scale.repeat_interleave(chunk)[:n]).contiguous()


class OutOfHalfRange(ValueError):
    """An update with entries float16 cannot hold (|x| > 65504): sent, they would be Inf."""


def to_half(delta: torch.Tensor, encoding: str) -> torch.Tensor:
    """``delta`` in the half-precision dtype ``encoding`` names (round to nearest); OutOfHalfRange
    where a finite entry would become Inf (float16 beyond 65504)."""
    half = delta.detach().to(HALF[encoding])
    if encoding == "float16" and delta.numel():
        big = float(delta.detach().abs().max())
        if math.isfinite(big) and big > FLOAT16_MAX:
            raise OutOfHalfRange(
                f"the update has an entry of magnitude {big:.4g}, beyond float16's largest {FLOAT16_MAX:g}: "
                "it would arrive as Inf; use compression.encoding = 'bfloat16' (float32's range) or 'dense'"
            )
    return half


class Residuals(Protocol):
    """Where top-k keeps each client's residual: a dict, or a client-state store's view."""

    def get(self, client: str, default: Any = None, /) -> Any: ...

    def __getitem__(self, client: str, /) -> torch.Tensor: ...

    def __setitem__(self, client: str, value: torch.Tensor, /) -> None: ...

    def __contains__(self, client: object, /) -> bool: ...

    def pop(self, client: str, default: Any = None, /) -> Any: ...


class TopK:
    """Top-k sparsification with error feedback, one residual per client.

    ``residuals[c]`` is what client c still has to send if every upload it has in flight is
    accepted; ``in_flight[(c, tag)]`` holds the (indices, values) of an upload whose outcome is
    not known yet. :meth:`accepted` commits it (drops the record); :meth:`not_accepted` adds
    its values back to the residual. Several uploads of one client may be in flight at once
    (distinct tags); the next :meth:`compress` never re-sends what is in flight, so an upload
    accepted late is not counted twice. A caller that never reports an outcome gets the
    behaviour of committing at encode time.

    Memory note: a residual is a float32 vector of the model's size, kept for each
    client that has sent at least one update (in the simulator: ``participants x model``
    floats, unless ``residuals`` keeps them elsewhere: the simulator's client-state store on
    disk, shoal.client.state.StateMapping; on a real client node just its own). :meth:`forget`
    drops one.
    """

    def __init__(self, fraction: float, residuals: Residuals | None = None):
        if not 0 < fraction <= 0.5:
            raise ValueError(f"top-k fraction = {fraction} must be in (0, 0.5]")
        self.fraction = fraction
        self.residuals: Residuals | dict[str, torch.Tensor] = {} if residuals is None else residuals
        self.in_flight: dict[tuple[str, Any], tuple[torch.Tensor, torch.Tensor]] = {}

    def k(self, numel: int) -> int:
        return max(1, min(numel // 2 or 1, math.ceil(self.fraction * numel)))

    def compress(self, delta: torch.Tensor, client: str, tag: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted int32 indices, float32 values) of the k largest |delta + residual|; the upload
        is in flight under ``(client, tag)`` until :meth:`accepted` or :meth:`not_accepted`."""
        acc = delta.detach().float().cpu()
        res = self.residuals.get(client)
        if res is not None:
            acc = acc + res
        k = self.k(acc.numel())
        idx = torch.topk(acc.abs(), k, sorted=False).indices.sort().values
        values = acc[idx].clone()
        acc = acc.clone() if res is None else acc
        acc[idx] = 0
        self.residuals[client] = acc
        self.in_flight[(client, tag)] = (idx, values)
        return idx.to(torch.int32), values

    def accepted(self, client: str, tag: Any = None) -> None:
        """The upload was applied: its coordinates are delivered for good."""
        self.in_flight.pop((client, tag), None)

    def not_accepted(self, client: str, tag: Any = None) -> None:
        """The upload was refused, came late and was dropped, its round aborted, or it was
        never sent: its values go back into the residual to be sent later."""
        sent = self.in_flight.pop((client, tag), None)
        if sent is None:
            return
        idx, values = sent
        # compress made it; forget() drops both. Stored anew: the store may be a file per client.
        self.residuals[client] = self.residuals[client].index_add(0, idx, values)

    def forget(self, client: str) -> None:
        self.residuals.pop(client, None)
        for key in [key for key in self.in_flight if key[0] == client]:
            del self.in_flight[key]


class Compressor:
    """Client side: turns a delta into an :class:`Encoded` payload per the ``[compression]`` table."""

    def __init__(self, cfg: CompressionConfig, residuals: Residuals | None = None):
        self.cfg = cfg
        self.topk = TopK(cfg.topk_fraction, residuals) if cfg.encoding == "topk" else None

    def encode(self, delta: torch.Tensor, client: str = "", seed: int = 0, tag: Any = None) -> Encoded:
        """The payload of ``delta``; with top-k it is in flight under ``(client, tag)`` until the
        caller reports :meth:`accepted` or :meth:`not_accepted`."""
        match self.cfg.encoding:
            case "dense":
                return Encoded("dense", {"delta": delta.detach().float()})
            case "float16" | "bfloat16":
                return Encoded(self.cfg.encoding, {"delta": to_half(delta, self.cfg.encoding)})
            case "q8":
                gen = torch.Generator().manual_seed(int(seed) % (1 << 63))
                q, scale = quantize_q8(delta, self.cfg.q8_chunk, gen)
                return Encoded("q8", {"q": q, "scale": scale}, {"chunk": self.cfg.q8_chunk})
            case "topk":
                assert self.topk is not None  # __init__ makes one for encoding = 'topk'
                idx, values = self.topk.compress(delta, client, tag)
                return Encoded("topk", {"indices": idx, "values": values}, {"k": int(idx.numel())})
        raise ValueError(f"compression.encoding = {self.cfg.encoding!r} is not one of {ENCODINGS}")

    def accepted(self, client: str = "", tag: Any = None) -> None:
        """Report that the upload encoded under ``(client, tag)`` was applied (no-op unless top-k)."""
        if self.topk is not None:
            self.topk.accepted(client, tag)

    def not_accepted(self, client: str = "", tag: Any = None) -> None:
        """Report that it was refused, late, aborted or never sent: top-k folds it back."""
        if self.topk is not None:
            self.topk.not_accepted(client, tag)


def _header_int(header: dict, key: str, low: int, high: int, why: str) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= high:
        raise Malformed(f"header field {key!r} = {short_repr(v)} must be an integer in [{low}, {high}] ({why})")
    return v


def expected_tensors(header: dict, numel: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensor names, dtypes and shapes a header's ``encoding`` promises for a model of ``numel``."""
    encoding = header.get("encoding", "dense")
    match encoding:
        case "dense":
            return {"delta": (torch.float32, (numel,))}
        case "float16" | "bfloat16":
            return {"delta": (HALF[encoding], (numel,))}
        case "q8":
            chunk = _header_int(header, "chunk", 1, MAX_CHUNK, "coordinates per q8 scale")
            return {"q": (torch.int8, (numel,)), "scale": (torch.float32, (math.ceil(numel / chunk),))}
        case "topk":
            k = _header_int(header, "k", 1, max(1, numel // 2), "top-k coordinates; above numel/2 send dense")
            return {"indices": (torch.int32, (k,)), "values": (torch.float32, (k,))}
    raise Malformed(f"header field 'encoding' = {short_repr(encoding)} is not one of {', '.join(ENCODINGS)}")


def decode_tensors(header: dict, tensors: dict[str, torch.Tensor], numel: int) -> torch.Tensor:
    """The dense float32 delta from tensors already checked against :func:`expected_tensors`
    (names, dtypes, shapes, finiteness); checks what only the values can show."""
    encoding = header.get("encoding", "dense")
    if encoding == "dense":
        return tensors["delta"]
    if encoding in HALF:  # the caller's finiteness check sees float16's Inf (a value sent out of range)
        return tensors["delta"].float()
    if encoding == "q8":
        q, scale = tensors["q"], tensors["scale"]
        if bool((scale < 0).any()):
            raise Malformed(f"q8 scale has {int((scale < 0).sum())} negative values; scales are max|x|/127 >= 0")
        if bool((q == -128).any()):
            raise Malformed("q8 code -128 found; codes are in [-127, 127]")
        delta = dequantize_q8(q, scale, header["chunk"])
        # every field finite is not enough: 127 x a scale near FLT_MAX is +Inf
        if not bool(torch.isfinite(delta.sum())) and not bool(torch.isfinite(delta).all()):
            raise NonFinite(
                f"q8 codes x scales decode to {int((~torch.isfinite(delta)).sum())} Inf values "
                f"(largest scale {float(scale.max()):.4g}; scales are max|x|/127)"
            )
        return delta
    if encoding == "topk":
        idx, values = tensors["indices"].long(), tensors["values"]
        if bool(((idx < 0) | (idx >= numel)).any()):
            raise Malformed(f"top-k indices outside [0, {numel}) for a model of {numel} parameters")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise Malformed("top-k indices must be strictly increasing (sorted, no duplicates)")
        delta = torch.zeros(numel)
        delta[idx] = values
        return delta
    raise Malformed(f"header field 'encoding' = {short_repr(encoding)} is not one of {', '.join(ENCODINGS)}")
