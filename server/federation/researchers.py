"""The researcher tokens file (federation.researcher_tokens_file): who may submit and follow runs.

Lines of ``NAME TOKEN`` (blank lines and ``#`` comments allowed). ``shoal server researcher-token``
adds and removes researchers here; the file is always rewritten whole, atomically and with mode
0600 (a reader sees the old file or the new one), and a new researcher's token may go to its own
0600 file for `shoal run --token-file`. The server reads it at start (server/app.py).
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from shoal.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9._@-]{1,64}")


def _lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    try:
        return path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--tokens-file {str(path)!r} cannot be read: {e}") from None


def _names(lines: list[str]) -> list[str]:
    return [line.split()[0] for line in lines if line.strip() and not line.lstrip().startswith("#")]


def _write(path: Path, lines: list[str]) -> None:
    from shoal.pki import replace_atomically

    replace_atomically(path, "".join(line + "\n" for line in lines).encode(), 0o600)


def add_researcher(path: Path, name: str, token_out: Path | None = None) -> str:
    """Add ``name`` with a new token (returned); ConfigError if the name is taken or malformed."""
    if not _NAME.fullmatch(name) or name == "admin":
        raise ConfigError(f"researcher name {name!r}: 1-64 letters, digits, '.', '_', '@' or '-', and not 'admin'")
    lines = _lines(path)
    if name in _names(lines):
        raise ConfigError(f"{path} already has a researcher {name!r}: --remove them first to give a new token")
    token = secrets.token_urlsafe(32)
    fd = None
    if token_out is not None:  # opened first: a token is never written to the server's file and lost
        token_out.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(token_out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"--token-out {str(token_out)!r} exists: give a new file") from None
    try:
        _write(path, [*lines, f"{name} {token}"])
    except BaseException:
        if fd is not None and token_out is not None:
            os.close(fd)
            token_out.unlink()
        raise
    if fd is not None:
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    return token


def remove_researcher(path: Path, name: str) -> None:
    lines = _lines(path)
    if name not in _names(lines):
        raise ConfigError(f"{path} has no researcher {name!r} (it has {_names(lines)[:20]})")
    keep = [line for line in lines if not (line.strip() and line.split()[0] == name)]
    _write(path, keep)
