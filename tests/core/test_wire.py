import json
import struct

import pytest
import torch

from shoal.errors import Malformed, NonFinite, SpecMismatch, TooLarge
from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.update import Update
from shoal.wire import decode_model, decode_update, encode, encode_model, encode_update


@pytest.fixture
def spec():
    return ParamSpec.of(build_model("logreg", (60,), 10))


def make_update(spec, **kw):
    args = dict(
        delta=torch.randn(spec.numel), num_examples=17, base_version=3, sender="n1", metrics={"train_loss": 0.5}
    )
    args.update(kw)
    return Update(**args)


def test_update_round_trip(spec):
    u = make_update(spec)
    got, header = decode_update(encode_update(u, spec), spec)
    assert torch.equal(got.delta, u.delta)
    assert (got.num_examples, got.base_version, got.sender, got.metrics) == (17, 3, "n1", {"train_loss": 0.5})
    assert header["spec_hash"] == spec.hash


def test_model_round_trip(spec):
    flat = torch.randn(spec.numel)
    got, header = decode_model(encode_model(flat, spec, version=7), spec)
    assert torch.equal(got, flat) and header["version"] == 7


def test_never_pickles(spec):
    body = encode_update(make_update(spec), spec)
    assert b"\x80\x04" not in body[:16]  # not a pickle stream
    (hlen,) = struct.unpack("<Q", body[:8])
    json.loads(body[8 : 8 + hlen])  # safetensors: JSON header + raw bytes


def test_other_architecture_is_a_spec_mismatch(spec):
    other = ParamSpec.of(build_model("logreg", (60,), 62))
    body = encode_update(make_update(other), other)
    with pytest.raises(SpecMismatch, match="spec hash"):
        decode_update(body, spec)


def test_wrong_shape_with_right_hash_is_rejected(spec):
    body = encode(
        {"delta": torch.zeros(spec.numel - 1)},
        {"kind": "update", "spec_hash": spec.hash, "base_version": 0, "num_examples": 1},
    )
    with pytest.raises(SpecMismatch, match="shape"):
        decode_update(body, spec)


def test_wrong_dtype_is_rejected(spec):
    body = encode(
        {"delta": torch.zeros(spec.numel, dtype=torch.float16)},
        {"kind": "update", "spec_hash": spec.hash, "base_version": 0, "num_examples": 1},
    )
    with pytest.raises(SpecMismatch, match="dtype"):
        decode_update(body, spec)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_is_rejected(spec, bad):
    d = torch.zeros(spec.numel)
    d[5] = bad
    with pytest.raises(NonFinite, match="1 NaN/Inf"):
        decode_update(encode_update(make_update(spec, delta=d), spec), spec)


def test_oversized_and_truncated_bodies(spec):
    body = encode_update(make_update(spec), spec)
    with pytest.raises(TooLarge):
        decode_update(body, spec, max_bytes=len(body) - 1)
    for cut in (0, 4, 20, len(body) // 2, len(body) - 1):
        with pytest.raises(Malformed):
            decode_update(body[:cut], spec)


def test_garbage_and_bad_header_fields(spec):
    with pytest.raises(Malformed):
        decode_update(b"\xff" * 64, spec)
    with pytest.raises(Malformed, match="num_examples"):
        decode_update(encode_update(make_update(spec, num_examples=0), spec), spec)
    body = encode(
        {"delta": torch.zeros(spec.numel)},
        {"kind": "update", "spec_hash": spec.hash, "base_version": "x", "num_examples": 1},
    )
    with pytest.raises(Malformed, match="base_version"):
        decode_update(body, spec)
    model_body = encode_model(torch.zeros(spec.numel), spec, 0)
    with pytest.raises(SpecMismatch):
        decode_update(model_body, spec)  # a model is not an update
