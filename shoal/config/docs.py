"""docs/config.md, generated from the config dataclasses: ``python -m shoal.config.docs > docs/config.md``.

Everything on the page is read from the sections' modules (sections.py and the families it
imports), so the page cannot drift from the code
(tests/core/test_config_docs.py checks that the file equals what this prints):

* key, type, default and choices: the dataclass fields and their annotations;
* the allowed range: each section's ``validate()``, from its ``positive(...)`` calls and the
  "``section.key = ... must be ...``" messages it raises (read from the source, not run);
* what a key does: its comment in its section's module. A field's comment is the one on its own
  lines, followed by comment lines right below it; a field without one takes the comment
  block right above it. A blank line ends a comment block (a heading over several fields).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import math
import re
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .checks import field_types
from .sections import Config

HEADER = """# Configuration reference

Generated from the config dataclasses (shoal/config/sections.py) by
`python -m shoal.config.docs > docs/config.md`; do not edit by hand. A config file has one
TOML table per section; `--set section.key=value` overrides one key on any command. Settings
that are fine alone but not together are checked in shoal/config/rules.py, and every refusal
names the key and the fix.
"""

_MUST = re.compile(r"^([a-z_]+)\.([a-z_0-9]+) = \{\} must be (.+)$", re.S)


@dataclasses.dataclass
class Key:
    """One row of the page."""

    name: str
    type: str
    default: str
    allowed: str
    doc: str


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text, whether the line holds nothing but the comment)."""
    lines = source.splitlines()
    out: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            alone = not lines[line - 1][: tok.start[1]].strip()
            out[line] = (tok.string.lstrip("#").strip(), alone)
    return out


def _field_docs(source: str, cls: type) -> dict[str, str]:
    """Each field's description, from the comments of its section's module (the rules in the module doc)."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    comments = _comments(source)
    fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    own = {
        id(f): [comments[i][0] for i in range(f.lineno, (f.end_lineno or f.lineno) + 1) if i in comments]
        for f in fields
    }

    def block(start: int, step: int) -> list[str]:
        found, i = [], start
        while i in comments and comments[i][1]:
            found.append(comments[i][0])
            i += step
        return found if step > 0 else found[::-1]

    docs: dict[str, list[str]] = {}
    for k, f in enumerate(fields):
        end = f.end_lineno or f.lineno
        below = block(end + 1, 1)
        after = fields[k + 1] if k + 1 < len(fields) else None
        next_takes_it = after is not None and after.lineno == end + 1 + len(below) and not own[id(after)]
        text = list(own[id(f)])
        if not text:
            text = block(f.lineno - 1, -1)
        if below and not next_takes_it:
            text += below
        docs[f.target.id] = text  # type: ignore[union-attr]
    return {name: " ".join(parts) for name, parts in docs.items()}


def _text(node: ast.expr, env: dict[str, str]) -> str | None:
    """A string constant or f-string with loop variables filled in, other values as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return None
    out = []
    for part in node.values:
        if isinstance(part, ast.Constant):
            out.append(str(part.value))
        elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id in env:
            out.append(env[part.value.id])
        else:
            out.append("{}")
    return "".join(out)


def _ranges(source: str, cls: type, section: str) -> dict[str, list[str]]:
    """key -> what its ``validate()`` allows, in that method's own words."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    method = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "validate"), None)
    found: dict[str, list[str]] = {}

    def add(key: str, text: str) -> None:
        text = re.split(r": |; ", text.strip(), maxsplit=1)[0].rstrip(".")
        if text and text not in found.setdefault(key, []):
            found[key].append(text)

    def visit(stmts: list[ast.stmt], env: dict[str, str]) -> None:
        for st in stmts:
            loop = isinstance(st, ast.For) and isinstance(st.iter, (ast.Tuple, ast.List))
            if loop and isinstance(st, ast.For) and isinstance(st.target, ast.Name):
                for item in st.iter.elts:  # type: ignore[attr-defined]
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        visit(st.body, {**env, st.target.id: item.value})
                continue
            for sub in ast.walk(st):
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.args:
                    name = _text(sub.args[0], env)
                    if sub.func.id == "positive" and name and name.startswith(section + "."):
                        zero = any(
                            kw.arg == "allow_zero" and isinstance(kw.value, ast.Constant) and kw.value.value
                            for kw in sub.keywords
                        )
                        add(name.split(".", 1)[1], ">= 0" if zero else "> 0")
                    elif sub.func.id == "ConfigError" and name and (m := _MUST.match(name)) and m[1] == section:
                        add(m[2], m[3])

    if method is not None:
        visit(method.body, {})
    return found


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "string"
    if origin is list:
        (inner,) = typing.get_args(hint)
        return f"list of {_type_name(inner)}"
    if origin is dict:
        return "table"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(hint, str(hint))


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _choices(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is list:
        (hint,) = typing.get_args(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def section_keys(name: str) -> list[Key]:
    """The rows of one section (``name`` as in TOML: ``server``, ``secure_aggregation``, ...)."""
    obj = getattr(Config(), name)
    cls = type(obj)
    source = Path(inspect.getfile(cls)).read_text()  # the section's own module (training.py, network.py, ...)
    docs, ranges = _field_docs(source, cls), _ranges(source, cls, name)
    hints = field_types(cls)
    rows = []
    for f in dataclasses.fields(obj):
        hint = hints[f.name]
        allowed = [", ".join(_toml(c) for c in _choices(hint))] if _choices(hint) else []
        rows.append(
            Key(
                f.name,
                _type_name(hint),
                _toml(getattr(obj, f.name)),
                "; ".join(allowed + ranges.get(f.name, [])),
                docs.get(f.name, ""),
            )
        )
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _summary(cls: type) -> str:
    doc = cls.__doc__ or ""
    if doc.startswith(cls.__name__ + "("):  # the dataclass's generated signature: no docstring
        return ""
    return " ".join(doc.strip().split())


def render() -> str:
    """The whole page."""
    out = [HEADER]
    for f in dataclasses.fields(Config):
        cls = type(getattr(Config(), f.name))
        out.append(f"## [{f.name}]\n")
        summary = _summary(cls)
        if summary:
            out.append(summary + "\n")
        out.append("| key | type | default | allowed | what it does |")
        out.append("|---|---|---|---|---|")
        for k in section_keys(f.name):
            cells = (f"`{k.name}`", k.type, f"`{k.default}`", k.allowed, k.doc)
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
