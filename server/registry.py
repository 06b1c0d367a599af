"""The node registry: an embedded SQLite table of nodes and how each proves who it is.

A node has a token, or a key: the SHA-256 fingerprint of the public key of its TLS client
certificate (`shoal pki node-key` on the node, `shoal server nodes add NAME --csr` here;
shoal/pki.py). A key node's ``token_hash`` holds ``key:<fingerprint>``, which no token's
hash (64 hex digits) can equal. The database holds who may connect: it is created with
mode 0600 (and a world-readable one is made private, with a warning).

Tokens are 32 random bytes (``secrets.token_urlsafe(32)``), so a single SHA-256 is
enough to store them: a slow password hash (scrypt) guards low-entropy secrets that
an attacker could guess; 256 random bits cannot be guessed, and a fast hash keeps the
per-request lookup cheap. Only the hash is stored; the token is shown once.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import sqlite3
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ConfigError, ShoalError
from shoal.pki import check_node_name
from shoal.tokens import hash_token, well_formed

log = logging.getLogger(__name__)

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
_KEY_COLUMN = "ALTER TABLE nodes ADD COLUMN key_sha256 TEXT"
_KEY_INDEX = "CREATE UNIQUE INDEX IF NOT EXISTS nodes_key ON nodes (key_sha256)"
_FINGERPRINT = frozenset("0123456789abcdef")


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
    key: str | None = None  # the fingerprint of a key node (None: a token node)


class Registry:
    """Nodes by name; ``authenticate(token)`` for each request."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _private_file(self.path)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(_SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(nodes)")}
        if "key_sha256" not in columns:  # a registry from before key enrollment
            self.db.execute(_KEY_COLUMN)
        self.db.execute(_KEY_INDEX)
        for suffix in ("-wal", "-shm"):  # SQLite gives them the database's mode; older ones may differ
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                _private_file(side)

    def close(self) -> None:
        self.db.close()

    def add(self, name: str) -> str:
        """Register ``name``; returns its new token (shown once, stored only as a hash)."""
        _check_name(name)
        token = secrets.token_urlsafe(32)
        self._insert(name, hash_token(token), None)
        return token

    def add_key(self, name: str, key_sha256: str) -> None:
        """Register ``name`` by the fingerprint of its public key (shoal.pki.fingerprint):
        it authenticates with a TLS client certificate for that key, no token."""
        _check_name(name)
        if not well_formed_fingerprint(key_sha256):
            raise ConfigError(f"key fingerprint {key_sha256[:80]!r}: expected sha256:<64 hex digits>")
        self._insert(name, f"key:{key_sha256}", key_sha256)

    def _insert(self, name: str, token_hash: str, key: str | None) -> None:
        if key is not None:
            row = self.db.execute("SELECT name FROM nodes WHERE key_sha256 = ?", (key,)).fetchone()
            if row is not None:
                raise ConfigError(f"this public key is already registered as node {row[0]!r}: each node makes its own")
        try:
            self.db.execute(
                "INSERT INTO nodes (name, token_hash, created, key_sha256) VALUES (?, ?, ?, ?)",
                (name, token_hash, time.time(), key),
            )
        except sqlite3.IntegrityError:
            raise ConfigError(f"node {name!r} already exists (revoke it and add a new name)") from None

    def revoke(self, name: str) -> None:
        cur = self.db.execute("UPDATE nodes SET enabled = 0 WHERE name = ?", (name,))
        if cur.rowcount == 0:
            raise ConfigError(f"no node named {name!r} (see `shoal server nodes list`)")

    def revoked(self) -> frozenset[str]:
        """The names of the revoked nodes and edges."""
        return frozenset(r[0] for r in self.db.execute("SELECT name FROM nodes WHERE enabled = 0"))

    def list(self) -> list[Node]:
        rows = self.db.execute("SELECT id, name, enabled, last_seen, key_sha256 FROM nodes ORDER BY id").fetchall()
        return [Node(r[0], r[1], bool(r[2]), r[3], r[4]) for r in rows]

    def enabled(self, name: str) -> bool:
        """``name`` is a registered node that is not revoked."""
        row = self.db.execute("SELECT enabled FROM nodes WHERE name = ?", (name,)).fetchone()
        return row is not None and bool(row[0])

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

    def authenticate_key(self, key_sha256: str) -> str:
        """The node name of a TLS client certificate's key; AuthError 401 (unknown) or 403 (revoked)."""
        row = self.db.execute("SELECT name, enabled FROM nodes WHERE key_sha256 = ?", (key_sha256,)).fetchone()
        if row is None:
            raise AuthError(
                "unauthenticated",
                "this client certificate's key is not registered: add the node with "
                "`shoal server nodes add NAME --csr NAME.csr --ca-dir DIR`",
                401,
            )
        if not row[1]:
            raise AuthError("revoked", f"node {row[0]!r} was revoked", 403)
        return row[0]

    def touch(self, name: str, now: float) -> None:
        self.db.execute("UPDATE nodes SET last_seen = ? WHERE name = ?", (now, name))


def _check_name(name: str) -> None:
    """ASCII only (shoal.pki's rule): a look-alike Unicode letter must not make a second 'node0'."""
    check_node_name(name)


def well_formed_fingerprint(text: str) -> bool:
    return len(text) == 71 and text.startswith("sha256:") and all(c in _FINGERPRINT for c in text[7:])


def _private_file(path: Path) -> None:
    """Create ``path`` with mode 0600, or make an existing one private (with a warning)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        return
    except FileExistsError:
        pass
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        log.warning("%s was readable by others (mode %o); made it 0600: it says who may connect", path, mode)
        path.chmod(0o600)


class Revocations:
    """Revocation in one place. `shoal server nodes revoke` writes the registry (another process);
    the server's clock calls :meth:`refresh`, and the moment a name appears every subscriber is
    handed the whole revoked set at once: each run's service (the open round stops waiting for
    the node, no round selects it again), the chunked uploads (its sessions are dropped), the
    long polls (its held poll is answered 403). ``names`` is the set an edge's poll answer carries
    down to the edge's own nodes. A revocation is never undone (a node comes back under a new name)."""

    def __init__(self, registry: Registry | None):
        self.registry = registry  # None: a server with no registry (nothing to revoke)
        self.names: frozenset[str] = registry.revoked() if registry is not None else frozenset()
        self._subscribers: list[Callable[[frozenset[str]], None]] = []

    def subscribe(self, on_revoked: Callable[[frozenset[str]], None]) -> None:
        """Call ``on_revoked(names)`` now and whenever a name is revoked."""
        self._subscribers.append(on_revoked)
        if self.names:
            on_revoked(self.names)

    def refresh(self) -> frozenset[str]:
        """Read the registry; the names revoked since the last call (each subscriber was told)."""
        if self.registry is None:
            return frozenset()
        now = self.registry.revoked()
        new = now - self.names
        if new:
            self.names = self.names | now
            log.warning("revoked: %s; dropped from every open round", ", ".join(sorted(new)))
            for on_revoked in self._subscribers:
                on_revoked(self.names)
        return new
