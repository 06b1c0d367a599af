"""Cryptographic primitives of secure aggregation (Bonawitz et al. 2017, Sec. 3 and 4).

All from ``cryptography`` (OpenSSL): X25519 key agreement, HKDF-SHA256 key derivation,
AES-256-GCM authenticated encryption of the secret shares, and AES-256-CTR as the
pseudorandom generator that expands a 256-bit key into a whole mask vector in one call
(the full key is used: no folding into a 32-bit numpy seed). Shamir t-of-n secret
sharing of 32-byte secrets runs over the prime field GF(2^31 - 1), vectorised with
numpy: a secret is split into 16-bit chunks, one field element each.
"""

from __future__ import annotations

import os
import struct
from functools import lru_cache

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

KEY_BYTES = 32
PRIME = 2**31 - 1  # Mersenne prime: a product of two elements fits in int64
CHUNKS = KEY_BYTES // 2  # field elements per 32-byte secret (16-bit chunks)
_ZERO_IV = bytes(16)


class Randomness:
    """Where secret keys, seeds and share polynomials come from.

    ``Randomness()`` reads the OS CSPRNG. ``Randomness(seed)`` is an AES-CTR stream
    keyed by the seed, for simulations that must repeat exactly (same config and
    seed = same numbers); a deployment never passes a seed.
    """

    def __init__(self, seed: bytes | int | None = None):
        if seed is None:
            self._stream = None
        else:
            material = seed if isinstance(seed, bytes) else str(int(seed)).encode()
            key = hkdf(material, b"shoal secagg randomness")
            self._stream = Cipher(algorithms.AES(key), modes.CTR(_ZERO_IV)).encryptor()

    def bytes(self, n: int) -> bytes:
        return os.urandom(n) if self._stream is None else self._stream.update(bytes(n))

    def uint64(self, shape: int | tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        return np.frombuffer(self.bytes(8 * count), dtype=np.uint64).reshape(shape)


def hkdf(secret: bytes, info: bytes, salt: bytes | None = None) -> bytes:
    """HKDF-SHA256 (RFC 5869) to a 32-byte key; ``info`` separates the key's uses."""
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=salt, info=info).derive(secret)


# --- key agreement ------------------------------------------------------------------


def generate_private(rand: Randomness) -> bytes:
    """A fresh X25519 private key as its 32 raw bytes (what gets secret-shared)."""
    return X25519PrivateKey.from_private_bytes(rand.bytes(KEY_BYTES)).private_bytes_raw()


def public_key(private: bytes) -> bytes:
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def private_key(private: bytes) -> X25519PrivateKey:
    """The key object of 32 raw bytes; load it once per party, not per agreement
    (loading costs as much as the agreement itself)."""
    return X25519PrivateKey.from_private_bytes(private)


_P25519 = 2**255 - 19
_PROBE = X25519PrivateKey.from_private_bytes(bytes(range(1, 33)))  # any scalar: X25519 clamps it to 8 x k


def canonical_public(public: bytes) -> bytes:
    """The one encoding of an X25519 u-coordinate (high bit cleared, reduced mod p): two
    byte strings that X25519 treats as the same key compare equal after this."""
    u = (int.from_bytes(public, "little") & ((1 << 255) - 1)) % _P25519
    return u.to_bytes(KEY_BYTES, "little")


def check_public_key(public: bytes) -> bytes:
    """``public`` if it is a 32-byte X25519 key that can be agreed with; ValueError for a
    wrong length or a point of small order (the all-zero key among them): any clamped
    scalar is a multiple of 8, so a small-order point agrees to the all-zero secret with
    everyone, and its "pairwise" masks would be known to all (RFC 7748, Sec. 6.1)."""
    if not isinstance(public, bytes) or len(public) != KEY_BYTES:
        raise ValueError(f"an X25519 public key has {KEY_BYTES} bytes")
    try:
        _PROBE.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        raise ValueError("X25519 public key is a point of small order (e.g. all zeros)") from None
    return public


def agree(private: X25519PrivateKey, peer_public: bytes | X25519PublicKey, info: bytes, salt: bytes) -> bytes:
    """KA.agree then HKDF: the 256-bit key two parties share (Bonawitz Sec. 3.3).

    ``salt`` binds the key to one session (round), ``info`` to one use (mask or
    share encryption), so no key ever serves two purposes.
    """
    if isinstance(peer_public, bytes):
        peer_public = X25519PublicKey.from_public_bytes(peer_public)
    return hkdf(private.exchange(peer_public), info, salt)


# --- authenticated encryption of shares ----------------------------------------------


def encrypt(key: bytes, plaintext: bytes, associated: bytes, rand: Randomness) -> bytes:
    """AES-256-GCM; the 12-byte nonce is prepended to the ciphertext."""
    nonce = rand.bytes(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, blob: bytes, associated: bytes) -> bytes | None:
    """The plaintext, or None when the ciphertext or its context was tampered with."""
    try:
        return AESGCM(key).decrypt(blob[:12], blob[12:], associated)
    except (InvalidTag, ValueError):
        return None


# --- pseudorandom generator ----------------------------------------------------------


class MaskExpander:
    """AES-256-CTR keystreams of ``size`` uint32 values, one OpenSSL call per key.

    Reuses one output buffer, so a server that expands thousands of keys allocates
    nothing per key: ``expand(key)`` returns a view valid until the next call (AES-NI:
    a 100K-entry mask in well under a millisecond).
    """

    def __init__(self, size: int):
        self.size = size
        self._zeros = bytes(4 * size)
        self._buf = bytearray(4 * size + 16)  # update_into wants a block of headroom
        self._out = np.frombuffer(self._buf, dtype=np.uint32)

    def expand(self, key: bytes) -> np.ndarray:
        enc = Cipher(algorithms.AES(key), modes.CTR(_ZERO_IV)).encryptor()
        enc.update_into(self._zeros, self._buf)
        return self._out[: self.size]


def prg(key: bytes, size: int) -> np.ndarray:
    """``size`` pseudorandom uint32 values expanded from the full 256-bit ``key``."""
    return MaskExpander(size).expand(key).copy()


# --- Shamir secret sharing over GF(p) -------------------------------------------------


def secret_to_field(secrets: list[bytes]) -> np.ndarray:
    """32-byte secrets -> one row of 16 field elements (16-bit chunks), concatenated."""
    for s in secrets:
        if len(s) != KEY_BYTES:
            raise ValueError(f"a secret has {len(s)} bytes, expected {KEY_BYTES}")
    return np.frombuffer(b"".join(secrets), dtype="<u2").astype(np.int64)


def field_to_secrets(values: np.ndarray) -> list[bytes]:
    """Inverse of :func:`secret_to_field`; raises if an element is not a 16-bit chunk
    (a reconstruction from inconsistent shares)."""
    v = np.asarray(values, dtype=np.int64)
    if v.min(initial=0) < 0 or v.max(initial=0) > 0xFFFF:
        raise ValueError("reconstructed value is not a valid secret: the shares are inconsistent")
    raw = v.astype("<u2").tobytes()
    return [raw[i : i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES)]


def shamir_share(values: np.ndarray, xs: np.ndarray, t: int, rand: Randomness) -> np.ndarray:
    """Shares of each field element in ``values`` for holders at points ``xs``.

    One random polynomial of degree t-1 per element, its constant term the element;
    returns ``(len(xs), len(values))`` evaluations, by Horner's rule so every
    intermediate product stays below 2^62.
    """
    xs = np.asarray(xs, dtype=np.int64)
    if not 1 <= t <= len(xs):
        raise ValueError(f"threshold t = {t} must be in [1, {len(xs)}] (the number of share holders)")
    if xs.min() < 1 or xs.max() >= PRIME or len(set(xs.tolist())) != len(xs):
        raise ValueError("share points must be distinct and in [1, p)")
    values = np.asarray(values, dtype=np.int64)
    coeffs = (rand.uint64((t - 1, len(values))) % np.uint64(PRIME)).astype(np.int64)
    acc = np.zeros((len(xs), len(values)), dtype=np.int64)
    for c in coeffs[::-1]:  # highest degree first
        acc = (acc * xs[:, None] + c[None, :]) % PRIME
    return (acc * xs[:, None] + values[None, :]) % PRIME


@lru_cache(maxsize=4096)
def lagrange_at_zero(xs: tuple[int, ...]) -> np.ndarray:
    """Lagrange basis values l_j(0) mod p for the points ``xs`` (cached: in the full
    graph every client's secret is rebuilt from the same responders)."""
    out = []
    for j, xj in enumerate(xs):
        num, den = 1, 1
        for m, xm in enumerate(xs):
            if m != j:
                num = num * xm % PRIME
                den = den * (xm - xj) % PRIME
        out.append(num * pow(den, PRIME - 2, PRIME) % PRIME)
    return np.array(out, dtype=np.int64)


def shamir_reconstruct(xs: list[int], shares: np.ndarray) -> np.ndarray:
    """The shared field elements from ``len(xs)`` shares (rows of ``shares``)."""
    if len(set(xs)) != len(xs):
        raise ValueError("share points must be distinct")
    lam = lagrange_at_zero(tuple(int(x) for x in xs))
    terms = (np.asarray(shares, dtype=np.int64) * lam[:, None]) % PRIME
    return terms.sum(axis=0) % PRIME  # t terms below 2^31 each: no overflow for t < 2^32


def pack_shares(sender: int, receiver: int, shares: np.ndarray) -> bytes:
    """The plaintext of one encrypted share message: indices, then int32 elements."""
    return struct.pack("<II", sender, receiver) + np.asarray(shares, dtype="<i4").tobytes()


def unpack_shares(plaintext: bytes) -> tuple[int, int, np.ndarray]:
    sender, receiver = struct.unpack("<II", plaintext[:8])
    return sender, receiver, np.frombuffer(plaintext[8:], dtype="<i4").astype(np.int64)
