"""The operator's task registry: the only tasks a federation's runs may name.

A run names a task by NAME and the server looks that name up here and nowhere else: no path,
module or callable that arrives in a request is ever opened or imported. The entries come from
three places, each pinned by the SHA-256 of its source file:

- the built-in tasks (``builtin``, ``shoal.tasks:BuiltinTask``, ``shoal.tasks:SyntheticPopulationTask``),
  allowed by default;
- ``federation.tasks`` in the server's config: ``"NAME=REF"`` or ``"REF"`` (then the name is the
  reference itself), pinned when the server starts;
- the registry file ``federation.dir/tasks.json``, written by `shoal server tasks add NAME REF`
  (pinned when added; read again at each submission, so a task added while the server runs is
  there for the next run).

A source that changed since it was pinned is refused (``task_changed``) until its operator adds it
again. The nodes pin each task by the same digest (client/node_config.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError, ShoalError

BUILTIN = "builtin"  # shoal's own task of [model] + [data]
BUILTIN_TASKS = ("builtin", "shoal.tasks:BuiltinTask", "shoal.tasks:SyntheticPopulationTask")
REGISTRY_FILE = "tasks.json"  # in federation.dir, beside runs.sqlite
MAX_REGISTRY_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RunError(ShoalError):
    """A run request that cannot be met; ``status`` is the HTTP status to answer."""

    def __init__(self, code: str, detail: str, status: int = 400):
        super().__init__(" ".join(detail.split()))  # one line, whatever the cause said
        self.code, self.status = code, status


@dataclass(frozen=True)
class TaskEntry:
    """One task a run may name: its name, the operator's reference, its pin and where it came from."""

    name: str
    ref: str
    sha256: str
    source: str  # "builtin" | "config" | "registry"

    @property
    def builtin(self) -> bool:
        return self.source == "builtin"


def source_path(ref: str) -> Path:
    """The source file behind an operator's task reference (never called with a request's text)."""
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise ConfigError(f"task {ref[:200]!r}: expected path/to/file.py:name or package.module:name")
    if target.endswith(".py") or "/" in target:
        path = Path(target).expanduser()
        if not path.is_file():  # a device, a folder or a FIFO is never read as a task's source
            raise ConfigError(f"task {ref[:200]!r}: {path} is not a regular file")
        return path
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"task {ref[:200]!r}: module {target!r} cannot be found: {e}") from None
    if spec is None or not spec.origin or not Path(spec.origin).is_file():
        raise ConfigError(f"task {ref[:200]!r}: module {target!r} has no source file on this machine")
    return Path(spec.origin)


def task_sha256(ref: str) -> str:
    """The SHA-256 of the source file behind an operator's task reference (what nodes pin it by)."""
    if ref == BUILTIN:
        return BUILTIN
    path = source_path(ref)
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise ConfigError(f"task {ref[:200]!r}: {path} cannot be read: {e.strerror}") from None


def _absolute(ref: str) -> str:
    """A file reference made absolute (the server may run from another folder than the CLI)."""
    target, _, attr = ref.rpartition(":")
    if target.endswith(".py") or "/" in target:
        return f"{Path(target).expanduser().resolve()}:{attr}"
    return ref


def check_task_name(name: str) -> str:
    if not _NAME.fullmatch(name) or name in BUILTIN_TASKS:
        raise ConfigError(
            f"task name {name[:80]!r}: 1-64 ASCII letters, digits, '.', '_' or '-' (starting with a letter or "
            "digit), and not a built-in task's name"
        )
    return name


def read_registry(path: Path) -> dict[str, dict[str, str]]:
    """The registry file: {name: {"ref": REF, "sha256": HEX}}; {} if there is none."""
    try:
        if not path.exists():
            return {}
        if path.stat().st_size > MAX_REGISTRY_BYTES:
            raise ConfigError(f"task registry {path} is over {MAX_REGISTRY_BYTES} bytes")
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"task registry {path} cannot be read: {e}") from None
    ok = isinstance(data, dict) and all(
        isinstance(v, dict) and set(v) == {"ref", "sha256"} and all(isinstance(x, str) for x in v.values())
        for v in data.values()
    )
    if not ok:
        raise ConfigError(f"task registry {path}: expected {{name: {{ref, sha256}}}} (`shoal server tasks add`)")
    return data


def _write_registry(path: Path, data: dict[str, dict[str, str]]) -> None:
    from shoal.pki import replace_atomically

    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode(), 0o644)


def add_task(path: Path, name: str, ref: str) -> TaskEntry:
    """Register ``name`` for ``ref`` pinned by its source's SHA-256 now (replacing an older pin of
    the same name and reference: how an operator accepts a changed source)."""
    check_task_name(name)
    ref = _absolute(ref)
    digest = task_sha256(ref)
    data = read_registry(path)
    old = data.get(name)
    if old is not None and old["ref"] != ref:
        raise ConfigError(f"task {name!r} is registered for {old['ref']!r}: `shoal server tasks remove {name}` first")
    data[name] = {"ref": ref, "sha256": digest}
    _write_registry(path, data)
    return TaskEntry(name, ref, digest, "registry")


def remove_task(path: Path, name: str) -> None:
    data = read_registry(path)
    if name not in data:
        raise ConfigError(f"{path} has no task {name[:80]!r} (it has {sorted(data)[:20]})")
    del data[name]
    _write_registry(path, data)


def _configured(items: list[str]) -> list[tuple[str, str]]:
    """federation.tasks entries as (name, ref): ``NAME=REF``, or a bare ``REF`` named by itself."""
    out = []
    for item in items:
        name, sep, ref = item.partition("=")
        if sep and _NAME.fullmatch(name):
            out.append((name, ref))
        else:
            out.append((item, item))
    return out


class TaskRegistry:
    """What a run may name: the built-ins, ``federation.tasks`` and the registry file."""

    def __init__(self, path: Path, configured: list[str]):
        self.path = path
        self.fixed: dict[str, TaskEntry] = {}
        for ref in BUILTIN_TASKS:
            self.fixed[ref] = TaskEntry(ref, ref, task_sha256(ref), "builtin")
        for name, ref in _configured(configured):
            self.fixed[name] = TaskEntry(name, ref, task_sha256(ref), "config")  # ConfigError at start
        read_registry(path)  # a broken registry file stops the server at start, with its path

    def entries(self) -> dict[str, TaskEntry]:
        file = {n: TaskEntry(n, e["ref"], e["sha256"], "registry") for n, e in read_registry(self.path).items()}
        return {**file, **self.fixed}

    def resolve(self, name: Any) -> TaskEntry:
        """The entry a run names; RunError (400, one line) for anything else. ``name`` is only
        compared with the registered names: it is never opened, imported or resolved."""
        if not isinstance(name, str) or not name or len(name) > 1024:
            raise RunError("bad_task", "name the run's task: one of the tasks registered on this server")
        try:
            entries = self.entries()
        except ConfigError as e:
            raise RunError("registry_unreadable", str(e), 503) from None
        entry = entries.get(name)
        if entry is None:
            shown = ", ".join(sorted(entries)[:20])
            raise RunError(
                "task_not_registered",
                f"task {name[:80]!r} is not registered on this server (registered: {shown}); "
                "its operator adds one with `shoal server tasks add NAME REF`",
            )
        return entry

    def verify(self, entry: TaskEntry) -> None:
        """The registered source still has its pinned hash (RunError ``task_changed`` otherwise)."""
        try:
            now = task_sha256(entry.ref)
        except ConfigError as e:
            raise RunError("task_changed", f"task {entry.name!r}: {e}") from None
        if now != entry.sha256:
            raise RunError(
                "task_changed",
                f"task {entry.name!r}: its source changed since it was registered (sha256 {now[:12]}..., "
                f"pinned {entry.sha256[:12]}...); its operator registers it again to accept the change",
            )
