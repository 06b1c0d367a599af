"""How the body of an upload is read: an invitation before ``100 Continue``, a preallocated
buffer once bytes flow, a cap on each node's uploads in flight, and timeouts and a minimum rate
while it arrives (so slow or silent clients cannot hold the server's memory)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager

from aiohttp import web

from shoal.errors import TooLarge

from .app_base import authenticate_node
from .http_common import CHANGED, NODE, Refusal, error, gone, svc_of

log = logging.getLogger(__name__)


class Slot:
    """One preallocated body buffer, given back exactly once: by the handler, or, should
    the connection drop before the handler runs, when the connection's task ends."""

    def __init__(self, queue: asyncio.Queue, buf: bytearray):
        self.queue = queue
        self.buf: bytearray | None = buf
        self.task = asyncio.current_task()
        if self.task is not None:
            self.task.add_done_callback(self._on_task_done)

    def _on_task_done(self, _task: asyncio.Task) -> None:
        self.release()

    def release(self) -> None:
        if self.buf is not None:
            self.queue.put_nowait(self.buf)
            self.buf = None
            if self.task is not None:  # a keep-alive connection's task serves many requests
                self.task.remove_done_callback(self._on_task_done)


INVITE = web.RequestKey("invite", Slot)


@contextmanager
def upload_of(request: web.Request):
    """Count the node's uploads in flight; 429 above server.uploads_per_node."""
    node, svc = request[NODE], svc_of(request)
    uploads: dict[str, int] = request.app[CHANGED]["uploads"]
    limit = svc.cfg.server.uploads_per_node
    if uploads.get(node, 0) >= limit:
        svc.refused("too_many_uploads")
        raise Refusal(
            429, "too_many_uploads", f"node {node!r} already has {limit} uploads in flight (server.uploads_per_node)"
        )
    uploads[node] = uploads.get(node, 0) + 1
    try:
        yield
    finally:
        uploads[node] -= 1
        if not uploads[node]:
            del uploads[node]


def check_length(request: web.Request) -> int:
    svc = svc_of(request)
    length = request.content_length
    if length is None:
        svc.refused("length_required")
        raise Refusal(411, "length_required", "send the body with a Content-Length header")
    if length > svc.max_body_bytes:
        svc.refused(TooLarge.code)
        raise Refusal(413, TooLarge.code, f"body of {length} bytes is over the limit of {svc.max_body_bytes} bytes")
    return length


async def first_chunk(request: web.Request, timeout: float, what: str) -> bytes:
    try:
        async with asyncio.timeout(timeout):
            return await request.content.readany()
    except TimeoutError:
        svc_of(request).refused("body_timeout")
        raise Refusal(
            408, "body_timeout", f"{what}: no body bytes for {timeout:g} s (server.body_timeout_s)", close=True
        ) from None


async def read_into(request: web.Request, view: memoryview, length: int, first: bytes) -> None:
    """Fill ``view[:length]``, starting with ``first``: each wait for bytes bounded by
    server.body_timeout_s, the whole body by server.upload_timeout_s and by the open round's
    deadline (a held buffer never outlives its round), and after server.upload_grace_s the
    bytes so far must keep server.min_upload_rate (a slow drip cannot hold a buffer)."""
    svc, node = svc_of(request), request[NODE]
    s = svc.cfg.server
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + s.upload_timeout_s
    # a plain sync round closes at its deadline (a secure round's stages keep their own clocks)
    plain_round = svc.sync is not None and svc.sync.open and svc.secure_round is None
    left_in_round = svc.rounds.time_left(time.monotonic()) if plain_round else None
    if left_in_round is not None:
        deadline = min(deadline, start + left_in_round + 1.0)
    got, quiet_since = 0, start
    chunk: bytes | None = first
    while True:
        if chunk:
            if got + len(chunk) > length:
                raise Refusal(400, "malformed", f"body is longer than its Content-Length of {length} bytes", close=True)
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
            quiet_since = loop.time()
            if got == length:
                break
        elif chunk is not None:  # b"": the body ended
            break
        now = loop.time()
        if now - quiet_since >= s.body_timeout_s:
            svc.refused("body_timeout")
            raise Refusal(
                408,
                "body_timeout",
                f"upload: no body bytes for {s.body_timeout_s:g} s (server.body_timeout_s)",
                close=True,
            )
        elapsed = now - start
        if s.min_upload_rate and elapsed > s.upload_grace_s and got < s.min_upload_rate * elapsed:
            svc.refused("too_slow")
            raise Refusal(
                408,
                "too_slow",
                f"upload sent {got} bytes in {elapsed:.1f} s, below server.min_upload_rate = "
                f"{s.min_upload_rate:g} bytes/s after the {s.upload_grace_s:g} s grace",
                close=True,
            )
        horizon = svc.upload_horizon(node, time.monotonic()) if got and elapsed > s.upload_grace_s else None
        if horizon is not None and (length - got) * elapsed / got > horizon:
            svc.refused("too_slow")
            raise Refusal(
                408,
                "too_slow",
                f"at {got / elapsed:.0f} bytes/s this upload ends after its task is more than "
                f"asynchronous.max_staleness versions old (in about {max(horizon, 0.0):.1f} s at the recent pace "
                "of versions), when it would be refused: ask for a new task, or send faster",
                close=True,
            )
        if now >= deadline:
            svc.refused("upload_timeout")
            raise Refusal(
                408,
                "upload_timeout",
                f"body not complete after {elapsed:.1f} s (server.upload_timeout_s, or the round's deadline)",
                close=True,
            )
        wait = min(s.body_timeout_s - (now - quiet_since), deadline - now)
        if s.min_upload_rate:  # wake in time to check the rate, not only at body_timeout_s
            wait = min(wait, max(s.upload_grace_s - elapsed, 0.0) + 0.5)
        # bytes already buffered are taken at once; only an empty buffer is waited on
        chunk = request.content.read_nowait() or await _next_chunk(request, max(wait, 0.01))
    if got < length:
        svc.refused("malformed")
        raise Refusal(400, "malformed", f"body ended after {got} of {length} bytes (truncated)")


async def _next_chunk(request: web.Request, timeout: float) -> bytes | None:
    """The next body bytes (b"" at the end), or None if none came within ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            return await request.content.readany()
    except TimeoutError:
        return None


async def take_buffer(request: web.Request, pool: str) -> Slot:
    """A free body buffer (``pool = "slots"``) or upload invitation (``"invites"``); 503
    (retry later) if none frees up within server.upload_timeout_s."""
    s = svc_of(request).cfg.server
    queue: asyncio.Queue = request.app[CHANGED][pool]
    try:
        async with asyncio.timeout(s.upload_timeout_s):
            return Slot(queue, await queue.get())
    except TimeoutError:
        svc_of(request).refused("busy")
        raise Refusal(
            503, "busy", f"every one of the {queue.maxsize} upload {pool} stayed taken; try again later", close=True
        ) from None


async def invited(request: web.Request) -> Slot:
    """The upload's invitation: taken before ``100 Continue`` (or, without Expect, before
    its body is read). Invitations cost no memory and are INVITES_PER_SLOT x ingest_slots
    many, so clients that send headers and then no body cannot stop others' uploads (each
    holds one for at most server.body_timeout_s, a node at most server.uploads_per_node);
    they bound the bodies in flight, so waiting uploads cost nothing (they do not send)."""
    invite = request.get(INVITE)
    if invite is None or invite.buf is None:
        invite = request[INVITE] = await take_buffer(request, "invites")
    return invite


async def expect_update(request: web.Request) -> web.Response | None:
    """``Expect: 100-continue``: check token, size and the node's uploads in flight before
    the node sends its body. No buffer is taken here: a client that never sends its body
    holds nothing (post_update takes a buffer once bytes flow)."""
    try:
        refused = authenticate_node(request)
        if refused is not None:
            return refused
        check_length(request)
        node = request[NODE]
        if request.app[CHANGED]["uploads"].get(node, 0) >= svc_of(request).cfg.server.uploads_per_node:
            svc_of(request).refused("too_many_uploads")
            return error(
                429, "too_many_uploads", f"node {node!r} has too many uploads in flight (server.uploads_per_node)"
            )
    except Refusal as e:
        return error(e.status, e.code, e.detail)
    except Exception:  # runs outside the middlewares: its own last line
        log.exception("unexpected error in the 100-continue check of %s", request.path)
        return error(500, "internal", "the server hit an unexpected error; nothing was applied (see its log)")
    try:
        await invited(request)
    except Refusal as e:
        return error(e.status, e.code, e.detail)
    transport = request.transport
    if gone(request) or transport is None:
        return error(400, "disconnected", "the connection was lost")
    if request.version >= (1, 1):
        transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    return None
