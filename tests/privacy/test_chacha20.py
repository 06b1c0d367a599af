"""The device keystream (shoal/chacha20.py): RFC 8439's vectors, an independent reference, no reuse."""

import random

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from shoal.chacha20 import ChaCha20Stream, block_function, chacha20_blocks

M32 = 0xFFFF_FFFF


def reference_block(key: bytes, counter: int, nonce: bytes) -> bytes:
    """ChaCha20's block function as RFC 8439 section 2.3 writes it, on Python integers."""

    def rotl(v: int, n: int) -> int:
        return ((v << n) | (v >> (32 - n))) & M32

    def quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
        s[a] = (s[a] + s[b]) & M32
        s[d] = rotl(s[d] ^ s[a], 16)
        s[c] = (s[c] + s[d]) & M32
        s[b] = rotl(s[b] ^ s[c], 12)
        s[a] = (s[a] + s[b]) & M32
        s[d] = rotl(s[d] ^ s[a], 8)
        s[c] = (s[c] + s[d]) & M32
        s[b] = rotl(s[b] ^ s[c], 7)

    def le_words(b: bytes) -> list[int]:
        return [int.from_bytes(b[i : i + 4], "little") for i in range(0, len(b), 4)]

    init = [0x61707865, 0x3320646E, 0x79622D32, 0x6B206574, *le_words(key), counter, *le_words(nonce)]
    s = list(init)
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)):
            quarter(s, a, b, c, d)
        for a, b, c, d in ((0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            quarter(s, a, b, c, d)
    return b"".join(((x + y) & M32).to_bytes(4, "little") for x, y in zip(s, init))


def reference_stream(key: bytes, nonce: bytes, counter: int, blocks: int) -> bytes:
    """``blocks`` blocks from (nonce, counter) on, the counter carrying into the nonce as shoal's stream does."""
    position = (int.from_bytes(nonce, "little") << 32) | counter
    return b"".join(
        reference_block(key, p & M32, (p >> 32).to_bytes(12, "little")) for p in range(position, position + blocks)
    )


def as_bytes(words: torch.Tensor) -> bytes:
    return words.cpu().numpy().astype("<u4").tobytes()


RFC_KEY = bytes(range(32))
# RFC 8439 2.3.2: the serialised block for counter 1, nonce 00:00:00:09:00:00:00:4a:00:00:00:00
RFC_BLOCK = bytes.fromhex(
    "10f1e7e4d13b5915500fdd1fa32071c4c7d1f4c733c068030422aa9ac3d46c4e"
    "d2826446079faa0914c2d705d98b02a2b5129cd1de164eb9cbd083e8a2503c4e"
)
# RFC 8439 2.4.2: the sunscreen plaintext under counter 1, nonce 00:00:00:00:00:00:00:4a:00:00:00:00
RFC_PLAINTEXT = (
    b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip for the future, "
    b"sunscreen would be it."
)
RFC_CIPHERTEXT = bytes.fromhex(
    "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
    "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
    "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
    "5af90bbf74a35be6b40b8eedf2785e42874d"
)


def test_rfc8439_block_and_encryption_vectors():
    nonce = bytes.fromhex("000000090000004a00000000")
    assert reference_block(RFC_KEY, 1, nonce) == RFC_BLOCK
    assert as_bytes(ChaCha20Stream(RFC_KEY, nonce=nonce, counter=1).words(16)) == RFC_BLOCK

    nonce = bytes.fromhex("000000000000004a00000000")
    stream = ChaCha20Stream(RFC_KEY, nonce=nonce, counter=1)
    keystream = as_bytes(stream.words(-(-len(RFC_PLAINTEXT) // 4)))[: len(RFC_PLAINTEXT)]
    assert bytes(p ^ k for p, k in zip(RFC_PLAINTEXT, keystream)) == RFC_CIPHERTEXT
    assert bytes(p ^ k for p, k in zip(RFC_PLAINTEXT, reference_stream(RFC_KEY, nonce, 1, 2))) == RFC_CIPHERTEXT
    assert stream.position == (int.from_bytes(nonce, "little") << 32) + 3  # two blocks used, the next is 3


def test_equals_the_reference_and_openssl_for_random_keys_nonces_and_counters():
    rng = random.Random(8439)
    for counter in (0, rng.randrange(1 << 32), M32 - 2, M32):  # the last two cross into the next nonce
        key, nonce = rng.randbytes(32), rng.randbytes(12)
        got = as_bytes(ChaCha20Stream(key, nonce=nonce, counter=counter).words(5 * 16))
        assert got == reference_stream(key, nonce, counter, 5)
        if counter + 5 <= M32 + 1:  # OpenSSL (via cryptography) refuses to move past its 32-bit counter
            openssl = Cipher(algorithms.ChaCha20(key, counter.to_bytes(4, "little") + nonce), None).encryptor()
            assert got == openssl.update(bytes(len(got)))
    # the counter wraps into the nonce as a 96-bit little-endian number (carry across nonce words)
    nonce = (M32).to_bytes(4, "little") + bytes(8)
    got = as_bytes(ChaCha20Stream(RFC_KEY, nonce=nonce, counter=M32).words(2 * 16))
    assert got[64:] == reference_block(RFC_KEY, 0, bytes(4) + (1).to_bytes(4, "little") + bytes(4))


def test_draws_continue_the_stream_and_never_reuse_a_block():
    key = bytes(range(100, 132))
    whole = ChaCha20Stream(key, counter=M32 - 3)
    parts = ChaCha20Stream(key, counter=M32 - 3)
    n = 37  # not a whole number of blocks: the unused words are kept for the next draw
    assert torch.equal(torch.cat([parts.words(n), parts.words(n)]), whole.words(2 * n))
    assert whole.position == parts.position == M32 - 3 + 5
    wide, halves = ChaCha20Stream(key), ChaCha20Stream(key)
    first = wide.top53(2 * n)
    assert torch.equal(torch.cat([halves.top53(n), halves.top53(n)]), first)
    assert int(first.min()) >= 0 and int(first.max()) < 1 << 53
    raw = ChaCha20Stream(key).words32(4 * n).numpy().view("<u8")  # the keystream as little-endian 64-bit words
    assert np.array_equal(first.numpy(), (raw >> np.uint64(11)).astype(np.int64))

    last = ChaCha20Stream(key, nonce=b"\xff" * 12, counter=M32 - 1)  # two blocks left under this key
    last.blocks(2)
    with pytest.raises(RuntimeError, match="every nonce and counter"):
        last.blocks(1)
    with pytest.raises(ValueError):
        ChaCha20Stream(key[:16])


def test_keystream_words_are_uniform():
    w = ChaCha20Stream(bytes(32)).words(1 << 15).numpy()
    bits = np.unpackbits(w.astype("<u4").view(np.uint8)).reshape(-1, 32).mean(axis=0)
    assert np.abs(bits - 0.5).max() < 5 * 0.5 / np.sqrt(w.size)  # every bit position fair to 5 standard errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_keystream_equals_the_cpu_one_bit_for_bit():
    rng = random.Random(1)
    key, nonce = rng.randbytes(32), rng.randbytes(12)
    cpu = ChaCha20Stream(key, "cpu", nonce=nonce, counter=M32 - 100)
    cuda = ChaCha20Stream(key, "cuda", nonce=nonce, counter=M32 - 100)
    for n in (5, 1000, 3333):  # across the counter's wrap
        got = cuda.words(n)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), cpu.words(n))
    assert torch.equal(cuda.top53(999).cpu(), cpu.top53(999))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fuses_the_block_function_and_it_gives_the_elementwise_words():
    device = torch.device("cuda")
    fused = block_function(device)
    assert fused is not chacha20_blocks  # compiled and checked here (the log says why if not)
    i = torch.arange(16 * 100_003, dtype=torch.int64, device=device).mul_(0x9E3779B1).bitwise_and_(0x7FFFFFFF)
    state = i.to(torch.int32).view(16, -1)
    assert torch.equal(fused(state.clone()), chacha20_blocks(state.clone()))
    assert block_function(torch.device("cpu")) is chacha20_blocks
