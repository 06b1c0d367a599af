"""Hostile uploads and requests, shared by the hostile-input tests, the fuzz test and
bench/fuzz_server.py: each case is a body (or request) a server must refuse with its own 4xx."""

from __future__ import annotations

import json
import struct

import torch

from shoal.update import Update
from shoal.wire import FORMAT, encode, encode_update

FLT_MAX = torch.finfo(torch.float32).max


def header(svc, node: str, **kw) -> dict:
    return {
        "format": FORMAT,
        "kind": "update",
        "spec_hash": svc.spec.hash,
        "encoding": "dense",
        "base_version": svc.version,
        "num_examples": 10,
        "sender": node,
        "metrics": {},
        "round": getattr(svc.rounds, "round", 0),
        **kw,
    }


def raw(table_text: str | bytes, data: bytes = b"") -> bytes:
    """A safetensors body from the header text exactly as given."""
    text = table_text.encode() if isinstance(table_text, str) else table_text
    return struct.pack("<Q", len(text)) + text + data


def dense_raw(svc, hdr: dict | str, entry: dict | None = None, meta: dict | None = None) -> bytes:
    n = svc.spec.numel
    text = hdr if isinstance(hdr, str) else json.dumps(hdr)
    table = {
        "__metadata__": meta if meta is not None else {"shoal": text},
        "delta": entry or {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
    }
    return raw(json.dumps(table), bytes(4 * n))


def good_update(svc, node: str, value: float = 0.01, **extra) -> bytes:
    upd = Update(torch.full((svc.spec.numel,), value), num_examples=10, base_version=svc.version, sender=node)
    return encode_update(upd, svc.spec, {"round": getattr(svc.rounds, "round", 0), **extra})


def update_cases(svc, node: str) -> dict[str, tuple[bytes, int, str]]:
    """name -> (body, HTTP status, error code) for POST /v1/update from ``node``, which holds
    an open task (sync: selected; async: asked for work)."""
    n = svc.spec.numel
    h = header(svc, node)
    deep = "[" * 20_000 + "]" * 20_000
    huge = "9" * 5000
    q8 = encode(
        {"q": torch.full((n,), 127, dtype=torch.int8), "scale": torch.tensor([3e38])},
        {**h, "encoding": "q8", "chunk": n},
    )
    flt_max = encode({"delta": torch.full((n,), FLT_MAX)}, h)
    hole_table = {
        "__metadata__": {"shoal": json.dumps({**h, "encoding": "q8", "chunk": n})},
        "q": {"dtype": "I8", "shape": [n], "data_offsets": [0, n]},
        "scale": {"dtype": "F32", "shape": [1], "data_offsets": [n + 4, n + 8]},
    }
    shoal_text = json.dumps(json.dumps(h))
    return {
        "q8_scale_to_inf": (q8, 400, "non_finite"),
        "flt_max_dense": (flt_max, 400, "out_of_range"),
        "num_examples_1e300": (dense_raw(svc, {**h, "num_examples": 10**300}), 400, "malformed"),
        "num_examples_1e400": (dense_raw(svc, {**h, "num_examples": 10**400}), 400, "malformed"),
        "num_examples_over_limit": (
            dense_raw(svc, {**h, "num_examples": svc.cfg.server.max_examples + 1}),
            400,
            "out_of_range",
        ),
        "nested_shoal_header": (dense_raw(svc, json.dumps(h)[:-1] + f', "x": {deep}}}'), 400, "malformed"),
        "nested_table": (
            raw(f'{{"__metadata__": {{"shoal": {shoal_text}}}, "x": {deep}}}', bytes(4 * n)),
            400,
            "malformed",
        ),
        "int_5000_digits": (
            dense_raw(svc, json.dumps(h).replace('"num_examples": 10', f'"num_examples": {huge}')),
            400,
            "malformed",
        ),
        "offsets_string": (dense_raw(svc, h, {"dtype": "F32", "shape": [n], "data_offsets": "0"}), 400, "malformed"),
        "offsets_floats": (
            dense_raw(svc, h, {"dtype": "F32", "shape": [n], "data_offsets": [0.0, 4.0 * n]}),
            400,
            "malformed",
        ),
        "dtype_list": (
            dense_raw(svc, h, {"dtype": ["F32"], "shape": [n], "data_offsets": [0, 4 * n]}),
            400,
            "malformed",
        ),
        "shape_dict": (
            dense_raw(svc, h, {"dtype": "F32", "shape": {"n": n}, "data_offsets": [0, 4 * n]}),
            400,
            "malformed",
        ),
        "shape_float": (
            dense_raw(svc, h, {"dtype": "F32", "shape": [float(n)], "data_offsets": [0, 4 * n]}),
            400,
            "malformed",
        ),
        "metadata_not_string": (dense_raw(svc, h, meta={"shoal": json.dumps(h), "x": 5}), 400, "malformed"),
        "offsets_with_hole": (raw(json.dumps(hole_table), bytes(n + 8)), 400, "malformed"),
        "metrics_nan": (dense_raw(svc, {**h, "metrics": {"train_loss": float("nan")}}), 400, "malformed"),
        "round_string": (dense_raw(svc, {**h, "round": "1"}), 400, "malformed"),
        "not_utf8": (raw(b'{"\xff": 1}'), 400, "malformed"),
        "empty": (b"", 400, "malformed"),
    }
