"""A fuzzer for a live aggregator over TLS, shared by tests/server/test_fuzz.py (six
hundred requests per mode) and bench/fuzz_server.py (ten thousand).

Hypothesis draws hostile requests: update bodies built field by field with every header field
and table entry either right or replaced by any JSON value, lying offsets, special floats
(NaN, Inf, FLT_MAX, a q8 scale of 3e38), bit flips and truncations of a good body, JSON
bombs; edge partials (POST /v1/partial, from the one fuzzing node named an edge and from
others); secure aggregation messages with small-order, copied or random keys; strict-looking
query strings; tokens of unselected nodes, of the admin, garbage and non-UTF-8 bytes. Each
request goes over its own TLS connection as raw bytes, and its answer is checked:

- never a 5xx; every error answer JSON with ``error`` and ``detail`` (aiohttp's own HTTP
  parser may answer a plain-text 400 for bytes that are not HTTP);
- an **oracle** written independently of shoal.wire (the safetensors library plus the
  protocol's field rules, docs/protocol.md) says whether an update body is well-formed; a
  malformed one must be refused as malformed (400/413) before any protocol check: a 200 or
  409 for it counts as *malformed accepted*; a well-formed one refused 400 counts as
  *well-formed refused* (the two must agree exactly);
- model bytes, version, checkpoints and counters are unchanged after every request (the
  fuzzing nodes hold no task, so even a well-formed update must be refused by the protocol).

Afterwards a legitimate round must still complete (see ``legit_round``).

``edge_secure`` mode fuzzes a root whose two edges (f0, f1) relay a secure round for their nodes
(server/edge/secure.py, docs/hierarchy.md "Secure aggregation through edges"), opened over real
HTTP and left at its masked stage: f0's masked sum of its nodes is in, the direct nodes' masked
inputs are awaited. Most requests go to the root's relay routes ``/v1/edge/secagg/{stage}``: from
the wrong edge, from nodes and strangers, for another edge's node or names that are no node,
masked sums naming anyone (repeated, outside the round, with vectors of any length and dtype,
NaN rounds), f0's own sum again (the one 200 allowed: a ``duplicate``), unmasking answers sealed
to the wrong key or session or not at all, and Content-Lengths over the limit. Its state also
holds the protocol's (what each stage took, the masked sums taken, the running masked total),
the nodes the root saw and who speaks for whom in the round; afterwards the fuzzed round itself
completes and moves the model by its nodes' weighted mean.

A failing batch is reported as it is, not shrunk: replayed against the live server (whose state
moved on) it is not the same test, and shrinking resends batches for many minutes.

``federation`` mode fuzzes a federation server (server/federation/runs.py) hosting one sync run: the
node protocol under ``/runs/run-1`` (and under runs that do not exist), and the federation's own
routes: offers, a node's answer to a run, and the runs routes of `shoal run` with malformed
submissions, stops of runs that do not exist, lookups of junk ids and files. Its state also
counts the runs table and the nodes' answers: no hostile request may add, stop or answer a run.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re
import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from hypothesis import strategies as st
from safetensors.torch import load as st_load

from shoal.tls import client_context, make_private_ca, server_context

from ..hierarchy.test_secure_root_http import Relayed  # a node whose edge relays its messages
from .federation_live import served_federation
from .live import live_server
from .test_secure_rounds import Party

FORMAT = "shoal/1"
FLT_MAX = float(np.finfo(np.float32).max)
SMALL_ORDER = [
    bytes(32),
    (1).to_bytes(32, "little"),
    ((2**255 - 19) - 1).to_bytes(32, "little"),
    bytes.fromhex("e0eb7a7c3b41b8ae1656e3faf19fc46ada098deb9c32b1fd866205165f49b800"),
]
LEGIT = ["n0", "n1", "n2", "n3"]
FUZZERS = ["f0", "f1"]
MODES = ("sync", "async", "secure", "federation", "edge_secure")
HUNG_UP = -1  # the status of a request the server hung up on mid-body, its answer lost to the reset
# edge_secure: f0 and f1 are the root's edges; f0 speaks for e0 and e1 (its masked sum of them is in),
# f1 for e2 (its task failed before it advertised keys: it is outside the round's U2)
EDGE_OF = {"e0": "f0", "e1": "f0", "e2": "f1"}
RUN = "run-1"  # the federation's one run
RUN_CONFIG = {  # the run the federation mode hosts: the same model and rounds as sync mode's
    "simulation": {"seed": 1, "num_clients": 5},
    "data": {"dataset": "synthetic"},
    "model": {"name": "logreg"},
    "train": {"batch_size": 10, "lr": 0.05},
    "server": {"rounds": 5, "eval": False, "deadline_s": 600.0, "poll_s": 2.0, "clients_per_round": 2, "min_nodes": 2},
}


def prefix(mode: str) -> str:
    """Where the node protocol lives: a one-run server's root, or the federation's run."""
    return f"/runs/{RUN}" if mode == "federation" else ""


def mode_config(mode: str) -> tuple[dict, dict]:
    """(server keys, other sections) of the server each mode fuzzes."""
    server = {"deadline_s": 600.0, "poll_s": 2.0, "body_timeout_s": 2.0, "rounds": 5, "uploads_per_node": 4}
    edge = {"hierarchy": {"edge_names": ["f0"]}}  # f0 may POST /v1/partial (server/edge/intake.py)
    if mode == "sync":
        return {**server, "clients_per_round": 2, "min_nodes": 2}, edge
    if mode == "federation":
        return {k: v for k, v in server.items() if k in ("body_timeout_s", "uploads_per_node")}, {}
    if mode == "async":
        return {**server, "mode": "async"}, {"asynchronous": {"algorithm": "fedbuff", "buffer_size": 2}, **edge}
    if mode == "edge_secure":  # a round of LEGIT and EDGE_OF's nodes, at its masked stage (prepare)
        sections = {"hierarchy": {"edge_names": FUZZERS}, "secure_aggregation": {"enabled": True, "stage_s": 600.0}}
        return {**server, "min_nodes": 7, "clients_per_round": 7}, sections
    # no edge here: f0 must be selected as a node, and an edge is never counted as one
    return {**server, "min_nodes": 6}, {"secure_aggregation": {"enabled": True, "stage_s": 600.0}}


# --- the server, in a thread of its own ------------------------------------------------


class ServerThread:
    """live_server over TLS in a background event loop; the fuzzer sends raw bytes to it."""

    def __init__(self, tmp: Path, mode: str):
        self.tmp, self.mode = tmp, mode
        self.pki = make_private_ca(tmp / "pki")
        self.client_ssl = client_context(self.pki.ca_cert)
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> ServerThread:
        self.thread.start()
        if not self.ready.wait(60):
            raise RuntimeError(f"fuzz server did not start: {self.error!r}")
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported by __enter__
            self.error = e
            self.ready.set()
        finally:
            self.loop.close()

    async def _main(self) -> None:
        server, sections = mode_config(self.mode)
        ctx = server_context(self.pki.cert, self.pki.key)
        if self.mode == "federation":
            async with served_federation(self.tmp, LEGIT + FUZZERS, RUN_CONFIG, ssl_context=ctx, **server) as live:
                self.live, self.fed = live, live.fed
                self.svc = live.fed.active[RUN]
                self.port = int(live.url.rsplit(":", 1)[1])
                self._stop = asyncio.Event()
                self.ready.set()
                await self._stop.wait()
            return
        self.fed = None
        nodes = LEGIT + FUZZERS + (sorted(EDGE_OF) if self.mode == "edge_secure" else [])
        async with live_server(self.tmp, nodes, ssl_context=ctx, sections=sections, **server) as live:
            self.live, self.svc = live, live.service
            self.port = int(live.url.rsplit(":", 1)[1])
            self._stop = asyncio.Event()
            self.ready.set()
            await self._stop.wait()

    def call(self, fn, timeout: float = 60):
        """``fn()`` run in the server's loop (state is read and changed there only)."""

        async def wrap():
            out = fn()
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(wrap(), self.loop).result(timeout)

    def send(self, raw: bytes, timeout: float = 20) -> tuple[int, dict, bytes]:
        """One request as raw bytes over a fresh TLS connection: (status, headers, body)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            with self.client_ssl.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
                cut = False
                try:
                    tls.sendall(raw)
                except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                    cut = True  # the server answered before the whole body came (a 401, 403 or 413) and hung up
                chunks = []
                while True:
                    try:
                        b = tls.recv(65536)
                    except (ssl.SSLError, ConnectionResetError):
                        break
                    if not b:
                        break
                    chunks.append(b)
        data = b"".join(chunks)
        if cut and not data:  # its answer was lost to the reset of a socket closed with our bytes unread
            return HUNG_UP, {}, b""
        while data.startswith(b"HTTP/1.1 100"):  # an interim 100 Continue before the answer
            data = data.split(b"\r\n\r\n", 1)[1]
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1]) if lines and lines[0].startswith(b"HTTP/") else 0
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        return status, headers, body


# --- what the fuzzer sends -------------------------------------------------------------

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**300, -1, 0, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_value = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8
)
FILLS = [0.0, 0.01, -0.5, 3.0, float("nan"), float("inf"), -float("inf"), FLT_MAX, 3e38, 1e5, 1e-40]
DTYPE_SIZE = {"F32": 4, "I8": 1, "I32": 4, "F16": 2, "I64": 8, "U8": 1}
NP_DTYPE = {"F32": "<f4", "I8": "i1", "I32": "<i4", "F16": "<f2", "I64": "<i8", "U8": "u1"}


@dataclass
class Ctx:
    """What the fuzzer knows of the server: spec, limits, round."""

    numel: int
    spec_hash: str
    version: int
    round: int
    max_examples: int
    max_delta_abs: float
    max_body: int
    tokens: dict[str, str]
    secure: dict | None = None  # the open secure round's task info (secure mode)
    edge: EdgeFixture | None = None  # edge_secure mode


@dataclass
class EdgeFixture:
    """edge_secure mode: the round the fuzzer hits at its masked stage, and what its nodes sent (the
    fuzzer replays it); the LEGIT nodes' masked inputs go in only after the fuzzing."""

    parties: dict  # node -> Party (EDGE_OF's: relayed by their edge)
    masked: dict[str, bytes]  # each node's MaskedInput message
    sum_body: bytes  # f0's MaskedSum of e0 and e1, taken by the root
    root_key: bytes  # the round's root key (its public part), which unmasking answers are sealed to
    session: bytes
    vector_size: int
    limit: int  # the relay routes' body limit
    before: torch.Tensor  # the model before the round


def _field(draw, good):
    """Right most of the time; else missing, or any JSON value."""
    how = draw(st.sampled_from(["good"] * 6 + ["missing", "json", "special"]))
    if how == "good":
        return good
    if how == "missing":
        return _MISSING
    if how == "special":
        return draw(st.sampled_from([10**300, 10**25, -1, 0, 1.5, True, "1", [1], {"a": 1}, None, float("nan")]))
    return draw(json_value)


_MISSING = object()


@st.composite
def tensor_data(draw, dtype: str, count: int) -> bytes:
    """``count`` values of ``dtype``: one fill value with a few special positions."""
    if dtype in ("F32", "F16"):
        arr = np.full(count, draw(st.sampled_from(FILLS)), dtype=np.float64)
        for _ in range(draw(st.integers(0, 3))):
            if count:
                arr[draw(st.integers(0, count - 1))] = draw(st.sampled_from(FILLS))
        with np.errstate(over="ignore"):
            return arr.astype(NP_DTYPE[dtype]).tobytes()
    lo, hi = {"I8": (-128, 127), "U8": (0, 255), "I32": (-(2**31), 2**31 - 1), "I64": (-(2**40), 2**40)}[dtype]
    if draw(st.booleans()):  # sorted distinct, as top-k indices are
        start = draw(st.integers(-2, 3))
        arr = np.arange(start, start + count * draw(st.integers(1, 3)), max(1, draw(st.integers(1, 3))))[:count]
        arr = np.resize(arr, count)
    else:
        arr = np.full(count, draw(st.integers(lo, hi)), dtype=np.int64)
        for _ in range(draw(st.integers(0, 3))):
            if count:
                arr[draw(st.integers(0, count - 1))] = draw(st.integers(lo, hi))
    return np.clip(arr, lo, hi).astype(NP_DTYPE[dtype]).tobytes()


@st.composite
def update_body(draw, ctx: Ctx, sender: str) -> bytes:
    n = ctx.numel
    encoding = draw(st.sampled_from(["dense"] * 3 + ["q8", "topk", "zz"]))
    chunk = draw(st.sampled_from([n, max(1, n // 3), 7, 0, -1, 2**30]))
    k = draw(st.sampled_from([1, 5, max(1, n // 2), n, 0]))
    h = {
        "format": FORMAT,
        "kind": "update",
        "spec_hash": ctx.spec_hash,
        "encoding": encoding,
        "base_version": ctx.version,
        "num_examples": draw(st.sampled_from([10, 1, ctx.max_examples, ctx.max_examples + 1])),
        "sender": sender,
        "metrics": {"train_loss": 0.5},
        "round": ctx.round,
    }
    if encoding == "q8":
        h["chunk"] = chunk
    if encoding == "topk":
        h["k"] = k
    header = {}
    for key, good in h.items():
        v = _field(draw, good)
        if v is not _MISSING:
            header[key] = v
    if draw(st.integers(0, 9)) == 0:
        header[draw(st.text(max_size=6))] = draw(json_value)
    if encoding == "q8" and isinstance(chunk, int) and chunk > 0:
        tensors = {"q": ("I8", [n]), "scale": ("F32", [math.ceil(n / chunk)])}
    elif encoding == "topk":
        tensors = {"indices": ("I32", [k]), "values": ("F32", [k])}
    else:
        tensors = {"delta": ("F32", [n])}
    if draw(st.integers(0, 5)) == 0:  # a wrong dtype, shape or name
        name = draw(st.sampled_from(sorted(tensors)))
        dtype, shape = tensors.pop(name)
        tensors[draw(st.sampled_from([name, name, "x"]))] = (
            draw(st.sampled_from([dtype, "F16", "I64", "U8"])),
            draw(st.sampled_from([shape, [shape[0] + 1], [0], []])),
        )
    table: dict = {}
    data = b""
    for name, (dtype, shape) in sorted(tensors.items()):
        count = int(np.prod(shape)) if shape else 1
        blob = draw(tensor_data(dtype, count))
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    lie = draw(st.sampled_from(["none"] * 8 + ["offsets", "entry", "hole", "metadata"]))
    if lie == "offsets" and table:
        e = table[draw(st.sampled_from(sorted(table)))]
        e["data_offsets"] = draw(
            st.one_of(json_value, st.lists(st.integers(-4, len(data) + 8), min_size=2, max_size=2))
        )
    elif lie == "entry" and table:
        e = table[draw(st.sampled_from(sorted(table)))]
        e[draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(json_value)
    elif lie == "hole" and table:
        name = sorted(table)[-1]
        start, end = table[name]["data_offsets"]
        table[name]["data_offsets"] = [start + 4, end + 4]
        data += bytes(4)
    meta = {"shoal": json.dumps(header)}
    if lie == "metadata":
        meta[draw(st.text(max_size=4))] = draw(json_value)
    text = json.dumps({"__metadata__": meta, **table})
    body = struct.pack("<Q", len(text.encode())) + text.encode() + data
    return draw(mutate(body))


@st.composite
def partial_body(draw, ctx: Ctx) -> bytes:
    """An edge aggregator's partial (POST /v1/partial, docs/hierarchy.md), often hostile; no edge ever
    holds its nodes (edge_poll_body claims none), so even a well-formed partial must be refused."""
    n = ctx.numel
    bits = draw(st.sampled_from([0] * 4 + [16, 62, 63]))
    names = st.sampled_from([*FUZZERS, *LEGIT, "x", "", "n9"])  # LEGIT: selected, but no edge claimed them
    h = {
        "format": FORMAT,
        "kind": "partial",
        "spec_hash": ctx.spec_hash,
        "round": ctx.round,
        "version": ctx.version,
        "total_weight": draw(st.sampled_from([10.0, 0.0, 1e300])),
        "senders": draw(st.lists(names, max_size=3)),
        "num_examples": 10,
        "loss_sum": 1.0,
        "weighting": "examples",
        "edges": ["f0"],
        "origin": draw(st.sampled_from(["f0", "n0", ""])),
        "staleness": 0,
        "modulus_bits": bits,
        "noise_shares": 0,
    }
    header = {}
    for key, good in h.items():
        v = _field(draw, good)
        if v is not _MISSING:
            header[key] = v
    dtype = draw(st.sampled_from(["I64" if bits else "F32"] * 3 + ["F16", "I8"]))
    shape = draw(st.sampled_from([[n]] * 3 + [[n + 1], [0], []]))
    count = int(np.prod(shape)) if shape else 1
    blob = draw(tensor_data(dtype, count))
    table = {
        draw(st.sampled_from(["sum"] * 5 + ["delta"])): {"dtype": dtype, "shape": shape, "data_offsets": [0, len(blob)]}
    }
    text = json.dumps({"__metadata__": {"shoal": json.dumps(header)}, **table})
    return draw(mutate(struct.pack("<Q", len(text.encode())) + text.encode() + blob))


@st.composite
def mutate(draw, body: bytes) -> bytes:
    how = draw(st.sampled_from(["none"] * 12 + ["flip", "truncate", "extend", "bomb", "digits", "random"]))
    if how == "flip" and body:
        b = bytearray(body)
        for _ in range(draw(st.integers(1, 4))):
            b[draw(st.integers(0, len(b) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(b)
    if how == "truncate":
        return body[: draw(st.integers(0, len(body)))]
    if how == "extend":
        return body + draw(st.binary(min_size=1, max_size=16))
    if how == "bomb":
        text = "[" * 30_000 + "]" * 30_000
        return struct.pack("<Q", len(text)) + text.encode()
    if how == "digits":
        text = json.dumps({"__metadata__": {"shoal": '{"format": "shoal/1", "num_examples": ' + "9" * 5000 + "}"}})
        return struct.pack("<Q", len(text)) + text.encode()
    if how == "random":
        return draw(st.binary(max_size=300))
    return body


@st.composite
def keys_body(draw, ctx: Ctx, sender: str) -> bytes:
    """A secure aggregation ``public_keys`` message, often hostile."""

    def key():
        return draw(
            st.one_of(
                st.just(X25519PrivateKey.generate().public_key().public_bytes_raw()),
                st.sampled_from(SMALL_ORDER),
                st.binary(min_size=31, max_size=33),
            )
        )

    import base64

    enc, mask = key(), key()
    if draw(st.integers(0, 4)) == 0:
        mask = enc
    h = {
        "format": FORMAT,
        "kind": "public_keys",
        "sender": sender,
        "enc_key": base64.b64encode(enc).decode(),
        "mask_key": base64.b64encode(mask).decode(),
        "meta": {"round": ctx.round, "num_examples": 10, "train_loss": 0.5},
    }
    header = {}
    for key_, good in h.items():
        v = _field(draw, good)
        if v is not _MISSING:
            header[key_] = v
    text = json.dumps({"__metadata__": {"shoal": json.dumps(header)}})
    return draw(mutate(struct.pack("<Q", len(text)) + text.encode()))


QUERY_WAIT = st.one_of(
    st.sampled_from(
        [
            "0",
            "0.01",
            "0.0",
            "nan",
            "NaN",
            "inf",
            "-1",
            "1e400",
            "1e3",
            "abc",
            "",
            "0x1",
            "1_0",
            "9" * 40,
            "%00",
            "0.01.2",
        ]
    ),
    st.text(alphabet="0123456789.-+eEnaif_x", max_size=12),
)
QUERY_ROUND = st.one_of(
    st.sampled_from(["1", "0", "-1", "x", "1_0", "9" * 30, "", "1.0"]), st.integers(-3, 10).map(str)
)


@st.composite
def edge_poll_body(draw) -> bytes:
    """An edge's poll (POST /v1/edge/poll): near-valid and broken rosters, never naming an enrolled
    node, so a taken poll claims nothing."""
    name = st.one_of(
        st.sampled_from(["x", "n9", "f0", "", "a" * 300, "edge"]), st.integers(), st.none(), st.text(max_size=4)
    )
    kind = draw(st.sampled_from(["good", "good", "extra", "not_list", "duplicate", "raw"]))
    nodes = draw(st.lists(name, max_size=5))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    obj: object = {"nodes": nodes}
    if kind == "extra":
        obj = {"nodes": nodes, draw(st.text(max_size=6)): 1}
    elif kind == "not_list":
        obj = {"nodes": draw(st.sampled_from(["n0", 5, None, {"n0": 1}]))}
    elif kind == "duplicate":
        obj = {"nodes": ["x", "x"]}
    text = json.dumps(obj).encode()
    return bytes(draw(mutate(text)))


@st.composite
def failure_body(draw) -> bytes:
    """Near-valid and broken failure reports: {"round", "version", "reason"} with wrong types,
    extra or missing fields, other reasons, or not JSON at all."""
    reason = draw(st.sampled_from(["diverged", "refused", "failed"]))
    good = {"round": draw(st.integers(-2, 5)), "version": draw(st.integers(-2, 5)), "reason": reason}
    value = st.one_of(st.integers(-(2**63), 2**63), st.floats(), st.text(max_size=8), st.booleans(), st.none())
    kind = draw(st.sampled_from(["good", "field", "extra", "missing", "reason", "raw"]))
    if kind == "field":
        good[draw(st.sampled_from(sorted(good)))] = draw(value)
    elif kind == "extra":
        good[draw(st.text(max_size=6))] = draw(value)
    elif kind == "missing":
        good.pop(draw(st.sampled_from(sorted(good))))
    elif kind == "reason":
        good["reason"] = draw(st.sampled_from(["", "Diverged", "nan", "x" * 300, "Refused", "temporary", "failed"]))
    elif kind == "raw":
        return draw(st.binary(max_size=64))
    return json.dumps(good).encode()


def oracle_failure(body: bytes) -> bool:
    """An independent reading of docs/protocol.md's failure report: exactly round and version
    (integers >= 0) and reason "diverged", "failed" or "refused"."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    ints = (
        all(
            isinstance(obj.get(k), int) and not isinstance(obj.get(k), bool) and obj[k] >= 0
            for k in ("round", "version")
        )
        if isinstance(obj, dict)
        else False
    )
    return (
        isinstance(obj, dict)
        and set(obj) == {"round", "version", "reason"}
        and ints
        and obj["reason"] in ("diverged", "failed", "refused")
    )


# edge_secure: what the root's relay routes (/v1/edge/secagg/{stage}) are sent
EDGE_WHO = st.sampled_from(["f0"] * 6 + ["f1"] * 3 + ["n0", "e0", "garbage"])
EDGE_STAGES = (
    ["masked_sum"] * 4 + ["unmask"] * 2 + ["keys", "shares", "masked", "consistency", "nonsense", "MASKED_SUM"]
)
RELAYED_NODE = st.sampled_from(
    [*EDGE_OF, *EDGE_OF, *LEGIT, *FUZZERS, "x", "", "a" * 300, "e0%00", "e0&node=n0", "%65%30", None]
)
SENDERS = st.sampled_from([*EDGE_OF, *EDGE_OF, *LEGIT, *FUZZERS, "x", "", "a" * 300])
# who a masked sum names: an edge's own nodes (in any order, e2 outside the round), another's, repeats
SUM_SENDERS = st.one_of(
    st.sampled_from([["e0", "e1"], ["e1", "e0"], ["e0"], ["e1"], ["e2"], ["e0", "e2"], ["e0", "e0"], ["n0"], []]),
    st.lists(SENDERS, max_size=4),
)


def _message(draw, fields: dict, tensors: dict[str, tuple[str, list[int], bytes]]) -> bytes:
    """A secure aggregation wire message (safetensors, the shoal header in its metadata): half the
    time every header field as given, else each right most of the time (see _field)."""
    header = dict(fields)
    if draw(st.booleans()):
        header = {}
        for key, good in fields.items():
            v = _field(draw, good)
            if v is not _MISSING:
                header[key] = v
    table, data = {}, b""
    for name, (dtype, shape, blob) in tensors.items():
        table[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps({"__metadata__": {"shoal": json.dumps(header)}, **table}).encode()
    return struct.pack("<Q", len(text)) + text + data


@st.composite
def masked_sum_body(draw, ctx: Ctx) -> bytes:
    """An edge's masked sum: f0's own (taken already: a retransmit), or one built from any senders
    (repeated, another edge's, unknown, outside the round), of any length, round and vector."""
    fx = ctx.edge
    assert fx is not None
    if draw(st.integers(0, 4)) == 0:
        return draw(mutate(fx.sum_body))
    vs = fx.vector_size
    size = draw(st.sampled_from([vs] * 9 + [vs - 1, vs + 1, 0]))
    how = draw(st.sampled_from(["random", "zeros", "replay"]))
    if how == "replay":  # the vector of a masked input the root already holds, or of the sum
        source = draw(st.sampled_from([fx.sum_body, fx.masked["e0"], fx.masked["n0"]]))
        vector = source[-4 * vs :][: 4 * size].ljust(4 * size, b"\0")
    elif how == "zeros":
        vector = bytes(4 * size)
    else:
        vector = (
            draw(st.binary(min_size=4 * size, max_size=4 * size))
            if size <= 64
            else np.random.default_rng(draw(st.integers(0, 2**32))).bytes(4 * size)
        )
    fields = {
        "format": FORMAT,
        "kind": "masked_sum",
        "origin": draw(st.sampled_from(["f0", "f1", "e0", ""])),
        "senders": draw(SUM_SENDERS),
        "meta": {"round": draw(st.sampled_from([ctx.round] * 9 + [ctx.round + 1, ctx.round - 1, float("nan")]))},
    }
    dtype = draw(st.sampled_from(["I32"] * 9 + ["U32", "F32", "I64"]))
    return draw(mutate(_message(draw, fields, {"masked": (dtype, [size], vector)})))


@st.composite
def sealed_body(draw, ctx: Ctx, node: str) -> bytes:
    """An unmasking answer relayed to the root: sealed to the round's root key (by ``node`` or
    another), to another key, or not sealed at all; inside, any message (a keys message here: the
    masked stage is open, so even one that opens must be refused)."""
    from shoal.aggregation.secagg.tiers import SEALED_KIND, seal_message

    fx = ctx.edge
    assert fx is not None
    inner = draw(keys_body(ctx, node))
    how = draw(st.sampled_from(["sealed"] * 3 + ["other_sender", "other_key", "other_session", "plain", "junk"]))
    if how == "plain":
        return inner
    if how == "junk":
        fields = {"format": FORMAT, "kind": SEALED_KIND, "sender": node, "meta": {"round": ctx.round}}
        fields["sealed"] = base64.b64encode(draw(st.binary(max_size=120))).decode()
        return draw(mutate(_message(draw, fields, {})))
    key = X25519PrivateKey.generate().public_key().public_bytes_raw() if how == "other_key" else fx.root_key
    session = b"another session" if how == "other_session" else fx.session
    sender = draw(SENDERS) if how == "other_sender" else node
    return draw(mutate(seal_message(inner, key, session, sender, {"round": ctx.round})))


@st.composite
def edge_post_request(draw, ctx: Ctx) -> Request:
    """``POST /v1/edge/secagg/{stage}?node=NAME``: relayed messages and masked sums, often hostile,
    sometimes with a Content-Length over the route's limit."""
    fx = ctx.edge
    assert fx is not None
    stage = draw(st.sampled_from(EDGE_STAGES))
    node = draw(RELAYED_NODE)
    query = "" if node is None else f"?node={node}"
    name = node if isinstance(node, str) and node in ctx.tokens else "e0"
    if stage.lower() == "masked_sum":
        body = draw(masked_sum_body(ctx))
    elif stage == "unmask":
        body = draw(sealed_body(ctx, name))
    elif stage == "masked":
        body = draw(mutate(fx.masked[draw(st.sampled_from(["e0", "n0", "n1"]))]))
    else:
        body = draw(keys_body(ctx, name))
    length = draw(st.sampled_from([None] * 12 + [fx.limit + 1, 2**40]))
    return Request("POST", f"/v1/edge/secagg/{stage}{query}", draw(EDGE_WHO), body, "edge_post", length=length)


@st.composite
def edge_get_request(draw, ctx: Ctx) -> Request:
    """``GET /v1/edge/secagg/{stage}?node=NAME&round=R&wait=S``: another edge's node, an unknown one,
    stages that have no reply, strict-looking query strings."""
    stage = draw(st.sampled_from(["keys", "shares", "masked", "unmask", "consistency", "masked_sum", "zz"]))
    query = []
    node = draw(RELAYED_NODE)
    if node is not None:
        query.append(f"node={node}")
    query.append(f"round={draw(st.one_of(st.just(str(ctx.round)), QUERY_ROUND))}")
    query.append(f"wait={draw(st.one_of(st.just('0'), QUERY_WAIT.map(_no_hold)))}")
    return Request("GET", f"/v1/edge/secagg/{stage}?{'&'.join(query)}", draw(EDGE_WHO), kind="edge_get")


def _no_hold(wait: str) -> str:
    """A valid ``wait`` becomes 0: the fuzzer checks refusals, it does not sit in long-polls."""
    return "0" if re.fullmatch(r"[0-9]{1,9}(\.[0-9]{0,9})?", wait) else wait


@dataclass
class Request:
    method: str
    path: str
    who: str  # a node name, "admin", "none", "garbage", "bytes"
    body: bytes = b""
    kind: str = ""  # "update" | "keys" | "" (what the oracle checks)
    expect100: bool = False
    chunk_sha256: str = ""  # a chunked upload's chunk digest header (X-Shoal-Chunk-Sha256)
    length: int | None = None  # a Content-Length that lies (over the route's limit); None: the body's


def requests(ctx: Ctx, mode: str):
    """The strategy of one hostile request against a server in ``mode``."""
    who = st.sampled_from(
        FUZZERS * 4 + ["admin", "none", "garbage", "bytes"] + (LEGIT if mode in ("secure", "edge_secure") else [])
    )

    federation = ["offers", "answer", "runs_post", "runs_get", "run_get", "run_stop", "run_file", "elsewhere"]

    @st.composite
    def one(draw):
        sender = draw(who)
        route = draw(
            st.sampled_from(
                ["update"] * 8
                + ["keys"] * (6 if mode == "secure" else 1)
                + ["secagg_post", "task", "model", "secagg_get", "status", "metrics", "junk", "failed"]
                + ["chunks"] * 2
                + ["partial"] * 2
                + ["edge_poll"]
                + (["edge_post"] * 30 + ["edge_get"] * 10 if mode == "edge_secure" else [])
                + (federation * 2 if mode == "federation" else [])
            )
        )
        name = sender if sender in ctx.tokens else "f0"
        at = prefix(mode)
        if route == "elsewhere":  # the node protocol of a run that does not exist (or a junk id)
            at = "/runs/" + draw(RUN_IDS.filter(lambda r: unquote(r) != RUN))
            route = draw(st.sampled_from(["task", "model"]))
        if route in federation:
            return draw(federation_request(ctx, route, sender))
        if route == "edge_post":  # the root's relay routes (server/edge/secure.py)
            return draw(edge_post_request(ctx))
        if route == "edge_get":
            return draw(edge_get_request(ctx))
        if route == "failed":  # a failure report (POST /v1/failed) from a node that holds no task
            who_ = sender if sender not in LEGIT else "f0"
            return Request("POST", at + "/v1/failed", who_, draw(failure_body()), "failed")
        if route == "chunks":  # chunked uploads: never a valid opening, chunks of uploads that do not exist
            return draw(chunk_request(at, sender))
        if route == "partial":  # f0 is an edge of the server (hierarchy.edge_names); others get 403
            return Request("POST", at + "/v1/partial", sender, draw(partial_body(ctx)), "partial")
        if route == "edge_poll":  # f0's roster; never waits (a wait would hold the fuzzer)
            return Request("POST", at + "/v1/edge/poll?wait=0", sender, draw(edge_poll_body()), "edge_poll")
        if route == "update":
            body = draw(update_body(ctx, name))
            return Request("POST", at + "/v1/update", sender, body, "update", draw(st.booleans()))
        if route == "keys":
            return Request("POST", at + "/v1/secagg/keys", sender, draw(keys_body(ctx, name)), "keys")
        if route == "secagg_post":
            stage = draw(st.sampled_from(["shares", "masked", "unmask", "nonsense", "keys"]))
            return Request("POST", f"{at}/v1/secagg/{stage}", sender, draw(mutate(draw(keys_body(ctx, name)))))
        if route == "task":
            wait = _no_hold(draw(QUERY_WAIT))
            if mode == "async" and wait == "0":
                wait = "nan"  # a valid poll would hand the fuzzing node a task (state, not a refusal)
            return Request("GET", f"{at}/v1/task?wait={wait}", sender)
        if route == "model":
            return Request("GET", at + "/v1/model", sender)
        if route == "secagg_get":
            stage = draw(st.sampled_from(["keys", "shares", "masked", "unmask", "zz"]))
            wait = _no_hold(draw(QUERY_WAIT))
            return Request("GET", f"{at}/v1/secagg/{stage}?round={draw(QUERY_ROUND)}&wait={wait}", sender)
        if route in ("status", "metrics"):
            return Request("GET", "/v1/status" if route == "status" else "/metrics", sender)
        return Request(
            draw(st.sampled_from(["GET", "POST", "DELETE", "PUT"])),
            "/" + draw(st.text(alphabet="abcdefv1/%.", max_size=12)),
            sender,
        )

    return one()


def _valid_begin(body: bytes) -> bool:
    """What POST /v1/uploads opens (docs/protocol.md): the fuzzer sends only others."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == {"size", "sha256"}
        and type(obj["size"]) is int
        and obj["size"] >= 1
        and isinstance(obj["sha256"], str)
        and re.fullmatch(r"[0-9a-f]{64}", obj["sha256"]) is not None
    )


def chunk_request(at: str, sender: str):
    """A malformed opening of a chunked upload, or a chunk / status request for an upload id that
    was never opened (random offsets, sizes and digests)."""
    sha = st.one_of(st.just("ab" * 32), st.text(alphabet="0123456789abcdefG", max_size=70))
    begin = st.one_of(
        st.binary(max_size=40),
        json_value.map(_json_body),
        st.fixed_dictionaries(
            {"size": st.one_of(st.integers(-5, 2**70), st.floats(), st.booleans(), st.text(max_size=5)), "sha256": sha},
            optional={"extra": json_value},
        ).map(_json_body),
    ).filter(lambda b: not _valid_begin(b))
    ids = st.one_of(st.text(alphabet="0123456789abcdef", min_size=1, max_size=40), st.just("%2e%2e"))
    offsets = st.one_of(st.integers(0, 10**6).map(str), st.sampled_from(["-1", "nan", "", "1e3", "0x10"]))
    put = st.builds(
        lambda i, o, body, d: Request("PUT", f"{at}/v1/uploads/{i}?offset={o}", sender, body, chunk_sha256=d),
        ids,
        offsets,
        st.binary(max_size=64),
        sha,
    )
    return st.one_of(
        begin.map(lambda b: Request("POST", at + "/v1/uploads", sender, b)),
        put,
        ids.map(lambda i: Request("GET", f"{at}/v1/uploads/{i}", sender)),
    )


RUN_IDS = st.one_of(
    st.just(RUN),
    st.sampled_from(["run-2", "run-0", "run-999999999", "run-1x", "RUN-1", "run--1", "run-1.", "%72un-1"]),
    st.text(alphabet="abcdefrun-0123456789%.~_", min_size=1, max_size=14),
)


def _valid_answer(body: bytes) -> bool:
    """What POST /runs/{run}/v1/answer takes (docs/protocol.md): the fuzzer sends only others."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False
    if not isinstance(obj, dict) or obj.get("answer") not in ("joined", "refused"):
        return False
    if set(obj) - {"answer", "reason", "temporary"}:
        return False
    reason, temporary = obj.get("reason", ""), obj.get("temporary", False)
    return (
        isinstance(reason, str)
        and len(reason) <= 500
        and reason.isprintable()
        and (obj["answer"] == "joined" or bool(reason))
        and temporary in (True, False)
        and type(temporary) is bool
        and not (temporary and obj["answer"] == "joined")
    )


def _json_body(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def federation_request(ctx: Ctx, route: str, sender: str):
    """One hostile request to a federation's own routes; none may change its runs (see the module doc).
    Paths are percent-decoded by the server: ``%72un-1`` is run-1, so only ids that do not decode to
    it are stopped."""
    if route == "offers":
        return st.just(Request("GET", "/v1/offers", sender))
    if route == "answer":
        bodies = st.one_of(
            st.binary(max_size=40),
            json_value.map(_json_body),
            st.fixed_dictionaries(
                {"answer": st.sampled_from(["joined", "refused", "maybe", ""]), "reason": json_value}
            ).map(_json_body),
            st.fixed_dictionaries(  # a refusal, temporary or not, with a flag or a field that is wrong
                {"answer": st.sampled_from(["joined", "refused"]), "reason": st.sampled_from(["", "busy", "\x07"])},
                optional={"temporary": json_value, "until": json_value},
            ).map(_json_body),
            st.just(_json_body({"answer": "refused", "reason": "x" * 501})),
            st.just(_json_body({"answer": "refused", "reason": "a\x00b"})),
            st.just(_json_body({"answer": "joined", "temporary": True})),
            st.just(_json_body({"answer": "refused", "reason": "busy", "temporary": 1})),
        ).filter(lambda b: not _valid_answer(b))
        return st.builds(lambda run, body: Request("POST", f"/runs/{run}/v1/answer", sender, body), RUN_IDS, bodies)
    if route == "runs_post":  # never a task the server can load: no submission may be accepted
        task = st.one_of(
            st.just(""),
            st.text(alphabet="abc/:.", max_size=10).map(lambda t: f"/nonexistent{t}.py:task"),
            json_value,
        ).filter(lambda t: t != "builtin")
        config = st.one_of(json_value, st.just({"federation": {"enabled": True}}), st.just({"server": {"port": 1}}))
        body = st.one_of(
            st.binary(max_size=40),
            json_value.map(_json_body),
            st.builds(lambda t, c: _json_body({"task": t, "config": c}), task, config),
        )
        return st.builds(lambda b: Request("POST", "/v1/runs", sender, b), body)
    if route == "runs_get":
        return st.just(Request("GET", "/v1/runs", sender))
    if route == "run_get":
        after = st.one_of(st.just("0"), st.just("-1"), st.just("nan"), st.text(alphabet="0123456789e.", max_size=20))
        return st.builds(
            lambda run, what, a, w: Request(
                "GET", f"/v1/runs/{run}" + (f"/metrics?after={a}&wait={_no_hold(w)}" if what else ""), sender
            ),
            RUN_IDS,
            st.booleans(),
            after,
            QUERY_WAIT,
        )
    if route == "run_stop":  # never the run itself: stopping it is the admin's right
        return st.builds(
            lambda run: Request("POST", f"/v1/runs/{run}/stop", sender), RUN_IDS.filter(lambda r: unquote(r) != RUN)
        )
    names = st.sampled_from(["model.safetensors", "summary.json", "metrics.jsonl", "..%2f..%2fnodes.sqlite", "x"])
    return st.builds(lambda run, n: Request("GET", f"/v1/runs/{run}/files/{n}", sender), RUN_IDS, names)


def raw_request(req: Request, ctx: Ctx) -> bytes:
    if req.who in ctx.tokens:
        auth = b"Authorization: Bearer " + ctx.tokens[req.who].encode() + b"\r\n"
    elif req.who == "garbage":
        auth = b"Authorization: Bearer not-a-token\r\n"
    elif req.who == "bytes":
        auth = b"Authorization: Bearer \xff\xfe\xc3\x28\r\n"
    else:
        auth = b""
    head = f"{req.method} {req.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode() + auth
    if req.method in ("POST", "PUT"):
        length = len(req.body) if req.length is None else req.length
        head += f"Content-Type: application/octet-stream\r\nContent-Length: {length}\r\n".encode()
        if req.expect100:
            head += b"Expect: 100-continue\r\n"
        if req.chunk_sha256:
            head += f"X-Shoal-Chunk-Sha256: {req.chunk_sha256}\r\n".encode()
    return head + b"\r\n" + (req.body if req.method in ("POST", "PUT") else b"")


# --- the oracle ----------------------------------------------------------------------


def _json(text_bytes: bytes):
    """Strict JSON as the protocol has it: UTF-8, no duplicate keys; None if not."""

    def pairs(p):
        d = dict(p)
        if len(d) != len(p):
            raise ValueError("duplicate key")
        return d

    try:
        return json.loads(text_bytes.decode("utf-8"), object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None


def _depth_digits(v, depth=1) -> tuple[int, int]:
    if isinstance(v, dict):
        sub = [_depth_digits(x, depth + 1) for x in v.values()] or [(depth, 0)]
    elif isinstance(v, list):
        sub = [_depth_digits(x, depth + 1) for x in v] or [(depth, 0)]
    elif isinstance(v, int) and not isinstance(v, bool):
        return depth - 1, len(str(abs(v)))
    else:
        return depth - 1, 0
    return max(d for d, _ in sub), max(g for _, g in sub)


def _int(v, low, high=None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low and (high is None or v <= high)


def _header(body: bytes, limit: int):
    """(table, shoal header) when the safetensors library loads ``body`` and the JSON obeys
    the protocol's limits; None otherwise."""
    if len(body) > limit or len(body) < 8:
        return None
    try:
        tensors = st_load(body)
    except Exception:  # noqa: BLE001 - the library's refusal is the oracle's answer
        return None
    (hlen,) = struct.unpack("<Q", body[:8])
    table = _json(body[8 : 8 + hlen])
    if not isinstance(table, dict):
        return None
    d, g = _depth_digits(table)
    meta = table.pop("__metadata__", None)
    if d > 16 or g > 19 or not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        return None
    for e in table.values():  # the protocol's table rules, a little stricter than the library's
        if (
            set(e) != {"dtype", "shape", "data_offsets"}
            or len(e["shape"]) > 8
            or e["dtype"] not in (*DTYPE_SIZE, "BOOL", "I16", "U16", "BF16", "U32", "U64", "F64")
        ):
            return None
    h = _json(meta.get("shoal", "").encode()) if isinstance(meta.get("shoal"), str) else None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        return None
    d, g = _depth_digits(h)
    if d > 16 or g > 19:
        return None
    return table, h, tensors


def oracle_update(body: bytes, ctx: Ctx) -> bool | None:
    """True: a well-formed update for this model; False: malformed; None: not judged (zstd)."""
    got = _header(body, ctx.max_body)
    if got is None:
        return False
    table, h, tensors = got
    if h.get("zstd", False) is not False:
        return None if h.get("zstd") is True else False
    n, enc = ctx.numel, h.get("encoding", "dense")
    if h.get("kind") != "update" or h.get("spec_hash") != ctx.spec_hash:
        return False
    if enc == "dense":
        want = {"delta": (torch.float32, (n,))}
    elif enc == "q8":
        if not _int(h.get("chunk"), 1, 1 << 24):
            return False
        want = {"q": (torch.int8, (n,)), "scale": (torch.float32, (math.ceil(n / h["chunk"]),))}
    elif enc == "topk":
        if not _int(h.get("k"), 1, max(1, n // 2)):
            return False
        want = {"indices": (torch.int32, (h["k"],)), "values": (torch.float32, (h["k"],))}
    else:
        return False
    if set(tensors) != set(want) or any((t.dtype, tuple(t.shape)) != want[k] for k, t in tensors.items()):
        return False
    m = h.get("metrics", {})
    if not (
        _int(h.get("base_version"), 0)
        and _int(h.get("num_examples"), 1, ctx.max_examples)
        and isinstance(h.get("sender", ""), str)
        and len(h.get("sender", "")) <= 256
        and ("round" not in h or _int(h["round"], 0))
        and isinstance(m, dict)
        and len(m) <= 64
        and all(
            isinstance(k, str)
            and len(k) <= 256
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
            for k, v in m.items()
        )
    ):
        return False
    if any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in tensors.values()):
        return False
    if enc == "dense":
        delta = tensors["delta"]
    elif enc == "q8":
        q, s = tensors["q"], tensors["scale"]
        if bool((q == -128).any()) or bool((s < 0).any()):
            return False
        delta = q.float() * s.repeat_interleave(h["chunk"])[:n]
    else:
        idx = tensors["indices"].long()
        if bool(((idx < 0) | (idx >= n)).any()) or (len(idx) > 1 and not bool((idx[1:] > idx[:-1]).all())):
            return False
        delta = torch.zeros(n)
        delta[idx] = tensors["values"]
    if not bool(torch.isfinite(delta).all()):
        return False
    return not (ctx.max_delta_abs > 0 and float(delta.abs().max()) > ctx.max_delta_abs)


def oracle_keys(body: bytes, ctx: Ctx, sender: str, taken: set[bytes]) -> bool:
    """A public_keys message the secure round may take from ``sender``."""
    import base64

    got = _header(body, ctx.max_body)
    if got is None:
        return False
    table, h, tensors = got
    if table or h.get("kind") != "public_keys" or h.get("sender") != sender:
        return False
    keys = []
    for k in ("enc_key", "mask_key"):
        try:
            raw = base64.b64decode(h.get(k), validate=True) if isinstance(h.get(k), str) else b""
        except ValueError:
            return False
        if len(raw) != 32:
            return False
        try:
            X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(raw))
        except ValueError:
            return False
        keys.append((int.from_bytes(raw, "little") & ((1 << 255) - 1)) % (2**255 - 19))
    meta = h.get("meta")
    return (
        keys[0] != keys[1]
        and not {k.to_bytes(32, "little") for k in keys} & taken
        and isinstance(meta, dict)
        and meta.get("round") == ctx.round
        and _int(meta.get("num_examples"), 1, ctx.max_examples)
        and isinstance(meta.get("train_loss", 0.0), (int, float))
        and not isinstance(meta.get("train_loss"), bool)
    )


# --- a fuzzing session ------------------------------------------------------------------


@dataclass
class Tally:
    requests: int = 0
    status: dict[int, int] = field(default_factory=dict)
    five_xx: int = 0
    not_json: int = 0
    malformed_accepted: int = 0
    wellformed_refused: int = 0
    state_changed: int = 0
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(what)


def snapshot(svc, fed=None, app=None) -> tuple:
    """Model bytes, version, checkpoints and counters: what no hostile request may change (and a
    federation's runs table, the nodes' answers and the runs' metrics lines)."""
    if fed is not None:
        runs = json.dumps([(r.id, r.status, r.reason) for r in fed.db.runs()])
        answers = json.dumps(fed.db.answers(RUN), sort_keys=True)
        return snapshot(svc) + (runs, answers, len(fed.db.metrics(RUN)))
    r, c = svc.rounds, svc.counters
    ck = (
        sorted(p.name for p in Path(svc.cfg.server.checkpoint_dir).glob("*"))
        if Path(svc.cfg.server.checkpoint_dir).exists()
        else []
    )
    base = (
        hashlib.sha256(r.global_params.numpy().tobytes()).hexdigest(),
        r.version,
        c.accepted,
        c.bytes_received,
        c.rounds_completed,
        c.rounds_abandoned,
        tuple(ck),
        svc.model_body()[-64:],
    )
    if svc.mode == "async":
        return base + (r.stats.accepted, tuple(sorted(r.outstanding)), r.algorithm.count)
    base += (r.round, r.open, tuple(sorted(r.received)), r.strategy.num_accumulated)
    sr = svc.secure_round
    if sr is None or not svc.cfg.hierarchy.edge_names:
        return base
    # edge_secure: the protocol's state, who the root saw, and who speaks for whom in the round
    intake = svc.tier
    return base + (
        sr.stage,
        sr.aborted,
        tuple((k, tuple(sorted(v))) for k, v in sorted(sr.sent.items())),
        tuple(sorted(sr.sums_taken.items())),
        tuple(sr.server.u3),
        sr.server._total.tobytes(),
        tuple(sorted(svc.last_seen)),
        (intake.roster._frozen[0], tuple(sorted(intake.roster._frozen[1].items()))) if intake else (),
    )


def prepare(server: ServerThread):
    """Open the fuzzed state: sync, a round selecting legit nodes only; async, nothing; secure,
    a round at its key stage with every node (the fuzzing ones too) selected; edge_secure (a
    coroutine), a round through the edges f0 and f1 at its masked stage (see _prepare_edges)."""
    if server.mode == "edge_secure":
        return _prepare_edges(server)
    svc, live = server.svc, server.live
    now = time.monotonic()
    if server.mode in ("sync", "federation"):
        for n in LEGIT:
            svc.seen(n, now)
        assert svc.tick(now) and set(svc.rounds.selected) <= set(LEGIT)
    elif server.mode == "secure":
        for n in LEGIT + FUZZERS:
            svc.seen(n, now)
        assert svc.tick(now) and svc.secure_round is not None
    s = svc.cfg.server
    return Ctx(
        svc.spec.numel,
        svc.spec.hash,
        svc.version,
        getattr(svc.rounds, "round", 0),
        s.max_examples,
        s.max_delta_abs,
        svc.max_body_bytes,
        dict(live.tokens),
        svc.secure_round.task_info() if svc.secure_round else None,
    )


def check(server: ServerThread, ctx: Ctx, req: Request, tally: Tally, before: tuple, taken: set[bytes]) -> tuple:
    """Send one request and check its answer and the server's state."""
    status, headers, body = server.send(raw_request(req, ctx))
    tally.requests += 1
    tally.status[status] = tally.status.get(status, 0) + 1
    if status >= 500 or status == 0:
        tally.five_xx += 1
        tally.note(f"{status} for {req.method} {req.path} as {req.who}: {body[:200]!r}")
    info = None
    if status >= 400:
        try:
            info = json.loads(body)
            assert isinstance(info["error"], str) and isinstance(info["detail"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            if not (status == 400 and headers.get("content-type", "").startswith("text/plain")):  # aiohttp's parser
                tally.not_json += 1
                tally.note(f"not JSON: {status} {body[:120]!r}")
    node_ok = req.who in LEGIT + FUZZERS
    if req.kind == "update" and node_ok and status not in (401, 403, 429):
        ok = oracle_update(req.body, ctx)
        passed = status in (200, 409)
        if ok is False and passed:
            tally.malformed_accepted += 1
            tally.note(f"malformed update answered {status}: {info}")
        if ok is True and status in (400, 413):
            tally.wellformed_refused += 1
            tally.note(f"well-formed update refused {status}: {info}")
    if req.kind == "partial" and status == 200:  # its nodes hold no task: it must be refused
        tally.malformed_accepted += 1
        tally.note(f"partial accepted from {req.who}: {info}")
    if req.kind == "edge_poll" and status == 200 and json.loads(body).get("nodes") != 0:  # names no enrolled node
        tally.malformed_accepted += 1
        tally.note(f"edge poll claimed nodes: {info}")
    if req.kind == "edge_post" and status == 200 and json.loads(body).get("status") != "duplicate":
        tally.malformed_accepted += 1  # the only relayed message the root may answer 200: f0's sum again
        tally.note(f"relayed {req.path} from {req.who} answered 200: {body[:120]!r}")
    if req.kind == "failed" and status == 200 and not oracle_failure(req.body):
        tally.malformed_accepted += 1
        tally.note(f"malformed failure report accepted: {req.body[:80]!r}")
    if req.kind == "keys" and node_ok and status == 200:
        if not oracle_keys(req.body, ctx, req.who, taken):
            tally.malformed_accepted += 1
            tally.note(f"malformed keys accepted from {req.who}")
        got = _header(req.body, ctx.max_body)
        import base64

        for k in ("enc_key", "mask_key"):
            raw = base64.b64decode(got[1][k])
            taken.add(((int.from_bytes(raw, "little") & ((1 << 255) - 1)) % (2**255 - 19)).to_bytes(32, "little"))
    after = server.call(lambda: snapshot(server.svc, server.fed, server.live.app))
    if after != before:
        tally.state_changed += 1
        tally.note(f"state changed by {req.method} {req.path} as {req.who} ({status})")
    return after


# --- after the fuzzing: a legitimate round still completes ------------------------------


def _post(server: ServerThread, ctx: Ctx, node: str, path: str, body: bytes) -> tuple[int, bytes]:
    status, _, out = server.send(raw_request(Request("POST", path, node, body), ctx))
    return status, out


def legit_round(server: ServerThread, ctx: Ctx) -> int:
    """Run one legitimate round with the legit nodes; the new version."""
    from .hostile import good_update

    svc = server.svc
    if server.mode in ("sync", "federation"):
        for n in sorted(svc.rounds.selected):
            body = server.call(lambda n=n: good_update(svc, n))
            status, out = _post(server, ctx, n, prefix(server.mode) + "/v1/update", body)
            assert status == 200, out
    elif server.mode == "async":
        for n in LEGIT[:2]:
            status, _, out = server.send(raw_request(Request("GET", "/v1/task?wait=0", n), ctx))
            assert status == 200 and json.loads(out)["status"] == "work", out
            status, out = _post(server, ctx, n, "/v1/update", server.call(lambda n=n: good_update(svc, n)))
            assert status == 200, out
    elif server.mode == "edge_secure":
        server.call(lambda: _legit_edges(server, ctx))
    else:
        server.call(lambda: _legit_secure(server))
    return server.call(lambda: svc.version)


async def _legit_secure(server: ServerThread) -> None:
    """Close the fuzzed round (no legit node took part: it aborts), then run the next one
    with the legit nodes, as test_secure_rounds does, over the same TLS."""
    from contextlib import AsyncExitStack

    import aiohttp

    from shoal.aggregation.secagg.wire import decode_message, encode_message, message_meta

    from .test_secure_rounds import LATER, Party

    live, svc = server.live, server.svc
    first = svc.rounds.round
    for _ in range(5):
        if not svc.rounds.open or svc.rounds.round != first:
            break
        svc.tick(time.monotonic() + LATER)
    assert svc.version == 0 and not svc.rounds.open
    rng = np.random.default_rng(1)
    async with AsyncExitStack() as stack:
        parties = []
        for n in LEGIT:
            http = await stack.enter_async_context(
                live.session(n, connector=aiohttp.TCPConnector(ssl=server.client_ssl))
            )
            parties.append(Party(live, n, http, rng))
        for p in parties:
            await p.task()
        assert svc.tick(time.monotonic()) and svc.secure_round is not None
        for p in parties:
            p.start(await p.task())
            assert (await p.post("keys", p.keys()))[0] == 200
        svc.tick(time.monotonic() + LATER)  # fuzzing nodes selected again stay away: they drop out here
        max_weight = 0.0
        for p in parties:
            status, body = await p.fetch("keys")
            assert status == 200
            max_weight = message_meta(body, p.params.vector_size)["max_weight"]
            directory = decode_message(body, p.params.vector_size)
            assert (await p.post("shares", encode_message(p.client.share_keys(directory), {"round": p.round})))[
                0
            ] == 200
        for p in parties:
            status, delivery = await p.fetch("shares")
            assert status == 200 and (await p.post("masked", p.masked(delivery, max_weight)))[0] == 200
        for p in parties:
            status, body = await p.fetch("masked")
            request = decode_message(body, p.params.vector_size)
            assert (await p.post("unmask", encode_message(p.client.unmask(request), {"round": p.round})))[0] == 200
    assert svc.version == 1


async def _sessions(server: ServerThread, stack, names) -> dict:
    import aiohttp

    out = {}
    for n in names:
        connector = aiohttp.TCPConnector(ssl=server.client_ssl)
        out[n] = await stack.enter_async_context(server.live.session(n, connector=connector))
    return out


async def _edge_poll(server: ServerThread, http, nodes: list[str]) -> dict:
    async with http.post(server.live.url + "/v1/edge/poll", params={"wait": "0"}, json={"nodes": nodes}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _prepare_edges(server: ServerThread) -> Ctx:
    """edge_secure: a secure round of LEGIT and EDGE_OF's nodes run over real HTTP up to its masked
    stage: every node but e2 (whose task fails) advertised keys and shared them, through its edge
    for e0 and e1; f0's masked sum of e0 and e1 is in; LEGIT's masked inputs are still awaited."""
    from contextlib import AsyncExitStack

    from shoal.aggregation.secagg import MaskedSum
    from shoal.aggregation.secagg.tiers import EdgeMaskedSum
    from shoal.aggregation.secagg.wire import decode_message, encode_message, message_meta
    from shoal.server.edge.secure import body_limit

    live, svc = server.live, server.svc
    before = svc.rounds.global_params.clone()
    rng = np.random.default_rng(2)
    async with AsyncExitStack() as stack:
        http = await _sessions(server, stack, [*LEGIT, *EDGE_OF, *FUZZERS])
        parties = {n: Party(live, n, http[n], rng) for n in LEGIT}
        for n in LEGIT:
            assert (await parties[n].task())["status"] == "wait"  # seen, so the round selects them
        for edge in FUZZERS:
            held = [n for n, e in EDGE_OF.items() if e == edge]
            assert (await _edge_poll(server, http[edge], held))["nodes"] == len(held)
        svc.tick(time.monotonic())  # the round opens (the edges' polls may have opened it already)
        assert svc.secure_round is not None and sorted(svc.rounds.selected) == sorted([*LEGIT, *EDGE_OF])
        answer = await _edge_poll(server, http["f0"], ["e0", "e1"])
        assert sorted(answer["tasks"]) == ["e0", "e1"], answer
        r, info = answer["round"], answer["secure_aggregation"]
        for n in ("e0", "e1"):
            parties[n] = Relayed(live, n, http[n], rng, http["f0"])
            parties[n].start({"round": r, "secure_aggregation": info})
        for n in LEGIT:
            parties[n].start(await parties[n].task())
        failed = json.dumps({"round": r, "version": svc.version, "reason": "refused"}).encode()
        async with http["e2"].post(live.url + "/v1/failed", data=failed) as resp:  # its task came via f1
            assert resp.status == 200, await resp.text()
        for p in parties.values():
            assert (await p.post("keys", p.keys()))[0] == 200
        max_weight = 0.0
        for p in parties.values():
            status, body = await p.fetch("keys")
            assert status == 200, body
            max_weight = message_meta(body, p.params.vector_size)["max_weight"]
            shares = encode_message(p.client.share_keys(decode_message(body, p.params.vector_size)), {"round": r})
            assert (await p.post("shares", shares))[0] == 200
        masked = {}
        for n, p in parties.items():
            status, delivery = await p.fetch("shares")
            assert status == 200
            masked[n] = p.masked(delivery, max_weight)
        vs = parties["e0"].params.vector_size
        acc = EdgeMaskedSum("f0", vs, ["e0", "e1"])
        for n in ("e0", "e1"):
            acc.add(decode_message(masked[n], vs))
        part = acc.sealed()
        assert part is not None
        sum_body = encode_message(MaskedSum("f0", part.senders, part.vector), {"round": r})
        async with http["f0"].post(live.url + "/v1/edge/secagg/masked_sum", data=sum_body) as resp:
            assert resp.status == 200 and (await resp.json())["nodes"] == 2
    sr = svc.secure_round
    assert sr.stage == "masked" and sorted(sr.server.u2) == sorted([*LEGIT, "e0", "e1"]), sr.status()
    s = svc.cfg.server
    fixture = EdgeFixture(
        parties, masked, sum_body, base64.b64decode(info["root_key"]), sr.params.session, vs, body_limit(vs), before
    )
    return Ctx(
        svc.spec.numel,
        svc.spec.hash,
        svc.version,
        r,
        s.max_examples,
        s.max_delta_abs,
        svc.max_body_bytes,
        dict(live.tokens),
        sr.task_info(),
        fixture,
    )


async def _legit_edges(server: ServerThread, ctx: Ctx) -> None:
    """edge_secure: the fuzzed round completes: LEGIT's masked inputs, then every node's unmasking
    answer sealed to the root (e0 and e1 through f0); the model moves by the nodes' weighted mean."""
    from contextlib import AsyncExitStack

    from shoal.aggregation.secagg.tiers import seal_message
    from shoal.aggregation.secagg.wire import decode_message, encode_message

    svc, fx = server.svc, ctx.edge
    assert fx is not None
    sr = svc.secure_round
    async with AsyncExitStack() as stack:
        http = await _sessions(server, stack, [*LEGIT, *EDGE_OF, "f0"])
        for n, p in fx.parties.items():
            p.http = http[n]
            if isinstance(p, Relayed):
                p.edge_http = http["f0"]
        for n in LEGIT:
            assert (await fx.parties[n].post("masked", fx.masked[n]))[0] == 200
        assert sr.stage == "unmask", sr.status()
        for n, p in fx.parties.items():
            status, body = await p.fetch("masked")
            assert status == 200, body
            plain = encode_message(p.client.unmask(decode_message(body, fx.vector_size)), {"round": ctx.round})
            sealed = seal_message(plain, fx.root_key, fx.session, n, {"round": ctx.round})
            assert (await p.post("unmask", sealed))[0] == 200
    assert svc.version == 1
    w = np.array([p.examples / sr.max_weight for p in fx.parties.values()])
    expected = sum(wk * p.delta for wk, p in zip(w, fx.parties.values(), strict=True)) / w.sum()
    # each of the k summands rounds each entry and its weight by less than one quantum
    bound = 1.1 * len(w) * sr.weights.quantum / w.sum() * (1 + np.abs(expected).max())
    got = (svc.rounds.global_params - fx.before).double().numpy()
    assert np.abs(got - expected).max() <= bound, (np.abs(got - expected).max(), bound)


def regressions(ctx: Ctx, mode: str) -> list[Request]:
    """Hostile requests that once changed a server's state, sent before the drawn ones."""
    if mode != "edge_secure":
        return []
    keys = encode_keys_like(ctx, "x")
    return [
        # the root marked any name an edge relayed for as a node seen alive (a node it may select),
        # before it checked that the edge speaks for it
        Request("POST", "/v1/edge/secagg/keys?node=x", "f0", keys, "edge_post"),
        Request("POST", "/v1/edge/secagg/MASKED_SUM?node=not-a-node", "f0", keys, "edge_post"),
        Request("GET", f"/v1/edge/secagg/keys?node=y&round={ctx.round}&wait=0", "f1", kind="edge_get"),
    ]


def encode_keys_like(ctx: Ctx, sender: str) -> bytes:
    """A well-formed keys message of ``sender`` for the fuzzed round."""
    key = X25519PrivateKey.generate().public_key().public_bytes_raw
    header = {
        "format": FORMAT,
        "kind": "public_keys",
        "sender": sender,
        "enc_key": base64.b64encode(key()).decode(),
        "mask_key": base64.b64encode(key()).decode(),
        "meta": {"round": ctx.round, "num_examples": 10, "train_loss": 0.5},
    }
    text = json.dumps({"__metadata__": {"shoal": json.dumps(header)}}).encode()
    return struct.pack("<Q", len(text)) + text


def run_mode(tmp: Path, mode: str, batches: int, batch: int = 50, seed: int | None = None) -> dict:
    """Fuzz one mode with ``batches`` x ``batch`` requests, then run a legitimate round; the figures."""
    from hypothesis import HealthCheck, Phase, given, settings

    t0 = time.perf_counter()
    with ServerThread(tmp, mode) as server:
        ctx = server.call(lambda: prepare(server))
        tally, taken = Tally(), set()
        state = {"before": server.call(lambda: snapshot(server.svc, server.fed, server.live.app))}
        start = state["before"]

        @settings(
            max_examples=batches,
            deadline=None,
            database=None,
            derandomize=seed is not None,
            suppress_health_check=list(HealthCheck),
            # no shrinking: a replay against a live server is neither cheap nor the same request (its
            # state moved on), so shrinking a failure resends batches for minutes; the first failing
            # batch is reported as it is, with its examples
            phases=[Phase.generate],
        )
        @given(st.lists(requests(ctx, mode), min_size=batch, max_size=batch))
        def fuzz(reqs):
            for req in reqs:
                state["before"] = check(server, ctx, req, tally, state["before"], taken)
            assert (
                tally.five_xx,
                tally.not_json,
                tally.malformed_accepted,
                tally.wellformed_refused,
                tally.state_changed,
            ) == (0, 0, 0, 0, 0), tally.examples

        for req in regressions(ctx, mode):  # requests that once changed the state, sent every time
            state["before"] = check(server, ctx, req, tally, state["before"], taken)
        fuzz()
        end = server.call(lambda: snapshot(server.svc, server.fed, server.live.app))
        version = legit_round(server, ctx)
    return {
        "mode": mode,
        "requests": tally.requests,
        "regressions": len(regressions(ctx, mode)),
        "5xx": tally.five_xx,
        "not_json": tally.not_json,
        "malformed_accepted": tally.malformed_accepted,
        "wellformed_refused": tally.wellformed_refused,
        "state_changed": tally.state_changed,
        "unchanged": end == start,
        "legit_round_version": version,
        "status": dict(sorted(tally.status.items())),
        "seconds": round(time.perf_counter() - t0, 1),
        "examples": tally.examples,
    }
