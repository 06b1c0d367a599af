"""Errors a user can cause, each with a message that names the problem and the fix.

The CLI prints ``error: <message>`` and exits non-zero for any ShoalError; services
answer 4xx with ``{"error": kind, "detail": message}`` (``kind`` is ``code`` below).
"""

from __future__ import annotations


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: error messages quote what a peer sent,
    and a peer can send a megabyte."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""

    code = "error"


class ConfigError(ShoalError):
    """A config file, key or value is wrong."""

    code = "bad_config"


class EngineError(ShoalError):
    """A simulation engine could not start or run (e.g. Ray workers that are never placed)."""

    code = "engine"


class DataError(ShoalError):
    """A dataset is missing, malformed or does not fit the model."""

    code = "bad_data"


class WireError(ShoalError):
    """A message from the network failed validation. Nothing was applied."""

    code = "bad_update"


class SpecMismatch(WireError):
    code = "spec_mismatch"


class NonFinite(WireError):
    code = "non_finite"


class TooLarge(WireError):
    code = "too_large"


class Malformed(WireError):
    code = "malformed"


class OutOfRange(WireError):
    """Well-formed, but a value is beyond what the receiver accepts (num_examples, |delta|)."""

    code = "out_of_range"


class UpdateRejected(ShoalError):
    """A well-formed update that the round protocol will not take (not selected,
    duplicate, too stale, round closed). ``code`` says which; nothing was applied."""

    def __init__(self, code: str, detail: str):
        super().__init__(detail)
        self.code = code
