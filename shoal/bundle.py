"""Signed task bundles: a researcher's task files, with a manifest signed by a publisher key.

A bundle lets a researcher run their own task in a federation without its node operators
installing it first: `shoal run submit --bundle DIR` packs the task's files and the model's
initial state, signs the manifest with the researcher's publisher key (Ed25519), and the server
stores the bundle as bytes, never importing it. A node takes it only when its operator trusts
that publisher's key (``[node] trusted_publishers``), the signature holds and every file has the
hash the manifest names; a bundle that fails any check is refused with the reason.

This module is the format alone, free of I/O (bytes in, bytes out), so the server, the node, the
CLI and the tests share one reader with one set of limits:

``MAGIC | u32 manifest length | manifest (canonical JSON) | u16 signature length | signature |
the files' bytes, in the manifest's order``

The signature is Ed25519 over ``SIGNED_CONTEXT + manifest``; the manifest names the publisher's
public key, the task's entry (``file.py:name``) and each file's name, size and SHA-256, so the
signature covers every byte. A bundle's identity is the SHA-256 of the whole blob.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ShoalError
from .strict_json import loads_strict

MAGIC = b"SHOALBUNDLE1"
SIGNED_CONTEXT = b"shoal task bundle v1\x00"  # signatures of this format sign nothing else
FORMAT = 1
MODEL_FILE = "initial.safetensors"  # the model's initial state: what the server starts from
KEY_PREFIX = "ed25519:"
MAX_FILES = 64
MAX_CODE_BYTES = 8 << 20  # every file but the initial model, together
MAX_MANIFEST_BYTES = 64 << 10
MAX_NAME = 160
MAX_DEPTH = 8
SIGNATURE_BYTES = 64
DEFAULT_MAX_BYTES = 64 << 20  # a whole bundle, the initial model included
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_ENTRY_ATTR = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SHA = re.compile(r"[0-9a-f]{64}")
_HEAD = struct.Struct(">I")
_SIG_HEAD = struct.Struct(">H")


class BundleError(ShoalError):
    """A bundle that is malformed, over a limit, unsigned, signed by a key not trusted here, or
    whose bytes do not match its manifest; the message is the one line a node reports."""

    code = "bad_bundle"


@dataclass(frozen=True)
class BundleFile:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What the publisher signed: their key, the task's entry and every file."""

    publisher: str  # "ed25519:" + base64 of the 32-byte public key
    entry: str  # "path/in/bundle.py:name"
    files: tuple[BundleFile, ...]

    def to_bytes(self) -> bytes:
        """The canonical encoding (sorted keys, no spaces): what is signed and stored."""
        doc = {
            "format": FORMAT,
            "publisher": self.publisher,
            "entry": self.entry,
            "files": [{"name": f.name, "size": f.size, "sha256": f.sha256} for f in self.files],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Bundle:
    """A bundle read and checked: its manifest, the files' bytes and its identity."""

    manifest: Manifest
    files: dict[str, bytes]
    sha256: str

    @property
    def entry_file(self) -> str:
        return self.manifest.entry.rpartition(":")[0]

    @property
    def model(self) -> bytes:
        return self.files[MODEL_FILE]


# --- keys ---------------------------------------------------------------------------------------


def new_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()  # from the OS's randomness


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def load_private_key(pem: bytes) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise BundleError(f"not a publisher key (PEM, unencrypted): {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BundleError("a publisher key is an Ed25519 key (`shoal bundle keygen`)")
    return key


def public_key_text(key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """``ed25519:BASE64``: how node configs name a trusted publisher."""
    pub = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    raw = pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KEY_PREFIX + base64.b64encode(raw).decode()


def parse_public_key(text: Any) -> Ed25519PublicKey:
    """An ``ed25519:BASE64`` key; BundleError if it is anything else."""
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX) or len(text) != len(KEY_PREFIX) + 44:
        raise BundleError("a publisher key is written ed25519:BASE64 (44 characters; `shoal bundle keygen` prints it)")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX) :], validate=True)
    except ValueError:
        raise BundleError("a publisher key's ed25519: part is not base64") from None
    if len(raw) != 32 or base64.b64encode(raw).decode() != text[len(KEY_PREFIX) :]:
        raise BundleError("a publisher key is 32 bytes, written in canonical base64")
    return Ed25519PublicKey.from_public_bytes(raw)


# --- names ----------------------------------------------------------------------------------------


def check_name(name: Any) -> str:
    """A file's name inside a bundle: relative, ``/``-separated parts of letters, digits, ``_``,
    ``.`` and ``-`` (not starting with ``.`` or ``-``), at most MAX_DEPTH deep: no absolute path,
    no ``..``, nothing a file system could read as anything but a file under the bundle's folder."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise BundleError(f"a file name is a string of 1 to {MAX_NAME} characters")
    parts = name.split("/")
    if len(parts) > MAX_DEPTH or not all(_PART.fullmatch(p) and p not in (".", "..") for p in parts):
        raise BundleError(
            f"file name {name[:80]!r}: relative parts of letters, digits, '_', '.' and '-' (not starting with "
            f"'.' or '-'), at most {MAX_DEPTH} deep"
        )
    return name


def check_entry(entry: Any, names: Collection[str]) -> str:
    if not isinstance(entry, str) or len(entry) > MAX_NAME + 65:
        raise BundleError("the entry is file.py:name, a file of the bundle")
    path, sep, attr = entry.rpartition(":")
    if not sep or not path.endswith(".py") or path not in names or not _ENTRY_ATTR.fullmatch(attr):
        raise BundleError(f"the entry {entry[:120]!r} must be file.py:name, naming a .py file of the bundle")
    return entry


# --- pack ------------------------------------------------------------------------------------------


def pack(files: Mapping[str, bytes], entry: str, key: Ed25519PrivateKey, model: bytes) -> bytes:
    """A signed bundle of ``files`` (name -> bytes), the task's ``entry`` and the model's initial
    state ``model`` (safetensors). BundleError for anything :func:`read` would refuse."""
    if MODEL_FILE in files:
        raise BundleError(f"{MODEL_FILE} is the bundle's own name for the initial model; rename that file")
    items = sorted(files.items()) + [(MODEL_FILE, model)]
    manifest = Manifest(
        public_key_text(key),
        entry,
        tuple(BundleFile(name, len(data), hashlib.sha256(data).hexdigest()) for name, data in items),
    )
    check_manifest(manifest, len(model) + MAX_CODE_BYTES)  # the reader's own limit is checked where it reads
    return assemble(manifest, key.sign(SIGNED_CONTEXT + manifest.to_bytes()), dict(items))


def assemble(manifest: Manifest, signature: bytes, files: Mapping[str, bytes]) -> bytes:
    """The bundle's bytes of a manifest, its signature and the files it names (no check: the
    reader checks; tests build hostile bundles with it)."""
    body = manifest.to_bytes()
    parts = [MAGIC, _HEAD.pack(len(body)), body, _SIG_HEAD.pack(len(signature)), signature]
    return b"".join(parts + [files[f.name] for f in manifest.files])


# --- read and verify ----------------------------------------------------------------------------


def check_manifest(m: Manifest, max_bytes: int) -> None:
    """Every field within its limits (BundleError naming the first that is not)."""
    parse_public_key(m.publisher)
    if not 1 <= len(m.files) <= MAX_FILES:
        raise BundleError(f"a bundle holds 1 to {MAX_FILES} files, not {len(m.files)}")
    seen: set[str] = set()
    for f in m.files:
        check_name(f.name)
        if f.name.lower() in seen:
            raise BundleError(f"file name {f.name[:80]!r} appears twice (names are compared ignoring case)")
        seen.add(f.name.lower())
        if type(f.size) is not int or f.size < 0:
            raise BundleError(f"file {f.name[:80]!r}: its size is an integer >= 0")
        if not isinstance(f.sha256, str) or not _SHA.fullmatch(f.sha256):
            raise BundleError(f"file {f.name[:80]!r}: its sha256 is 64 lowercase hex digits")
    prefixes = {"/".join(n.split("/")[:i]) for n in seen for i in range(1, n.count("/") + 1)}
    if prefixes & seen:
        raise BundleError("a file name is also a folder of another file")
    if m.files[-1].name != MODEL_FILE or MODEL_FILE in {f.name for f in m.files[:-1]}:
        raise BundleError(f"the last file of a bundle is its {MODEL_FILE}, and only the last")
    code = sum(f.size for f in m.files[:-1])
    if code > MAX_CODE_BYTES:
        raise BundleError(f"the task's files hold {code} bytes, over the limit of {MAX_CODE_BYTES}")
    if code + m.files[-1].size > max_bytes:
        raise BundleError(f"the bundle's files hold {code + m.files[-1].size} bytes, over the limit of {max_bytes}")
    check_entry(m.entry, [f.name for f in m.files])


def _manifest(body: bytes) -> Manifest:
    try:
        doc = loads_strict(body)
    except ValueError as e:
        raise BundleError(f"the manifest is not JSON: {e}"[:200]) from None
    if not isinstance(doc, dict) or set(doc) != {"format", "publisher", "entry", "files"}:
        raise BundleError("the manifest holds exactly format, publisher, entry and files")
    if doc["format"] != FORMAT or type(doc["format"]) is not int:
        raise BundleError(f"bundle format {str(doc['format'])[:20]!r}; this shoal reads format {FORMAT}")
    files = doc["files"]
    if not isinstance(files, list) or not all(
        isinstance(f, dict) and set(f) == {"name", "size", "sha256"} for f in files
    ):
        raise BundleError("the manifest's files are a list of {name, size, sha256}")
    m = Manifest(doc["publisher"], doc["entry"], tuple(BundleFile(f["name"], f["size"], f["sha256"]) for f in files))
    if len(m.files) > MAX_FILES:
        raise BundleError(f"a bundle holds 1 to {MAX_FILES} files, not {len(m.files)}")
    if not isinstance(m.publisher, str) or not isinstance(m.entry, str):
        raise BundleError("the manifest's publisher and entry are strings")
    if m.to_bytes() != body:  # one encoding only: what is signed is what is read
        raise BundleError("the manifest is not in its canonical encoding")
    return m


def read(blob: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Manifest, bytes, Bundle]:
    """The bundle's manifest, signature and files, every field and hash checked, the signature NOT
    (the server stores bundles it cannot judge; a node calls :func:`verify`)."""
    if not isinstance(blob, bytes | bytearray | memoryview):
        raise BundleError("a bundle is bytes")
    blob = bytes(blob)
    if len(blob) > max_bytes + MAX_MANIFEST_BYTES + 1024:
        raise BundleError(f"the bundle is {len(blob)} bytes, over the limit of {max_bytes}")
    head = len(MAGIC) + _HEAD.size
    if len(blob) < head or not blob.startswith(MAGIC):
        raise BundleError("not a shoal task bundle (`shoal run submit --bundle` makes them)")
    (n,) = _HEAD.unpack_from(blob, len(MAGIC))
    if n > MAX_MANIFEST_BYTES or head + n + _SIG_HEAD.size > len(blob):
        raise BundleError(f"the manifest's length {n} is over {MAX_MANIFEST_BYTES} bytes or past the bundle's end")
    body = blob[head : head + n]
    at = head + n
    (s,) = _SIG_HEAD.unpack_from(blob, at)
    at += _SIG_HEAD.size
    if s != SIGNATURE_BYTES or at + s > len(blob):
        raise BundleError("the bundle carries no Ed25519 signature (it is unsigned or cut short)")
    sig = blob[at : at + s]
    at += s
    m = _manifest(body)
    check_manifest(m, max_bytes)
    if len(blob) - at != sum(f.size for f in m.files):
        raise BundleError(
            f"the bundle holds {len(blob) - at} bytes of files, its manifest names {sum(f.size for f in m.files)}"
        )
    files: dict[str, bytes] = {}
    for f in m.files:
        data = blob[at : at + f.size]
        at += f.size
        if hashlib.sha256(data).hexdigest() != f.sha256:
            raise BundleError(f"file {f.name!r} does not have the SHA-256 its manifest names (changed or damaged)")
        files[f.name] = data
    return m, sig, Bundle(m, files, hashlib.sha256(blob).hexdigest())


def verify(blob: bytes, trusted: Collection[str], max_bytes: int = DEFAULT_MAX_BYTES) -> Bundle:
    """The bundle, if its manifest is signed by one of the ``trusted`` publisher keys and every
    file matches it; BundleError with the reason otherwise (untrusted key, bad signature, a byte
    changed, a limit passed)."""
    m, sig, bundle = read(blob, max_bytes)
    if m.publisher not in trusted:
        raise BundleError(f"the bundle is signed by publisher {m.publisher[:20]}..., a key this node does not trust")
    try:
        parse_public_key(m.publisher).verify(sig, SIGNED_CONTEXT + m.to_bytes())
    except InvalidSignature:
        raise BundleError(
            "the bundle's signature does not verify with its publisher's key (changed or forged)"
        ) from None
    return bundle
