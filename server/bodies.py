"""A request body read whole, bounded in size and in time.

The small bodies of the protocol (a node's report, an edge's poll, a relayed secure aggregation
message, an upload at an edge) are read into memory in one piece. :func:`read_body` checks,
before a byte is read, that the request says how long its body is (``411 length_required``) and
that this is within the route's limit (``413 too_large``, answered at once and hung up on: the
rest is never read), then reads it within a timeout (``408``, hung up on). Each route passes its
own limit, timeout and the name of the setting the timeout comes from (the 408's code is that
name: ``body_timeout`` for ``server.body_timeout_s``). Every refusal is a :class:`~.app.Refusal`,
answered as JSON by the server's last middleware; ``refused`` (the service's refusal counter)
counts it too where the route counts its refusals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from shoal.strict_json import loads_strict

from .http_common import Refusal, settings_of


async def read_body(
    request: web.Request,
    limit: int,
    timeout_s: float,
    *,
    timeout_key: str = "body_timeout_s",
    what: str = "body",
    refused: Callable[[str], None] | None = None,
) -> bytes:
    """The body of ``request``, at most ``limit`` bytes, read within ``timeout_s`` seconds (the
    value of ``server.{timeout_key}``); ``what`` names it in the refusals' details."""

    def refuse(status: int, code: str, detail: str, close: bool = False) -> Refusal:
        if refused is not None:
            refused(code)
        return Refusal(status, code, detail, close=close)

    length = request.content_length
    if length is None:
        raise refuse(411, "length_required", f"send the {what} with a Content-Length header")
    if length > limit:
        raise refuse(413, "too_large", f"{what} of {length} bytes is over the limit of {limit} bytes", close=True)
    try:
        async with asyncio.timeout(timeout_s):
            body = await request.read()
    except TimeoutError:
        code = timeout_key.removesuffix("_s")
        raise refuse(408, code, f"the {what} did not arrive in server.{timeout_key}", close=True) from None
    if len(body) != length:  # aiohttp reads exactly Content-Length bytes; a short body is refused, never parsed
        raise refuse(400, "malformed", f"{what} of {len(body)} bytes, not its Content-Length of {length}")
    return body


async def json_body(request: web.Request, limit: int) -> object:
    body = await read_body(request, limit, settings_of(request).server.body_timeout_s)
    try:
        return loads_strict(body)
    except ValueError as e:
        raise Refusal(400, "malformed", f"the body is not JSON: {e}"[:200]) from None
