"""Hostile bodies the wire decoder must refuse with a typed WireError (never another exception),
and the safetensors table checked exactly as the library checks it, on the zero-copy path too."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load

from shoal.errors import Malformed, NonFinite, OutOfRange, SpecMismatch, WireError
from shoal.models import build_model
from shoal.params import ParamSpec
from shoal.update import Update
from shoal.wire import FORMAT, decode, decode_update, encode, encode_update, read_header


@pytest.fixture(scope="module")
def spec():
    return ParamSpec.of(build_model("logreg", (6,), 3))  # 21 parameters


def header(spec, **kw):
    return {
        "format": FORMAT,
        "kind": "update",
        "spec_hash": spec.hash,
        "encoding": "dense",
        "base_version": 0,
        "num_examples": 5,
        "sender": "n",
        "metrics": {},
        **kw,
    }


def raw(table_text: str | bytes, data: bytes = b"") -> bytes:
    """A safetensors body from the header text as given (no library in between)."""
    text = table_text.encode() if isinstance(table_text, str) else table_text
    return struct.pack("<Q", len(text)) + text + data


def dense_raw(
    spec, hdr: dict | None = None, entry: dict | None = None, meta: dict | None = None, data: bytes | None = None
) -> bytes:
    n = spec.numel
    table = {
        "__metadata__": meta if meta is not None else {"shoal": json.dumps(hdr or header(spec))},
        "delta": entry or {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
    }
    return raw(json.dumps(table), bytes(4 * n) if data is None else data)


def both_paths(body: bytes, spec, **kw):
    """decode_update on bytes (library load) and on a bytearray (zero-copy views): same verdict."""
    out = []
    for b, copy in ((bytes(body), True), (bytearray(body), False)):
        try:
            out.append(("ok", decode_update(b, spec, copy=copy, **kw)[0]))
        except WireError as e:
            out.append((type(e), str(e)))
    assert [o[0] for o in out][0] == out[1][0], out
    return out[0]


def test_q8_scale_that_decodes_to_inf_is_refused(spec):
    """Every field finite (scale 3e38, codes 127), the decoded delta +Inf: refused."""
    q = torch.full((spec.numel,), 127, dtype=torch.int8)
    body = encode({"q": q, "scale": torch.tensor([3e38])}, {**header(spec, encoding="q8", chunk=spec.numel)})
    kind, why = both_paths(body, spec)
    assert kind is NonFinite and "Inf" in why


def test_largest_finite_dense_delta_needs_the_bound(spec):
    big = torch.full((spec.numel,), torch.finfo(torch.float32).max)
    body = encode_update(Update(big, 5, 0, "n"), spec)
    assert both_paths(body, spec)[0] == "ok"  # finite: only a bound refuses it
    kind, why = both_paths(body, spec, max_abs=1e4)
    assert kind is OutOfRange and "max_delta_abs" in why
    small = encode_update(Update(torch.full((spec.numel,), 0.5), 5, 0, "n"), spec)
    assert both_paths(small, spec, max_abs=1e4)[0] == "ok"


@pytest.mark.parametrize(
    "n, err",
    [
        (10**6 + 1, OutOfRange),
        (10**18, OutOfRange),
        (10**300, Malformed),
        (10**400, Malformed),
        (0, Malformed),
        (-3, Malformed),
        (2.5, Malformed),
        (True, Malformed),
        ("7", Malformed),
        (None, Malformed),
    ],
)
def test_num_examples_is_bounded(spec, n, err):
    text = json.dumps(header(spec, num_examples=n))
    body = dense_raw(spec, meta={"shoal": text})
    assert both_paths(body, spec, max_examples=10**6)[0] is err
    ok = dense_raw(spec, hdr=header(spec, num_examples=10**6))
    assert both_paths(ok, spec, max_examples=10**6)[0] == "ok"


def test_integers_of_thousands_of_digits_are_malformed_not_a_crash(spec):
    huge = "9" * 5000
    text = json.dumps(header(spec)).replace('"base_version": 0', f'"base_version": {huge}')
    assert both_paths(dense_raw(spec, meta={"shoal": text}), spec)[0] is Malformed
    n = spec.numel
    table = (
        f'{{"__metadata__": {{"shoal": {json.dumps(json.dumps(header(spec)))}}}, '
        f'"delta": {{"dtype": "F32", "shape": [{huge}], "data_offsets": [0, {4 * n}]}}}}'
    )
    kind, why = both_paths(raw(table, bytes(4 * n)), spec)
    assert kind is Malformed and "digits" in why


@pytest.mark.parametrize("where", ["shoal", "table", "metrics"])
def test_deeply_nested_json_is_malformed(spec, where):
    deep = "[" * 50_000 + "]" * 50_000
    n = spec.numel
    if where == "shoal":
        body = dense_raw(spec, meta={"shoal": json.dumps(header(spec))[:-1] + f', "x": {deep}}}'})
    elif where == "table":
        body = raw(
            f'{{"__metadata__": {{"shoal": {json.dumps(json.dumps(header(spec)))}}}, "x": {deep}}}', bytes(4 * n)
        )
    else:  # shallow enough for Python's parser, deeper than the wire allows
        body = dense_raw(
            spec, meta={"shoal": json.dumps(header(spec, metrics={"a": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}))}
        )
    kind, why = both_paths(body, spec)
    assert kind is Malformed and "nested" in why


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [21], "data_offsets": "0,84"},
        {"dtype": "F32", "shape": [21], "data_offsets": [0]},
        {"dtype": "F32", "shape": [21], "data_offsets": [0, 84.0]},
        {"dtype": "F32", "shape": [21], "data_offsets": [0, True]},
        {"dtype": "F32", "shape": [21], "data_offsets": [-4, 80]},
        {"dtype": "F32", "shape": [21], "data_offsets": {"a": 0}},
        {"dtype": ["F32"], "shape": [21], "data_offsets": [0, 84]},
        {"dtype": 4, "shape": [21], "data_offsets": [0, 84]},
        {"dtype": "F128", "shape": [21], "data_offsets": [0, 84]},
        {"dtype": "F32", "shape": [21.0], "data_offsets": [0, 84]},
        {"dtype": "F32", "shape": 21, "data_offsets": [0, 84]},
        {"dtype": "F32", "shape": [21, None], "data_offsets": [0, 84]},
        {"dtype": "F32", "shape": [-21], "data_offsets": [0, 84]},
        {"dtype": "F32", "shape": [20], "data_offsets": [0, 84]},  # bytes do not match dtype x shape
        {"dtype": "F32", "shape": [21], "data_offsets": [0, 84], "extra": 1},
    ],
)
def test_wrong_json_types_in_the_tensor_table_are_malformed(spec, entry):
    assert spec.numel == 21
    kind, why = both_paths(dense_raw(spec, entry=entry), spec)
    assert kind is Malformed, why


@pytest.mark.parametrize(
    "meta",
    [
        {"shoal": json.dumps({"format": FORMAT}), "x": 1},
        {"shoal": {"format": FORMAT}},
        {"shoal": json.dumps({"format": FORMAT}), "x": None},
        ["shoal"],
        "shoal",
        {},
    ],
)
def test_metadata_values_must_be_strings(spec, meta):
    kind, _ = both_paths(dense_raw(spec, meta=meta), spec)
    assert kind is Malformed


def test_duplicate_keys_and_non_utf8_headers_are_malformed(spec):
    n = spec.numel
    h = json.dumps(json.dumps(header(spec)))
    dup = (
        f'{{"__metadata__": {{"shoal": {h}}}, "delta": {{"dtype": "F32", "shape": [{n}], '
        f'"data_offsets": [0, {4 * n}], "dtype": "I32"}}}}'
    )
    assert both_paths(raw(dup, bytes(4 * n)), spec)[0] is Malformed
    text = json.dumps(
        {
            "__metadata__": {"shoal": json.dumps(header(spec))},
            "delta": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
        }
    ).encode()
    latin = text.replace(b'"delta"', b'"d\xe9lta"')  # a Latin-1 byte, not UTF-8
    kind, why = both_paths(raw(latin, bytes(4 * n)), spec)
    assert kind is Malformed and "UTF-8" in why


def test_two_tensor_table_with_a_hole_or_overlap_is_malformed_on_the_zero_copy_path(spec):
    """q8's two tensors: offsets that leave a hole or overlap are refused, as the library refuses them."""
    n = spec.numel
    good = {
        "q": {"dtype": "I8", "shape": [n], "data_offsets": [0, n]},
        "scale": {"dtype": "F32", "shape": [1], "data_offsets": [n, n + 4]},
    }
    hdr = json.dumps(header(spec, encoding="q8", chunk=n))
    data = bytes(n) + struct.pack("<f", 0.1)

    def body(table, data=data):
        return raw(json.dumps({"__metadata__": {"shoal": hdr}, **table}), data)

    assert both_paths(body(good), spec)[0] == "ok"
    st_load(body(good))  # the library agrees
    hole = {"q": good["q"], "scale": {"dtype": "F32", "shape": [1], "data_offsets": [n + 4, n + 8]}}
    overlap = {"q": good["q"], "scale": {"dtype": "F32", "shape": [1], "data_offsets": [n - 4, n]}}
    for table, d in ((hole, data + bytes(4)), (overlap, data[:-4])):
        kind, why = both_paths(body(table, d), spec)
        assert kind is Malformed and "contiguous" in why
        with pytest.raises(Exception):  # noqa: B017 - the safetensors library refuses it, with its own error type
            st_load(body(table, d))


@pytest.mark.parametrize(
    "hdr",
    [
        {"metrics": {"loss": float("nan")}},
        {"metrics": {"loss": float("inf")}},
        {"metrics": {"loss": True}},
        {"metrics": {"loss": "0.5"}},
        {"metrics": [1]},
        {"metrics": {f"m{i}": 1.0 for i in range(65)}},
        {"sender": 5},
        {"sender": "x" * 300},
        {"round": "3"},
        {"round": -1},
        {"round": 1.5},
        {"spec_hash": 7},
        {"zstd": "yes"},
        {"encoding": ["dense"]},
        {"encoding": "q4"},
        {"kind": "model"},
        {"format": "shoal/0"},
        {"aux": "scaffold/dc"},
        {"aux": ["scaffold/c"]},
        {"aux": ["scaffold/dc", "scaffold/dc"]},
        {"aux": ["scaffold/dc"]},  # named, but no such tensor in the body
        {"aux": [{"scaffold/dc": 1}]},
    ],
)
def test_every_header_field_is_type_checked(spec, hdr):
    body = dense_raw(spec, meta={"shoal": json.dumps({**header(spec), **hdr})})
    kind, why = both_paths(body, spec)
    assert kind in (Malformed, SpecMismatch), why
    assert len(why) < 400  # a megabyte sent is not a megabyte quoted back


# --- the table check agrees with the safetensors library ------------------------------

_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "I8", "U8", "F16", "I64"]),
        "shape": st.lists(st.integers(0, 6), max_size=3),
        "data_offsets": st.lists(st.integers(0, 300), min_size=2, max_size=2),
    }
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["a", "b", "c"]), _entry, max_size=3), st.integers(0, 300), st.booleans())
def test_read_header_accepts_only_what_the_library_accepts(table, data_len, snap):
    """Random tables, often lying: whatever read_header accepts, safetensors loads; and a
    table whose offsets are the honest contiguous ones is accepted by both."""
    if snap:  # make the offsets honest, so acceptance is exercised too
        pos = 0
        sizes = {"F32": 4, "I8": 1, "U8": 1, "F16": 2, "I64": 8}
        for name in sorted(table):
            e = table[name]
            nb = sizes[e["dtype"]]
            for d in e["shape"]:
                nb *= d
            e["data_offsets"] = [pos, pos + nb]
            pos += nb
        data_len = pos
    body = raw(json.dumps({"__metadata__": {"shoal": json.dumps({"format": FORMAT})}, **table}), bytes(data_len))
    try:
        read_header(body, 1 << 20)
        ours = True
    except Malformed:
        ours = False
    try:
        st_load(body)
        lib = True
    except Exception:
        lib = False
    assert ours == lib, (table, data_len)
    if ours:  # and the zero-copy views read the same bytes the library does
        expect = {k: (t.dtype, tuple(t.shape)) for k, t in st_load(body).items()}
        _, views = decode(bytearray(body), expect, 1 << 20, copy=False)
        assert set(views) == set(expect)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_never_escape_as_anything_but_a_wire_error(blob):
    sp = ParamSpec.of(build_model("logreg", (6,), 3))
    for body in (blob, struct.pack("<Q", len(blob)) + blob, struct.pack("<Q", max(len(blob) - 3, 0)) + blob):
        try:
            decode_update(bytearray(body), sp, copy=False)
        except WireError:
            pass


@pytest.mark.parametrize("zstd", [0, 3])
def test_an_updates_aux_tensor_round_trips_and_a_nan_in_it_is_refused(spec, zstd):
    n = spec.numel
    dc = torch.linspace(-1, 1, n)
    body = encode_update(Update(torch.ones(n), 5, to_server={"scaffold/dc": dc}), spec, zstd_level=zstd)
    kind, got = both_paths(body, spec)
    assert kind == "ok" and torch.equal(got.to_server["scaffold/dc"], dc) and torch.equal(got.delta, torch.ones(n))
    dc[3] = float("nan")
    body = encode_update(Update(torch.ones(n), 5, to_server={"scaffold/dc": dc}), spec, zstd_level=zstd)
    kind, why = both_paths(body, spec)
    assert kind is NonFinite and "scaffold/dc" in why, why
    body = encode(  # a tensor the header does not name
        {"delta": torch.ones(n), "scaffold/dc": torch.ones(n)}, {**header(spec), "kind": "update"}
    )
    assert both_paths(body, spec)[0] is SpecMismatch
