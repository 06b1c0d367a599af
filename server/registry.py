"""The node registry: an embedded SQLite table of nodes and their hashed tokens.

Tokens are 32 random bytes (``secrets.token_urlsafe(32)``), so a single SHA-256 is
enough to store them: a slow password hash (scrypt) guards low-entropy secrets that
an attacker could guess; 256 random bits cannot be guessed, and a fast hash keeps the
per-request lookup cheap. Only the hash is stored; the token is shown once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ConfigError, ShoalError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT UNIQUE NOT NULL,
    token_hash TEXT UNIQUE NOT NULL,
    enabled INTEGER NOT NULL DEFAULT 1,
    created REAL NOT NULL,
    last_seen REAL
)
"""


class AuthError(ShoalError):
    """A request's token is missing or unknown (401) or the node is revoked (403)."""

    def __init__(self, code: str, detail: str, status: int):
        super().__init__(detail)
        self.code, self.status = code, status


@dataclass(frozen=True)
class Node:
    id: int
    name: str
    enabled: bool
    last_seen: float | None


TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def well_formed(token: str) -> bool:
    """What ``secrets.token_urlsafe`` makes (and nothing that cannot be hashed)."""
    return 0 < len(token) <= 256 and all(c in TOKEN_CHARS for c in token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Registry:
    """Nodes by name; ``authenticate(token)`` for each request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    def add(self, name: str) -> str:
        """Register ``name``; returns its new token (shown once, stored only as a hash)."""
        if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name):
            raise ConfigError(f"node name {name!r}: use 1-128 letters, digits, '-', '_' or '.'")
        token = secrets.token_urlsafe(32)
        try:
            self.db.execute(
                "INSERT INTO nodes (name, token_hash, created) VALUES (?, ?, ?)", (name, hash_token(token), time.time())
            )
        except sqlite3.IntegrityError:
            raise ConfigError(f"node {name!r} already exists (revoke it and add a new name)") from None
        return token

    def revoke(self, name: str) -> None:
        cur = self.db.execute("UPDATE nodes SET enabled = 0 WHERE name = ?", (name,))
        if cur.rowcount == 0:
            raise ConfigError(f"no node named {name!r} (see `shoal server nodes list`)")

    def list(self) -> list[Node]:
        rows = self.db.execute("SELECT id, name, enabled, last_seen FROM nodes ORDER BY id").fetchall()
        return [Node(r[0], r[1], bool(r[2]), r[3]) for r in rows]

    def authenticate(self, token: str | None) -> str:
        """The node name for ``token``; AuthError 401 (unknown) or 403 (revoked)."""
        if not token:
            raise AuthError("unauthenticated", "no token: send 'Authorization: Bearer <token>'", 401)
        if not well_formed(token):  # e.g. non-UTF-8 header bytes, which aiohttp hands over as surrogates
            raise AuthError(
                "unauthenticated", "malformed token: a token is at most 256 URL-safe base64 characters", 401
            )
        h = hash_token(token)
        row = self.db.execute("SELECT name, enabled, token_hash FROM nodes WHERE token_hash = ?", (h,)).fetchone()
        if row is None or not hmac.compare_digest(row[2], h):
            raise AuthError("unauthenticated", "unknown token: add the node with `shoal server nodes add NAME`", 401)
        if not row[1]:
            raise AuthError("revoked", f"node {row[0]!r} was revoked", 403)
        return row[0]

    def touch(self, name: str, now: float) -> None:
        self.db.execute("UPDATE nodes SET last_seen = ? WHERE name = ?", (now, name))
