"""Hostile requests against live gossip peers over HTTPS, shared by tests/p2p/test_peer_fuzz.py
(a thousand requests per algorithm) and bench/fuzz_peer.py (ten thousand).

For one ``gossip.algorithm``: three real peers (p2p/peer.py ``Peer.run``: serving, training,
exchanging on 127.0.0.1 with a certificate authority made here) form a network; once the
target has merged, a seeded stream of hostile requests goes to it, eight at a time. Each
request is labelled by how it was built, not by what shoal's parser says: ``invalid`` (a
body or header that breaks a rule: it must get a 4xx JSON error) or ``any`` (random
mutations that may happen to stay well formed, and well-formed models far from ours: any
non-5xx answer). Then it counts answers of 5xx, invalid requests answered 2xx, errors that
are not JSON, and checks the target after: its model finite and within ``gossip.max_abs``,
its training and merges going on (more local steps and merges than before the fuzz), and
the peers' 500s (bugs) still 0. The issue's single probes are all among the cases.
"""

from __future__ import annotations

import asyncio
import json
import random
import ssl
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch

from shoal.client.training import LocalTrainer
from shoal.config import load_config
from shoal.models import build_model
from shoal.p2p.group_average import SliceMessage, group_id
from shoal.p2p.model_wire import encode_gossip_model, encode_secure, encode_slice
from shoal.p2p.peer import Peer, PeerData, PeerSettings
from shoal.p2p.secure_group import SecureMessage
from shoal.params import ParamSpec
from shoal.tls import client_context, make_private_ca, server_context
from shoal.wire import encode
from tests.p2p.processes import free_ports

ALGORITHMS = ("gossip", "group_average", "dpsgd", "secure_groups")
TOKEN = "fuzz-network-token"
PATHS = {"gossip": "/gossip", "group_average": "/group", "dpsgd": "/dpsgd", "secure_groups": "/secure"}
HOSTILE_URLS = [
    "https://" + "a" * 64 + ".example.org:9000",  # a label over 63 characters
    "https://user:pass@127.0.0.1:9000",
    "http://127.0.0.1:9000",  # plain http, and the peers run HTTPS
    "https://127.0.0.1:99999",
    "https://[zz::1]:1",
    "https://a..b:1",
    "ftp://127.0.0.1:1",
    "https://127.0.0.1:1/path?q=1",
    "https://" + "é" * 70 + ":1",
    "x" * 5000,
]
FORBIDDEN_URLS = [  # well formed, never contacted
    "https://169.254.169.254:80",
    "https://192.0.2.1:9000",
    "https://[2001:db8::1]:9000",
    "https://attacker.invalid:9000",
]
BAD_COUNTS = [9999999999999999999, 2**53 + 1, -1, True, False, 1.5, "7", None, [], {}]


@dataclass
class Case:
    path: str
    body: bytes
    invalid: bool
    kind: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Result:
    algorithm: str
    requests: int = 0
    invalid_sent: int = 0
    answers_5xx: int = 0
    invalid_accepted: int = 0
    not_json: int = 0
    transport_errors: int = 0
    by_status: dict[int, int] = field(default_factory=dict)
    accepted_kinds: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    model_finite: bool = False
    model_max_abs: float = 0.0
    within_max_abs: bool = False
    norm_ratio: float = 0.0  # the target's model norm over the largest of the other (honest) peers'
    steps_before: int = 0
    steps_after: int = 0
    merges_before: int = 0
    merges_after: int = 0
    peer_errors: int = 0
    peers_up: bool = False
    slow_closed: int = 0
    slow_opened: int = 0
    expect_unauthorized: bool = False

    @property
    def ok(self) -> bool:
        return (
            self.answers_5xx == 0
            and self.invalid_accepted == 0
            and self.not_json == 0
            and self.model_finite
            and self.within_max_abs
            and self.norm_ratio <= 2.0
            and self.steps_after > self.steps_before
            and self.merges_after > self.merges_before
            and self.peer_errors == 0
            and self.peers_up
        )

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()} | {"ok": self.ok}


def make_peer(algorithm: str, i: int, url: str, boot: tuple[str, ...], sctx, cctx) -> Peer:
    cfg = load_config(
        None,
        [
            f'gossip.algorithm="{algorithm}"',
            "gossip.period=1.0",
            "gossip.timeout=0.5",
            "gossip.group_size=3",
            "gossip.degree=2",
            "simulation.eval_every=1000",
            "simulation.seed=5",
            "train.lr=0.05",
        ],
    )
    torch.manual_seed(0)
    trainer = LocalTrainer(build_model("logreg", (20,), 4), cfg.train)
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(40, 20, generator=g)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    return Peer(cfg, trainer, PeerData((x, y)), PeerSettings(url, boot, TOKEN, False, sctx, cctx))


class Cases:
    """The seeded stream of hostile requests for one target peer."""

    def __init__(self, target: Peer, algorithm: str, seed: int):
        self.t, self.algorithm, self.rng = target, algorithm, random.Random(seed)
        self.spec = target.spec
        self.other_spec = ParamSpec.of(build_model("logreg", (21,), 4))
        self.sender = target.s.bootstrap[0]
        self._seq = 0

    def seq(self) -> int:
        """A fresh message counter (wall-clock microseconds, increasing): requests sent at once
        can still arrive out of order, and then the older one is refused (409), as it should be."""
        self._seq = max(self._seq + 1, int(time.time() * 1e6))
        return self._seq

    def own(self) -> torch.Tensor:
        return self.t.node.params.detach().clone()

    def model(self, params: torch.Tensor | None = None, spec: ParamSpec | None = None, **header: Any) -> bytes:
        params = self.own() + 0.001 if params is None else params
        step = self.t.wall_step()
        extra = {"age": 1, "num_examples": 10, "sender": self.sender, "step": step, "seq": self.seq(), **header}
        return encode_gossip_model(params, spec or self.spec, 1, extra)

    def raw_model(self, header: dict[str, Any]) -> bytes:
        base = {"kind": "model", "spec_hash": self.spec.hash, "version": 1, "age": 1, "num_examples": 10}
        base |= {"sender": self.sender, "step": self.t.wall_step(), "seq": self.seq()}
        return encode({"params": self.own()}, {**base, **header})

    def slice(self, **changes: Any) -> bytes:
        members = tuple(sorted((self.t.svc.id, self.sender)))
        step = self.t.wall_step() + 1
        n = self.spec.numel
        msg = SliceMessage(
            self.sender, self.t.svc.id, step, group_id(step, members), members, 0, "part", 1.0, torch.zeros(n // 2)
        )
        fields = {**msg.__dict__, **changes}
        return encode_slice(SliceMessage(**fields), self.spec)

    def secure(self, **changes: Any) -> bytes:
        members = tuple(sorted((self.t.svc.id, self.sender)))
        fields = dict(
            sender=self.sender,
            target=self.t.svc.id,
            round=self.t.wall_step() + 1,
            group="g",
            members=members,
            kind="abort",
            payload=None,
            meta={},
        )
        return encode_secure(SecureMessage(**{**fields, **changes}), self.spec)

    def shuffle(self, entries: list, sender: Any = None) -> bytes:
        return json.dumps({"sender": sender or self.sender, "entries": entries, "seq": self.seq()}).encode()

    def draw(self) -> Case:
        r = self.rng
        path = PATHS[self.algorithm]
        k = r.randrange(22)
        if k == 0:
            return Case(r.choice(list(PATHS.values()) + ["/shuffle"]), r.randbytes(r.randrange(2000)), True, "garbage")
        if k == 1:
            return Case(path, self.model(sender=r.choice(HOSTILE_URLS)), True, "hostile sender")
        if k == 2:
            key = r.choice(["age", "num_examples", "version", "step"])
            ignored = key == "step" and self.algorithm == "gossip"  # a pushed model has no step: not read
            return Case(path, self.raw_model({key: r.choice(BAD_COUNTS)}), not ignored, f"bad {key}")
        if k == 3:
            value = r.choice([torch.finfo(torch.float32).max, 1e30, 1e5, float("inf"), float("nan")])
            params = self.own()
            params[r.randrange(params.numel())] = value
            if value in (float("inf"), float("nan")):
                return Case(
                    path,
                    encode(
                        {"params": params},
                        {
                            "kind": "model",
                            "spec_hash": self.spec.hash,
                            "version": 1,
                            "age": 1,
                            "num_examples": 1,
                            "sender": self.sender,
                            "step": 0,
                        },
                    ),
                    True,
                    "non-finite",
                )
            return Case(path, self.model(params), True, "huge value")
        if k == 4:
            far = self.own() + r.choice([1.0, 10.0, 100.0, 1000.0]) * torch.randn(self.spec.numel)
            return Case(path, self.model(far.clamp(-9000, 9000), age=r.choice([1, 10**6, 2**53])), False, "far model")
        if k == 5:
            body = self.model()
            return Case(path, body[: r.randrange(len(body))], True, "truncated")
        if k == 6:
            body = bytearray(self.model())
            for _ in range(r.randrange(1, 8)):
                body[r.randrange(min(len(body), 400))] = r.randrange(256)
            return Case(path, bytes(body), False, "bit flips")
        if k == 7:
            return Case(path, self.model(torch.zeros(self.other_spec.numel), self.other_spec), True, "other spec")
        if k == 8:
            return Case(path, b"\0" * (self.t.max_bytes + 1 + r.randrange(1000)), True, "oversized")
        if k == 9:
            meta = r.choice([b"[" * 5000 + b"]" * 5000, b"9" * 5000, b'{"a":1,"a":2}', b"\xff\xfe"])
            return Case(path, struct.pack("<Q", len(meta)) + meta, True, "hostile header json")
        if k == 10:
            bad = r.choice(
                [
                    [[r.choice(HOSTILE_URLS), 0]],
                    [[self.sender, r.choice(BAD_COUNTS[:8])]],
                    [[self.sender, 0, 1]],
                    [self.sender],
                    [[self.sender, 0]] * 100,
                ]
            )
            return Case("/shuffle", self.shuffle(bad), True, "hostile shuffle")
        if k == 11:
            body = r.choice(
                [
                    b"[" * 5000 + b"]" * 5000,
                    b'{"sender": "x", "entries": [["y", ' + b"9" * 5000 + b"]]}",
                    b"NaN",
                    b"",
                    b'{"sender": 1}',
                ]
            )
            return Case("/shuffle", body, True, "shuffle json")
        if k == 12:  # well formed entries never to be contacted, and a hostile sender
            entries = [[u, r.randrange(5)] for u in r.sample(FORBIDDEN_URLS, 2)]
            return Case("/shuffle", self.shuffle(entries), False, "forbidden entries")
        if k == 13:
            return Case("/shuffle", self.shuffle([], sender=r.choice(HOSTILE_URLS)), True, "shuffle sender")
        if k == 14:  # a group slice: refused unless we run group averaging, and then held only for open rounds
            # a round 5 slots gone or 10^9 ahead is never open; one 1 or 3 ahead may open while the
            # request is on its way (the wall clock moves on): any answer but a 5xx
            offset = r.choice([-5, 1, 3, 10**9])
            invalid = self.algorithm != "group_average" or offset in (-5, 10**9)
            return Case("/group", self.slice(round=self.t.wall_step() + offset), invalid, "slice")
        if k == 15:
            changes = r.choice(
                [
                    {"weight": float("nan")},
                    {"weight": -1.0},
                    {"phase": "evil"},
                    {"count": 0},
                    {"sender": "https://user:pw@127.0.0.1:1"},
                    {"members": (self.sender, "x" * 300)},
                ]
            )
            try:
                return Case("/group", self.slice(**changes), True, "bad slice")
            except Exception:  # our own encoder refuses to write it: send garbage instead
                return Case("/group", b"\x00" * 64, True, "bad slice")
        if k == 16:
            offset = r.choice([-5, 1, 10**9])
            invalid = self.algorithm != "secure_groups" or offset in (-5, 10**9)
            return Case("/secure", self.secure(round=self.t.wall_step() + offset), invalid, "secure message")
        if k == 17:
            return Case(r.choice(list(PATHS.values())), self.model(), True, "no token", {"Authorization": ""})
        if k == 18:
            return Case(path, self.model(), True, "wrong token", {"Authorization": "Bearer wrong"})
        if k == 19:
            return Case(path, self.model(sender=self.t.svc.id), True, "from itself")
        if k == 20:
            other = [p for p in PATHS.values() if p != path]
            return Case(r.choice(other), self.model(), True, "another algorithm's route")
        return Case("/dpsgd", self.model(step=r.choice([-1, 10**12, 2**64])), True, "bad step")


async def _send(session: aiohttp.ClientSession, base: str, case: Case, ctx: ssl.SSLContext, res: Result) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/octet-stream", **case.headers}
    if headers["Authorization"] == "":
        del headers["Authorization"]
    res.requests += 1
    res.invalid_sent += case.invalid
    try:
        async with session.post(base + case.path, data=case.body, headers=headers, ssl=ctx) as r:
            body = await r.read()
            res.by_status[r.status] = res.by_status.get(r.status, 0) + 1
            if r.status >= 500 and r.status != 503:
                res.answers_5xx += 1
            if r.status == 503 and not body.startswith(b"{"):
                res.answers_5xx += 1
            if r.status < 300:
                res.accepted_kinds[case.kind] = res.accepted_kinds.get(case.kind, 0) + 1
                if case.invalid:
                    res.invalid_accepted += 1
            elif not (body.startswith(b"{") and b'"error"' in body):
                res.not_json += 1
    except (aiohttp.ClientError, OSError, TimeoutError):
        res.transport_errors += 1  # a connection the peer closed after refusing (oversized, timeouts)


async def _slow_connections(port: int, ctx: ssl.SSLContext, n: int, wait: float) -> tuple[int, int]:
    """``n`` connections that send part of a request's headers and then nothing: how many the
    peer closed within ``wait``."""

    async def one() -> bool:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
        except (OSError, ssl.SSLError):
            return True  # refused at once: closed
        writer.write(b"POST /gossip HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        await writer.drain()
        try:
            data = await asyncio.wait_for(reader.read(), wait)
            closed = True if data == b"" or data else True
        except (TimeoutError, OSError, ssl.SSLError):
            closed = False
        writer.close()
        return closed

    closed = await asyncio.gather(*[one() for _ in range(n)])
    return sum(closed), n


async def _expect_without_token(port: int, ctx: ssl.SSLContext) -> bool:
    """A request asking for ``100 Continue`` without the token gets 401, never a 100."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="127.0.0.1")
    writer.write(b"POST /gossip HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n")
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    return line.startswith(b"HTTP/1.1 401")


async def fuzz_algorithm(algorithm: str, requests: int, tmp: Path, seed: int = 0, slow: int = 20) -> Result:
    """Three peers of ``algorithm``; ``requests`` hostile requests to one of them (see the module docstring)."""
    pki = make_private_ca(tmp)
    sctx, cctx = server_context(pki.cert, pki.key), client_context(pki.ca_cert)
    ports = free_ports(3)
    urls = [f"https://127.0.0.1:{p}" for p in ports]
    peers = [make_peer(algorithm, i, urls[i], tuple(u for u in urls if u != urls[i]), sctx, cctx) for i in range(3)]
    target = peers[0]
    target.guard.header_timeout = 2.0  # the slow-header probe waits for this, not the default's 10 s
    stop = asyncio.Event()
    runs = [asyncio.get_running_loop().create_task(p.run("127.0.0.1", port, stop)) for p, port in zip(peers, ports)]
    res = Result(algorithm)
    try:
        deadline = time.monotonic() + 60
        while target.node.merges < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        res.steps_before, res.merges_before = target.steps, target.node.merges
        cases = Cases(target, algorithm, seed)
        t0 = time.perf_counter()
        conn = aiohttp.TCPConnector(limit=8)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=conn) as session:
            pending: set[asyncio.Task] = set()
            for _ in range(requests):
                if len(pending) >= 8:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                pending.add(asyncio.ensure_future(_send(session, urls[0], cases.draw(), cctx, res)))
            if pending:
                await asyncio.wait(pending)
        res.seconds = time.perf_counter() - t0
        if slow:
            res.slow_closed, res.slow_opened = await _slow_connections(ports[0], cctx, slow, 6.0)
        res.expect_unauthorized = await _expect_without_token(ports[0], cctx)
        deadline = time.monotonic() + 30  # honest training and merges go on
        while time.monotonic() < deadline and not (
            target.steps > res.steps_before + 2 and target.node.merges > res.merges_before
        ):
            await asyncio.sleep(0.2)
        params = target.node.params
        res.model_finite = bool(torch.isfinite(params).all())
        res.model_max_abs = float(params.abs().max())
        res.within_max_abs = res.model_max_abs <= target.g.max_abs
        others = [float(torch.linalg.vector_norm(p.node.params)) for p in peers if p is not target]
        res.norm_ratio = float(torch.linalg.vector_norm(params)) / max(others + [1e-12])
        res.steps_after, res.merges_after = target.steps, target.node.merges
        res.peer_errors = sum(p.errors for p in peers)
        res.peers_up = not any(t.done() for t in runs)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 30)
    return res
