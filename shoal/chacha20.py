"""The ChaCha20 keystream (RFC 8439) in torch integer ops, many blocks at once, on any device.

Why it exists: the privacy noise's CSPRNG (shoal/noise.py) is AES-256-CTR on the CPU; filling a
CUDA tensor from it means making and copying 32 keystream bytes per noise entry, which cost a
DP-SGD step of a small CNN many times the rest of the step. ChaCha20 needs only 32-bit additions,
XORs and rotations, so it runs where the noise is used: one sequence of elementwise kernels makes
every block of a call (each block's counter is an entry of a tensor), and the keystream never
leaves the device; on a GPU those ops are fused into one kernel (:func:`block_function`).
:class:`ChaCha20Stream` is that stream; shoal/noise.py keys one per device from its own AES stream.

The cipher is the RFC's: a 256-bit key, a 32-bit block counter and a 96-bit nonce in a 4x4 state of
32-bit words, 20 rounds (10 double rounds of four column and four diagonal quarter rounds), the
input state added back, each word serialised little-endian. The state's four rows are each a
``(4, m)`` tensor (one column per block), so one torch op does a quarter round's step for four
columns of m blocks, and a diagonal round is a column round on rows rolled by one, two and three.

Words are held in int32 lanes: torch's uint32 lacks most ops, and its int32 addition, XOR and left
shift act on the bits as unsigned arithmetic modulo 2^32 would (addition wraps; left shift shifts
the bits out), so only the right shift needs care: it is arithmetic for a signed type, so a
rotation masks the bits it brings in. int64 lanes masked with 0xFFFFFFFF after every addition and
rotation take more ops and move twice the bytes: on one CPU thread of a shared machine, 65,536
blocks took 3x to 5.6x as long in int64 lanes as in int32 (two runs of
``python bench/chacha20_variants.py``, which also runs with ``--device cuda``), so int32 it is.
The CPU and CUDA keystreams are compared bit for bit in tests/privacy/test_chacha20.py.

The block position never repeats under a key: a stream's position is a 128-bit integer, the
96-bit nonce above the 32-bit counter, so a stream that outgrows 2^32 blocks under one nonce goes
on with counter 0 under the next nonce, each position is used once and then only moves forward,
and a stream refuses to pass 2^128 blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 12
BLOCK_WORDS = 16  # 32-bit words per 64-byte block
_CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k", little-endian
_MASK32 = 0xFFFF_FFFF
_POSITIONS = 1 << 128  # (nonce, counter) pairs under one key
_MAX_BLOCKS_PER_CALL = 1 << 32  # so one call's counters cross at most one nonce boundary


def _signed32(word: int) -> int:
    """The int32 value with the bits of the unsigned 32-bit ``word``."""
    return word - (1 << 32) if word >= 1 << 31 else word


def _words_le(data: bytes) -> list[int]:
    """``data`` (a multiple of 4 bytes) as little-endian 32-bit words, as int32 values."""
    return [_signed32(int.from_bytes(data[i : i + 4], "little")) for i in range(0, len(data), 4)]


def _rotl(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` rotated left by ``n`` bits as 32-bit words (in place on ``x``: returned for chaining).
    The arithmetic right shift copies the sign bit into the top, so those bits are masked off."""
    high = x << n
    return x.bitwise_right_shift_(32 - n).bitwise_and_((1 << n) - 1).bitwise_or_(high)


def _quarter_rounds(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """RFC 8439's quarter round on rows a, b, c, d of four columns of every block at once (in place)."""
    d = _rotl(d.bitwise_xor_(a.add_(b)), 16)
    b = _rotl(b.bitwise_xor_(c.add_(d)), 12)
    d = _rotl(d.bitwise_xor_(a.add_(b)), 8)
    b = _rotl(b.bitwise_xor_(c.add_(d)), 7)
    return a, b, c, d


def chacha20_blocks(initial: torch.Tensor) -> torch.Tensor:
    """The ChaCha20 block function on ``initial``, a ``(16, m)`` int32 tensor of m input states
    (one per column): the ``(m, 16)`` int32 keystream words, block by block, in stream order."""
    a, b, c, d = (initial[4 * i : 4 * i + 4].clone() for i in range(4))
    for _ in range(10):  # double rounds: columns, then diagonals (rows b, c, d rolled to line them up)
        a, b, c, d = _quarter_rounds(a, b, c, d)
        a, b, c, d = _quarter_rounds(a, b.roll(-1, 0), c.roll(-2, 0), d.roll(-3, 0))
        b, c, d = b.roll(1, 0), c.roll(2, 0), d.roll(3, 0)
    return torch.cat([a, b, c, d]).add_(initial).t().contiguous()


BlockFunction = Callable[[torch.Tensor], torch.Tensor]
_FUSED: dict[torch.device, BlockFunction | None] = {}  # per CUDA device: the checked compiled function, or None
_PROBE_BLOCKS = 4099  # the check's input states: several of a fused kernel's thread blocks, an odd tail


def block_function(device: torch.device) -> BlockFunction:
    """The block function to run on ``device``.

    On a CUDA device, :func:`chacha20_blocks` fused into one kernel by ``torch.compile`` (its ~550
    elementwise ops otherwise each stream the whole state through memory), used only after the
    fused kernel gave the same words as the elementwise ops on that device for a fixed set of input
    states; the elementwise ops themselves are checked against RFC 8439 in the tests. If compiling
    fails or the words differ, the run says so once and keeps the elementwise ops. Elsewhere the
    elementwise ops (compiling on a CPU took minutes and was no faster)."""
    if device.type != "cuda":
        return chacha20_blocks
    if device not in _FUSED:
        _FUSED[device] = _checked_fusion(device)
    return _FUSED[device] or chacha20_blocks


def _checked_fusion(device: torch.device) -> BlockFunction | None:
    # fixed, well-mixed input states (no random generator is touched: a run's seeded draws stay as they were)
    i = torch.arange(BLOCK_WORDS * _PROBE_BLOCKS, dtype=torch.int64, device=device)
    probe = i.mul_(2654435761).add_(0x9E3779B9).bitwise_and_(_MASK32)
    probe = probe.sub_(probe.bitwise_right_shift(31).bitwise_left_shift(32)).to(torch.int32)
    probe = probe.view(BLOCK_WORDS, _PROBE_BLOCKS)
    try:
        log.info("compiling the ChaCha20 block function for %s (once per process)", device)
        fused = torch.compile(chacha20_blocks, dynamic=True, fullgraph=True)
        same = torch.equal(fused(probe.clone()), chacha20_blocks(probe.clone()))
    except Exception as e:  # noqa: BLE001 - no compiler, no Triton, a lowering error: the elementwise ops stay
        log.warning(
            "ChaCha20 on %s: torch.compile failed (%s: %s); the keystream is made by elementwise ops",
            device,
            type(e).__name__,
            str(e).splitlines()[0][:200] if str(e) else "",
        )
        return None
    if not same:
        log.warning("ChaCha20 on %s: the compiled block function gave other words; using the elementwise ops", device)
        return None
    return fused


class ChaCha20Stream:
    """The keystream of one 256-bit key on one device, drawn in order and never reused.

    ``nonce`` and ``counter`` give the first block (RFC 8439's test vectors start elsewhere than 0);
    the position then moves through every block of the 96-bit nonce / 32-bit counter space once.
    Words not used by a draw are kept for the next, so two draws equal one draw of both."""

    def __init__(
        self,
        key: bytes,
        device: torch.device | str = "cpu",
        *,
        nonce: bytes = bytes(NONCE_BYTES),
        counter: int = 0,
    ):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a ChaCha20 key has {KEY_BYTES} bytes, not {len(key)}")
        if len(nonce) != NONCE_BYTES or not 0 <= counter <= _MASK32:
            raise ValueError(f"a ChaCha20 nonce has {NONCE_BYTES} bytes and the counter 32 bits")
        self.device = torch.device(device)
        # constants and key: the first 12 rows of every input state, one copy to the device
        self._fixed = torch.tensor([_signed32(w) for w in _CONSTANTS] + _words_le(key), dtype=torch.int32)
        self._fixed = self._fixed.to(self.device).unsqueeze(1)
        self._position = (int.from_bytes(nonce, "little") << 32) | counter
        self._spare = torch.empty(0, dtype=torch.int32, device=self.device)  # drawn, not yet used

    @property
    def position(self) -> int:
        """The next unused block: the nonce (as a little-endian integer) times 2^32 plus the counter."""
        return self._position

    def blocks(self, m: int) -> torch.Tensor:
        """The next ``m`` keystream blocks as an ``(m, 16)`` int32 tensor (words in stream order)."""
        start = self._position
        if m < 0 or m > _MAX_BLOCKS_PER_CALL:
            raise ValueError(f"draw 0 to 2^32 ChaCha20 blocks at a time, not {m}")
        if start + m > _POSITIONS:
            raise RuntimeError("this ChaCha20 stream has used every nonce and counter of its key")
        self._position = start + m  # moved before the blocks exist: a failed draw never reuses them
        state = torch.empty((BLOCK_WORDS, m), dtype=torch.int32, device=self.device)
        state[:12] = self._fixed
        counters = torch.arange(m, dtype=torch.int64, device=self.device).add_(start & _MASK32)
        low = counters.bitwise_and(_MASK32)
        state[12] = low.sub_(low.bitwise_right_shift(31).bitwise_left_shift(32))  # as int32, same bits
        nonce = start >> 32
        first_next = min(m, (1 << 32) - (start & _MASK32))  # blocks before the counter wraps
        for i in range(3):
            state[13 + i, :first_next] = _signed32((nonce >> (32 * i)) & _MASK32)
            state[13 + i, first_next:] = _signed32(((nonce + 1) >> (32 * i)) & _MASK32)
        return block_function(self.device)(state)

    def words32(self, n: int) -> torch.Tensor:
        """The next ``n`` keystream words (int32 lanes holding the 32-bit words' bits), in stream order."""
        take = min(n, self._spare.numel())
        head, self._spare = self._spare[:take], self._spare[take:]
        if take == n:
            return head
        fresh = self.blocks(-(-(n - take) // BLOCK_WORDS)).view(-1)
        rest = n - take
        self._spare = fresh[rest:].clone()  # at most 15 words: the big draw is not kept alive
        return torch.cat([head, fresh[:rest]]) if take else fresh[:rest]

    def words(self, n: int) -> torch.Tensor:
        """The next ``n`` keystream words as int64 values in [0, 2^32)."""
        return self.words32(n).to(torch.int64).bitwise_and_(_MASK32)

    def top53(self, n: int) -> torch.Tensor:
        """``n`` integers in [0, 2^53) (int64): the top 53 bits of each of the next ``n`` little-endian
        64-bit words of the keystream (what ``NoiseSource.words(n) >> 11`` is for the AES stream)."""
        pairs = self.words32(2 * n).view(n, 2).to(torch.int64).bitwise_and_(_MASK32)
        return (pairs[:, 1] << 21).bitwise_or_(pairs[:, 0] >> 11)
