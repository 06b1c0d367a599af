import math

import pytest
import torch

from shoal.aggregation.compression import Compressor, TopK, dequantize_q8, quantize_q8
from shoal.config import CompressionConfig
from shoal.errors import Malformed, NonFinite, SpecMismatch, TooLarge
from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.update import Update
from shoal.wire import decode_update, encode, encode_update


def test_q8_is_unbiased_over_many_draws():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g) * torch.linspace(0.01, 3, 3000)
    draws = 4000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(draws):
        q, s = quantize_q8(x, 256, g)
        total += dequantize_q8(q, s, 256).double()
    mean = total / draws
    s_full = dequantize_q8(torch.ones(3000, dtype=torch.int8), quantize_q8(x, 256)[1], 256).double()
    # one draw's error is within one step s and has std <= s/2; the mean of N draws has
    # std <= s / (2 sqrt(N)): allow 6 of those. Round-to-nearest would miss by up to s/2.
    assert ((mean - x.double()).abs() <= 6 * s_full / (2 * math.sqrt(draws))).all()


def test_q8_codes_scales_and_zero_chunks():
    x = torch.cat([torch.zeros(10), torch.tensor([2.54, -1.27, 0.0])])
    q, s = quantize_q8(x, 10)
    assert q.dtype == torch.int8 and q.numel() == 13 and s.tolist()[0] == 0.0
    assert q[:10].eq(0).all() and q[10].item() == 127 and q.min() >= -127
    torch.testing.assert_close(s[1], torch.tensor(0.02))


def test_topk_error_feedback_loses_nothing():
    tk = TopK(0.1)
    g = torch.Generator().manual_seed(1)
    sent = torch.zeros(100)
    total = torch.zeros(100)
    for _ in range(5):
        d = torch.randn(100, generator=g)
        total += d
        idx, vals = tk.compress(d, "c1")
        assert idx.dtype == torch.int32 and idx.numel() == 10 and bool((idx[1:] > idx[:-1]).all())
        sent[idx.long()] += vals
    torch.testing.assert_close(sent + tk.residuals["c1"], total)
    assert "c2" not in tk.residuals


@pytest.fixture
def spec():
    return ParamSpec.of(build_model("logreg", (60,), 10))  # 610 parameters


def upd(spec, seed=0):
    return Update(delta=torch.randn(spec.numel, generator=torch.Generator().manual_seed(seed)), num_examples=5)


@pytest.mark.parametrize("zstd", [0, 3])
def test_each_encoding_round_trips_and_says_so(spec, zstd):
    u = upd(spec)
    sizes = {}
    for enc in ("dense", "q8", "topk"):
        comp = Compressor(CompressionConfig(encoding=enc, topk_fraction=0.1, q8_chunk=64))
        payload = comp.encode(u.delta, "c", seed=3)
        body = encode_update(u, spec, payload=payload, zstd_level=zstd)
        got, header = decode_update(body, spec)
        assert header["encoding"] == enc and header.get("zstd", False) == bool(zstd)
        sizes[enc] = len(body)
        if enc == "dense":
            assert torch.equal(got.delta, u.delta)
        elif enc == "q8":
            torch.testing.assert_close(got.delta, dequantize_q8(payload.tensors["q"], payload.tensors["scale"], 64))
        else:
            idx = payload.tensors["indices"].long()
            assert torch.equal(got.delta[idx], u.delta[idx]) and int((got.delta != 0).sum()) == 61
    assert sizes["topk"] < sizes["q8"] < sizes["dense"]


def lying(spec, tensors, **fields):
    header = {"kind": "update", "spec_hash": spec.hash, "base_version": 0, "num_examples": 1, **fields}
    return encode(tensors, header)


def q8_parts(spec, chunk=64):
    return quantize_q8(torch.randn(spec.numel), chunk)


@pytest.mark.parametrize(
    "make, error, match",
    [
        # top-k: the header's k disagrees with what was sent
        (
            lambda s: lying(
                s, {"indices": torch.arange(10, dtype=torch.int32), "values": torch.ones(10)}, encoding="topk", k=5
            ),
            SpecMismatch,
            "shape",
        ),
        (
            lambda s: lying(
                s, {"indices": torch.arange(400, dtype=torch.int32), "values": torch.ones(400)}, encoding="topk", k=400
            ),
            Malformed,
            "'k'",
        ),
        (
            lambda s: lying(
                s, {"indices": torch.tensor([1, 700], dtype=torch.int32), "values": torch.ones(2)}, encoding="topk", k=2
            ),
            Malformed,
            "outside",
        ),
        (
            lambda s: lying(
                s, {"indices": torch.tensor([-1, 3], dtype=torch.int32), "values": torch.ones(2)}, encoding="topk", k=2
            ),
            Malformed,
            "outside",
        ),
        (
            lambda s: lying(
                s, {"indices": torch.tensor([5, 3], dtype=torch.int32), "values": torch.ones(2)}, encoding="topk", k=2
            ),
            Malformed,
            "strictly increasing",
        ),
        (
            lambda s: lying(
                s, {"indices": torch.tensor([3, 3], dtype=torch.int32), "values": torch.ones(2)}, encoding="topk", k=2
            ),
            Malformed,
            "no duplicates",
        ),
        (
            lambda s: lying(
                s, {"indices": torch.tensor([1, 3], dtype=torch.int64), "values": torch.ones(2)}, encoding="topk", k=2
            ),
            SpecMismatch,
            "dtype",
        ),
        # q8: wrong chunk (so the scale count is wrong), wrong length, bad scales, bad codes
        (
            lambda s: lying(s, dict(zip(("q", "scale"), q8_parts(s, 64))), encoding="q8", chunk=128),
            SpecMismatch,
            "'scale' has shape",
        ),
        (
            lambda s: lying(s, {"q": q8_parts(s)[0][:-1], "scale": q8_parts(s)[1]}, encoding="q8", chunk=64),
            SpecMismatch,
            "'q' has shape",
        ),
        (
            lambda s: lying(s, {"q": q8_parts(s)[0], "scale": -q8_parts(s)[1]}, encoding="q8", chunk=64),
            Malformed,
            "negative",
        ),
        (
            lambda s: lying(
                s, {"q": q8_parts(s)[0], "scale": torch.full((10,), float("nan"))}, encoding="q8", chunk=64
            ),
            NonFinite,
            "'scale'",
        ),
        (
            lambda s: lying(
                s,
                {"q": torch.full((s.numel,), -128, dtype=torch.int8), "scale": torch.ones(10)},
                encoding="q8",
                chunk=64,
            ),
            Malformed,
            "-128",
        ),
        (lambda s: lying(s, dict(zip(("q", "scale"), q8_parts(s, 64))), encoding="q8", chunk=0), Malformed, "'chunk'"),
        (lambda s: lying(s, {"delta": torch.zeros(s.numel)}, encoding="gzip"), Malformed, "'encoding'"),
        (lambda s: lying(s, {"delta": torch.zeros(s.numel)}, encoding="dense", zstd="yes"), Malformed, "'zstd'"),
        (
            lambda s: lying(s, {"zstd": torch.arange(50, dtype=torch.uint8)}, encoding="dense", zstd=True),
            Malformed,
            "zstd frame",
        ),
    ],
)
def test_lying_header_is_rejected_with_a_clear_error(spec, make, error, match):
    with pytest.raises(error, match=match):
        decode_update(make(spec), spec)


def test_zstd_bomb_is_refused(spec):
    import zstandard

    packed = zstandard.ZstdCompressor().compress(bytes(50_000_000))
    body = lying(spec, {"zstd": torch.frombuffer(bytearray(packed), dtype=torch.uint8)}, encoding="dense", zstd=True)
    assert len(body) < 10_000
    with pytest.raises(TooLarge, match="inflates"):
        decode_update(body, spec)
