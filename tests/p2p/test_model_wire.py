"""Gossip model messages: dense / q8 / zstd round trips, sizes, and what is refused."""

from __future__ import annotations

import pytest
import torch

from shoal.aggregation.compression import quantize_q8
from shoal.config import CompressionConfig, load_config
from shoal.errors import ConfigError, Malformed, NonFinite, WireError
from shoal.p2p.model_wire import decode_gossip_model, encode_gossip_model
from shoal.params import ParamSpec
from shoal.wire import encode

SPEC = ParamSpec.of(torch.nn.Linear(100, 50))
EXTRA = {"age": 2, "num_examples": 5, "sender": "peer-a"}
LIMIT = 10 * SPEC.nbytes


def _model(seed=0):
    return torch.randn(SPEC.numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "cc, ratio",
    [
        (CompressionConfig(), 1.0),
        (CompressionConfig("dense", zstd=True), 1.0),
        (CompressionConfig("q8"), 0.3),
        (CompressionConfig("q8", zstd=True), 0.3),
        (CompressionConfig("float16"), 0.5),
        (CompressionConfig("bfloat16"), 0.5),
    ],
)
def test_round_trip_and_size(cc, ratio):
    x = _model()
    body = encode_gossip_model(x, SPEC, 4, EXTRA, cc, seed=1)
    y, header = decode_gossip_model(body, SPEC, LIMIT)
    assert header["age"] == 2 and header["version"] == 4 and header["sender"] == "peer-a"
    assert len(body) <= ratio * SPEC.nbytes + 4096
    if cc.encoding == "dense":
        assert torch.equal(x, y)
    elif cc.encoding in ("float16", "bfloat16"):  # rounded to nearest: relative error 2^-11 or 2^-8
        rel = 2.0**-11 if cc.encoding == "float16" else 2.0**-8
        assert torch.allclose(x, y, rtol=rel, atol=1e-7) and y.dtype == torch.float32
    else:  # q8: within one quantization step of each coordinate
        step = x.abs().max() / 127
        assert float((x - y).abs().max()) <= float(step) + 1e-6


def test_q8_model_is_unbiased_over_draws():
    x = _model(3)
    mean = torch.stack(
        [
            decode_gossip_model(encode_gossip_model(x, SPEC, 0, EXTRA, CompressionConfig("q8"), seed=s), SPEC, LIMIT)[0]
            for s in range(200)
        ]
    ).mean(0)
    single = decode_gossip_model(encode_gossip_model(x, SPEC, 0, EXTRA, CompressionConfig("q8"), seed=0), SPEC, LIMIT)[
        0
    ]
    assert float((mean - x).abs().mean()) < 0.25 * float((single - x).abs().mean())


def test_nan_model_and_lying_headers_are_rejected():
    nan = _model()
    nan[7] = float("nan")
    with pytest.raises(NonFinite):
        decode_gossip_model(encode_gossip_model(nan, SPEC, 0, EXTRA), SPEC, LIMIT)
    q, scale = quantize_q8(_model(), 64)
    base = {"kind": "model", "spec_hash": SPEC.hash, "version": 0, "encoding": "q8", **EXTRA}
    with pytest.raises(WireError):  # wrong chunk: the scale tensor has the wrong length
        decode_gossip_model(encode({"q": q, "scale": scale}, {**base, "chunk": 128}), SPEC, LIMIT)
    with pytest.raises(Malformed):  # a negative scale
        decode_gossip_model(encode({"q": q, "scale": -scale}, {**base, "chunk": 64}), SPEC, LIMIT)
    with pytest.raises(Malformed):  # top-k is not a gossip model encoding
        decode_gossip_model(
            encode(
                {"indices": torch.arange(3, dtype=torch.int32), "values": torch.ones(3)},
                {**base, "encoding": "topk", "k": 3},
            ),
            SPEC,
            LIMIT,
        )


def test_config_refuses_topk_and_buffered_rules_for_push_pull():
    with pytest.raises(ConfigError, match="topk"):
        load_config(None, ['simulation.mode="gossip"', 'compression.encoding="topk"'])
    with pytest.raises(ConfigError, match="norm_bound"):
        load_config(None, ['simulation.mode="gossip"', 'robust.rule="median"'])
    load_config(None, ['simulation.mode="gossip"', 'robust.rule="median"', 'gossip.algorithm="dpsgd"'])
    load_config(None, ['simulation.mode="gossip"', "robust.norm_bound=1.0", 'compression.encoding="q8"'])
