"""JSON from a network, read strictly: one parser for every request body that is JSON.

``json.loads`` takes things a protocol should not: a key given twice (the last one wins, so two
readers of one body may disagree on what it said), ``NaN`` and ``Infinity``, and bytes that are
not UTF-8. :func:`loads_strict` refuses each with a ValueError saying which.
"""

from __future__ import annotations

import json
from typing import Any


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key[:40]!r} is given twice")
        out[key] = value
    return out


class NonFiniteNumber(ValueError):
    """NaN or Infinity in a body (a caller may answer it as a non-finite value, not bad JSON)."""


def _no_constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a finite number")


def loads_strict(data: bytes | str) -> Any:
    """The JSON document ``data``; ValueError if it is not UTF-8, not JSON, repeats a key in an
    object, holds NaN or Infinity, or nests too deep."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes | bytearray | memoryview) else data
    except UnicodeDecodeError:
        raise ValueError("not UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deep") from None
