"""Checks every config section shares: the choices a ``Literal`` field allows, finite numbers,
ranges (``positive``), named in the messages by ``section.key``."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Literal

from shoal.errors import ConfigError

_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """A section class's field types, resolved once per process: resolving compiles every
    annotation of the class (0.1 s a config when it was done for each field)."""
    if cls not in _FIELD_TYPES:
        _FIELD_TYPES[cls] = typing.get_type_hints(cls)
    return _FIELD_TYPES[cls]


def choices(section: type | Any, key: str) -> tuple[str, ...]:
    """The values a ``Literal`` field of a config section allows (declared once, on the field)."""
    hint = field_types(section if isinstance(section, type) else type(section))[key]
    if typing.get_origin(hint) is list:
        (hint,) = typing.get_args(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def check_choices(section: Any, name: str) -> None:
    """Every ``Literal`` field holds one of its values (also for sections made in code, not TOML)."""
    if not dataclasses.is_dataclass(section):
        return
    for f in dataclasses.fields(section):
        allowed = choices(section, f.name)
        if not allowed:
            continue
        value = getattr(section, f.name)
        for v in value if isinstance(value, list) else [value]:
            if v not in allowed:
                raise ConfigError(f"{name}.{f.name} = {v!r} is not one of {', '.join(map(repr, allowed))}")


#: The one numeric setting where ``inf`` means something (a full batch); NaN is never a setting.
INFINITE_ALLOWED = frozenset({"train.batch_size"})


def check_finite(section: Any, name: str) -> None:
    """Every number in a section (lists and [task.args] tables included) is finite: NaN passes
    every ``<`` and ``>`` check, so a range check alone would let it through."""
    if not dataclasses.is_dataclass(section):
        return
    for f in dataclasses.fields(section):
        _finite(f"{name}.{f.name}", getattr(section, f.name))


def _finite(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        if not (value == math.inf and key in INFINITE_ALLOWED):
            raise ConfigError(f"{key} = {value!r} must be a finite number")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite(f"{key}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite(f"{key}.{k}", v)


def positive(key: str, value: float, allow_zero: bool = False) -> None:
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value!r} must be {'>= 0' if allow_zero else '> 0'}")
