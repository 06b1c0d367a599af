"""Secure aggregation through edge aggregators (docs/hierarchy.md, "Secure aggregation through edges").

The round's whole cohort runs one protocol with the root (server/secure_round.py; the mask graph
spans every node under every edge). An edge in between (aggregation/secagg/tiers.py):

* relays ``POST /v1/secagg/{stage}`` and ``GET /v1/secagg/{stage}`` of its nodes to the root's
  ``/v1/edge/secagg/{stage}?node=NAME`` and the answers back: public keys, share ciphertexts
  under pair keys only the nodes agree, survivor lists, and unmasking answers sealed to the
  root's key of the round (the ``root_key`` of the task). Nothing it relays opens for it;
* keeps its nodes' masked inputs: it adds them modulo 2^32 (:class:`EdgeMaskedSum`) and sends
  the root one masked sum (``POST /v1/edge/secagg/masked_sum``) naming the nodes inside, when
  every node it relayed into the round sent one or the masked stage is about to close at the
  root (``secure_aggregation.stage_s`` less ``hierarchy.edge_margin_s`` after the first share
  delivery it relayed).

The root takes that sum as if each node had sent its own masked input, each node at most once,
and only from the edge that speaks for it in the round (server/edge/intake.py's EdgeRoster). A sum that
never comes (the edge died, or dropped it) leaves its nodes as the protocol's drop-outs.

:class:`EdgeRelay` is the edge's state without I/O; the edge's aiohttp handlers follow. The root's
side (its routes for relayed messages and masked sums) is server/partial_routes.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from shoal.aggregation.secagg import MaskedInput, SecAggProtocolError
from shoal.aggregation.secagg.tiers import EdgeMaskedSum
from shoal.aggregation.secagg.wire import decode_message, encode_message, params_from_json
from shoal.errors import Malformed, ShoalError, UpdateRejected
from shoal.metrics import json_safe
from shoal.wire import MAX_HEADER_BYTES

from ..bodies import read_body
from ..http_common import NODE, SETTINGS, error, integer_param, notify, seconds_param, status_of

log = logging.getLogger(__name__)

RELAYED = ("keys", "shares", "consistency", "unmask")  # what an edge forwards (masked inputs it adds)


def body_limit(vector_size: int) -> int:
    """The largest secure aggregation message of a round (a masked vector and a header)."""
    return 4 * vector_size + 4 * MAX_HEADER_BYTES


# --- the edge's side ---------------------------------------------------------------------------------


class EdgeRelay:
    """An edge's part in the secure rounds of its root, without I/O (time passed in as ``now``)."""

    def __init__(self, stage_s: float, margin_s: float):
        self.stage_s, self.margin_s = stage_s, margin_s
        self.key: tuple[int, int] | None = None  # (round, version) of the open secure round
        self.info: dict[str, Any] = {}  # the root's secure_aggregation task fields, handed to the nodes
        self.vector_size = 0
        self.nodes: set[str] = set()
        self.joined: set[str] = set()  # the root took their keys
        self.out: set[str] = set()  # the root refused one of their messages: out of the round
        self.sum: EdgeMaskedSum | None = None
        self.close_at: float | None = None
        self.sent = False
        self.taken = 0  # masked inputs added since the start

    @property
    def round(self) -> int:
        return self.key[0] if self.key is not None else -1

    def start(self, round_: int, version: int, nodes: list[str], info: object, now: float) -> None:
        """A new root round; ``info``: its secure_aggregation fields (None: a plain round)."""
        self.check_info(info)  # nothing changes if the root's fields are refused
        self.key, self.nodes = (round_, version), set(nodes)
        self.joined, self.out, self.sent, self.close_at = set(), set(), False, None
        if not isinstance(info, dict):
            self.info, self.vector_size, self.sum = {}, 0, None
            return
        self.info, self.vector_size = dict(info), int(info["vector_size"])
        self.sum = EdgeMaskedSum("", self.vector_size, nodes)
        stage_s = info.get("stage_s", self.stage_s)
        if isinstance(stage_s, (int, float)) and not isinstance(stage_s, bool) and stage_s > 0:
            self.stage_s = float(stage_s)

    @staticmethod
    def check_info(info: object) -> None:
        """Malformed unless ``info`` is None or a secure round an edge can relay."""
        if info is None:
            return
        if not isinstance(info, dict):
            raise Malformed("the root's secure_aggregation fields are not an object")
        params = params_from_json(info)  # Malformed if anything is off
        if params.malicious:
            raise Malformed("the root runs the malicious-server variant, which edges do not relay")
        if not isinstance(info.get("root_key"), str):
            raise Malformed("the root's secure round has no root_key: the nodes' unmasking answers would pass in clear")

    @property
    def secure(self) -> bool:
        return self.sum is not None

    def wants_task(self, node: str) -> bool:
        """Hand a secure round's task out only until the node joined the protocol."""
        return not self.secure or node not in self.joined

    def check(self, node: str) -> None:
        if not self.secure:
            raise UpdateRejected("round_closed", "this edge has no open secure round")
        if node not in self.nodes:
            raise UpdateRejected("not_selected", f"node {node!r} has no part in round {self.round} here")

    def answered(self, node: str, stage: str, status: int, now: float) -> None:
        """The root's answer to a message of ``node`` this edge relayed (or a reply it fetched)."""
        if status >= 400:
            self.out.add(node)
        elif stage == "keys" and status == 200:
            self.joined.add(node)

    def delivered(self, now: float) -> None:
        """A share delivery went to a node: the root's masked stage is open; its clock started."""
        if self.close_at is None:
            self.close_at = now + max(self.stage_s - self.margin_s, self.stage_s / 2)

    def add(self, node: str, body: bytes) -> dict[str, Any]:
        """One node's masked input into the edge's sum; a ShoalError with nothing changed if refused."""
        self.check(node)
        assert self.sum is not None
        if self.sent:
            raise UpdateRejected("round_closed", f"this edge sent its masked sum of round {self.round} already")
        msg = decode_message(body, self.vector_size, body_limit(self.vector_size))
        if not isinstance(msg, MaskedInput):
            raise Malformed("POST /v1/secagg/masked takes a MaskedInput message")
        if msg.sender != node:
            raise Malformed(f"message sender {msg.sender!r} is not the authenticated node {node!r}")
        try:
            self.sum.add(msg)
        except SecAggProtocolError as e:
            raise UpdateRejected("duplicate" if "already" in str(e) else "not_selected", str(e)) from None
        self.taken += 1
        return {"status": "accepted", "round": self.round, "stage": "masked"}

    def due(self, now: float) -> bool:
        """The masked sum goes up: every node relayed into the round sent its masked input (or is
        out), or the root's masked stage is about to close."""
        if not self.secure or self.sent or self.sum is None or not self.sum.senders:
            return False
        waiting = self.joined - self.out - set(self.sum.senders)
        return not waiting or (self.close_at is not None and now >= self.close_at)

    def take_sum(self, edge: str) -> tuple[bytes, int]:
        """The body of the masked sum to send up and the nodes inside; the sum is closed."""
        assert self.sum is not None
        part = self.sum.sealed()
        assert part is not None
        self.sent = True
        body = encode_message(type(part)(edge, part.senders, part.vector), {"round": self.round})
        return body, len(part.senders)


class RelayLink:
    """The edge's HTTP side of the relay: forwards to the root, sends the masked sum up."""

    def __init__(self, relay: EdgeRelay, heard: Callable[[str, float], None] = lambda node, now: None):
        """``heard(node, now)``: a node spoke to this edge (a node busy in the protocol's stages
        polls no task, yet it is connected: the edge keeps naming it to its root)."""
        self.relay = relay
        self.heard = heard
        self.http: aiohttp.ClientSession | None = None
        self.parent = ""
        self.name = lambda: ""
        self.metrics: Path | None = None

    def attach(self, http: aiohttp.ClientSession, parent: str, name, metrics: Path) -> None:
        """The edge's session with its root (its token and TLS context), once it is made."""
        self.http, self.parent, self.name, self.metrics = http, parent.rstrip("/"), name, metrics

    async def forward(self, method: str, stage: str, params: dict[str, str], body: bytes | None) -> web.Response:
        if self.http is None:
            return web.json_response(
                {"error": "not_ready", "detail": "this edge is not connected to its root"}, status=503
            )
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        async with self.http.request(
            method, f"{self.parent}/v1/edge/secagg/{stage}", params=params, data=body, headers=headers
        ) as r:
            payload = await r.read()
            return web.Response(status=r.status, body=payload, content_type=r.content_type)

    async def send_sums(self, stop: asyncio.Event, changed) -> None:
        """Send the masked sum up when it is due, retransmitted until the root answers."""
        from .partial_sender import PartialRefused, UplinkGaveUp, send_partial

        assert self.http is not None
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            now = time.monotonic()
            if self.relay.due(now):
                round_ = self.relay.round
                body, nodes = self.relay.take_sum(self.name())
                changed()
                record: dict[str, Any] = {"edge": self.name(), "round": round_, "secure": True, "nodes_in": nodes}
                record["masked_sum_bytes"] = len(body)
                # past the root's masked-stage deadline the sum is of no use (loop clock)
                give_up = None
                if self.relay.close_at is not None:
                    give_up = loop.time() + (self.relay.close_at + 2 * self.relay.margin_s - time.monotonic())
                try:
                    path = "/v1/edge/secagg/masked_sum"
                    answer = await send_partial(self.http, self.parent, body, give_up_at=give_up, path=path)
                    record["answer"] = answer.get("status")
                    log.info("round %d: masked sum of %d nodes %s by the root", round_, nodes, answer.get("status"))
                except (PartialRefused, UplinkGaveUp) as e:
                    record["answer"] = "refused" if isinstance(e, PartialRefused) else "gave_up"
                    log.warning("round %d: masked sum of %d nodes not taken: %s", round_, nodes, e)
                if self.metrics is not None:
                    with self.metrics.open("a") as f:
                        f.write(json.dumps(json_safe(record)) + "\n")
            await asyncio.sleep(0.05)


RELAY = web.AppKey("relay", RelayLink)


async def edge_post_secagg(request: web.Request) -> web.Response:
    """A node's ``POST /v1/secagg/{stage}`` at its edge: masked inputs are added here, the rest relayed."""
    link, node = request.app[RELAY], request[NODE]
    relay, stage = link.relay, request.match_info["stage"]
    link.heard(node, time.monotonic())
    try:
        relay.check(node)
        body = await read_body(request, body_limit(relay.vector_size), request.app[SETTINGS].server.body_timeout_s)
        if stage == "masked":
            result = relay.add(node, body)
            notify(request.app)
            return web.json_response(result)
        if stage not in RELAYED:
            raise UpdateRejected("unknown_stage", f"{stage!r} is not a secure aggregation stage")
    except ShoalError as e:
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    try:
        answer = await link.forward("POST", stage, {"node": node}, body)
    except (aiohttp.ClientError, TimeoutError) as e:
        return error(503, "root_unreachable", f"the root did not answer: {type(e).__name__}")
    relay.answered(node, stage, answer.status, time.monotonic())
    return answer


async def edge_get_secagg(request: web.Request) -> web.Response:
    """A node's long-poll ``GET /v1/secagg/{stage}`` at its edge, relayed to the root."""
    link, node = request.app[RELAY], request[NODE]
    relay, stage = link.relay, request.match_info["stage"]
    link.heard(node, time.monotonic())
    try:
        relay.check(node)
    except ShoalError as e:
        return error(status_of(e), getattr(e, "code", "error"), str(e))
    round_ = integer_param(request, "round")
    wait = seconds_param(request, "wait", 10.0)
    try:
        answer = await link.forward("GET", stage, {"node": node, "round": str(round_), "wait": f"{wait:g}"}, None)
    except (aiohttp.ClientError, TimeoutError) as e:
        return error(503, "root_unreachable", f"the root did not answer: {type(e).__name__}")
    now = time.monotonic()
    link.heard(node, now)  # a long poll: the node was there all along
    relay.answered(node, stage, answer.status, now)
    if stage == "shares" and answer.status == 200:
        relay.delivered(now)
    return answer
