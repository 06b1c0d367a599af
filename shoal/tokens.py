"""Bearer tokens: which strings are tokens, and the digest a server keeps instead of a token.

Shared by the server's registry, its apps and the web page (which must not import the server)."""

from __future__ import annotations

import hashlib

TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def well_formed(token: str) -> bool:
    """What ``secrets.token_urlsafe`` makes (and nothing that cannot be hashed)."""
    return 0 < len(token) <= 256 and all(c in TOKEN_CHARS for c in token)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
