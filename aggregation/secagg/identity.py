"""Identity keys of secure aggregation against a malicious server (Bonawitz et al. 2017,
the active-adversary variant, Sec. 4 and Fig. 4's "malicious" lines).

Each node holds an Ed25519 signing key made on the node itself; the public halves reach
every node outside the server, as a *roster* (a JSON file ``{"node name": "<base64 public
key>"}`` distributed with the config). A node signs its key advertisement and, in the
consistency round, the list of survivors it was shown; it checks every other node's
signatures against the roster. A server that swaps a key or shows different survivor lists
to different nodes is caught by a signature that does not verify, and the honest nodes
abort before revealing any share.

Signed messages are length-prefixed concatenations with a domain tag per use, so a
signature over one kind of message can never be taken for another.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shoal.errors import ConfigError

SIGNATURE_BYTES = 64
KEY_BYTES = 32
DOMAIN_KEYS = b"shoal secagg v1 signed key advertisement"
DOMAIN_CONSISTENCY = b"shoal secagg v1 consistency check"


def _message(*parts: bytes) -> bytes:
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def keys_message(session: bytes, sender: str, enc_key: bytes, mask_key: bytes) -> bytes:
    """What a node signs when it advertises its two X25519 keys."""
    return _message(DOMAIN_KEYS, session, sender.encode(), enc_key, mask_key)


def consistency_message(session: bytes, survivors: list[str]) -> bytes:
    """What a node signs in the consistency round: the survivors (U3) it was shown."""
    return _message(DOMAIN_CONSISTENCY, session, *[u.encode() for u in sorted(survivors)])


def new_identity(rand_bytes: bytes | None = None) -> bytes:
    """A fresh Ed25519 private key as its 32 raw bytes (``rand_bytes``: from a seeded
    stream in simulations; the OS CSPRNG otherwise)."""
    raw = rand_bytes if rand_bytes is not None else os.urandom(KEY_BYTES)
    return Ed25519PrivateKey.from_private_bytes(raw).private_bytes_raw()


def identity_public(private: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def sign(private: bytes, message: bytes) -> bytes:
    return Ed25519PrivateKey.from_private_bytes(private).sign(message)


def verify(public: bytes, signature: bytes, message: bytes) -> bool:
    """True iff ``signature`` is ``public``'s over ``message`` (False for any malformed input)."""
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def write_identity(path: str | Path) -> bytes:
    """Make a new identity key at ``path`` (mode 0600; refuses to overwrite); its public key."""
    path = Path(path)
    if path.exists():
        raise ConfigError(f"{path} exists: an identity key is made once (remove it to make a new one)")
    path.parent.mkdir(parents=True, exist_ok=True)
    private = new_identity()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(base64.b64encode(private).decode() + "\n")
    return identity_public(private)


def read_identity(path: str | Path) -> bytes:
    try:
        raw = base64.b64decode(Path(path).read_text().strip(), validate=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"identity key {path}: cannot be read ({e})") from None
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"identity key {path}: expected base64 of {KEY_BYTES} bytes")
    return raw


def read_roster(path: str | Path) -> dict[str, bytes]:
    """The nodes' public identity keys: a JSON object of node name -> base64 Ed25519 key."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"keys file {path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"keys file {path}: expected a JSON object of node name -> base64 public key")
    out = {}
    for name, b64 in data.items():
        try:
            raw = base64.b64decode(b64, validate=True) if isinstance(b64, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != KEY_BYTES:
            raise ConfigError(f"keys file {path}: the key of {name!r} is not base64 of {KEY_BYTES} bytes")
        out[str(name)] = raw
    if len(set(out.values())) != len(out):
        raise ConfigError(f"keys file {path}: two nodes share one public key")
    return out
