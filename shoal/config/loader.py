"""Reading a config: defaults, then a TOML file, then ``--set section.key=value`` overrides.

A config file has one table per section (``[simulation]``, ``[data]``, ...). Command
lines override single values with ``--set section.key=value`` (the value is read as a
TOML value, so ``--set train.lr=0.05`` is a float and ``--set data.dir=/x`` a string).
An unknown section or key, or a value of the wrong type or outside its choices, is a
:class:`ConfigError` that names the key and says what is allowed.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from shoal.errors import ConfigError

from .checks import field_types
from .sections import Config


def _type_ok(value: Any, annotation: Any) -> tuple[bool, Any]:
    """Check (and mildly coerce: int -> float) a TOML value against a field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(annotation):
            ok, v = _type_ok(value, arm)
            if ok:
                return True, v
        return False, value
    if origin is list:
        (inner,) = typing.get_args(annotation) or (Any,)
        if not isinstance(value, list):
            return False, value
        out = []
        for item in value:
            ok, v = _type_ok(item, inner)
            if not ok:
                return False, value
            out.append(v)
        return True, out
    if origin is dict:
        return isinstance(value, dict), value
    if origin is Literal:
        return (isinstance(value, str) and value in typing.get_args(annotation)), value
    if annotation is Any:
        return True, value
    if annotation is bool:
        return isinstance(value, bool), value
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if annotation is str:
        return isinstance(value, str), value
    return isinstance(value, annotation), value


def _type_name(annotation: Any) -> str:
    if typing.get_origin(annotation) is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    if typing.get_origin(annotation) is list:
        (inner,) = typing.get_args(annotation) or (Any,)
        return f"a list of {_type_name(inner)}"
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def _apply(section_obj: Any, section_name: str, values: dict[str, Any]) -> None:
    hints = field_types(type(section_obj))
    known = {f.name for f in dataclasses.fields(section_obj)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(
                f"unknown key '{section_name}.{key}' (known keys of [{section_name}]: {', '.join(sorted(known))})"
            )
        ok, coerced = _type_ok(value, hints[key])
        if not ok:
            hint = hints[key]
            if typing.get_origin(hint) is Literal and isinstance(value, str):
                raise ConfigError(
                    f"{section_name}.{key} = {value!r} is not one of {', '.join(map(repr, typing.get_args(hint)))}"
                )
            raise ConfigError(f"{section_name}.{key} = {value!r} has the wrong type: expected {_type_name(hint)}")
        setattr(section_obj, key, coerced)


def config_from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    cfg = base or Config()
    sections = {f.name for f in dataclasses.fields(cfg)}
    for name, values in data.items():
        if name not in sections:
            raise ConfigError(f"unknown section [{name}] (known sections: {', '.join(sorted(sections))})")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of keys, got {values!r}")
        _apply(getattr(cfg, name), name, values)
    return cfg


def parse_override(text: str, base: Config | None = None) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is TOML, else a string.
    ``task.args.NAME=value`` sets one argument of the task: (task, args, the args with it)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if not all(parts) or not (len(parts) == 2 or (len(parts) == 3 and parts[:2] == ["task", "args"])):
        raise ConfigError(f"--set {text!r}: the key must look like section.key (or task.args.name)")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    if len(parts) == 3:
        args = dict(base.task.args) if base is not None else {}
        return "task", "args", {**args, parts[2]: value}
    return parts[0], parts[1], value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the TOML file, then each ``--set`` override; validated."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    cfg = config_from_dict(data)
    for text in overrides:
        section, key, value = parse_override(text, cfg)
        config_from_dict({section: {key: value}}, base=cfg)
    return cfg.validate()
