"""An edge's HTTP side towards its parent: POST the partial until the parent answers.

The partial goes to ``{parent}/v1/partial`` (docs/protocol.md) on the schedule of
server/edge/rounds.py's :class:`~shoal.server.edge.rounds.Retransmit`: at once, then again after 0.5 s,
doubling to 8 s, while no answer comes (a refused or dropped connection, a timeout, a 429 or a
5xx). Sending it again is safe: the parent answers a partial it already took as a
``duplicate`` and counts it once. A 200 (``accepted`` or ``duplicate``) ends it; any other 4xx
is the parent's verdict on the partial (stale, conflicting, malformed, not an edge) and is
final: :class:`PartialRefused`. Past ``give_up_at`` (the root's deadline: the round is over
there) it stops with :class:`UplinkGaveUp`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp

from .rounds import Retransmit

log = logging.getLogger(__name__)


class PartialRefused(RuntimeError):
    """The parent refused the partial (a 4xx other than 429): sending it again would not help."""

    def __init__(self, status: int, answer: dict[str, Any]):
        super().__init__(f"parent refused the partial ({status} {answer.get('error')}): {answer.get('detail')}")
        self.status, self.answer = status, answer


class UplinkGaveUp(RuntimeError):
    """No answer from the parent before ``give_up_at``."""


async def send_partial(
    http: aiohttp.ClientSession,
    parent: str,
    body: bytes,
    *,
    give_up_at: float | None = None,
    first_s: float = 0.5,
    max_s: float = 8.0,
    attempt_timeout_s: float = 30.0,
    path: str = "/v1/partial",
) -> dict[str, Any]:
    """POST ``body`` (an encoded partial; a masked sum to ``/v1/edge/secagg/masked_sum``) to ``parent``
    until it answers; its JSON answer. ``give_up_at`` is on the event loop's clock (``loop.time()``)."""
    loop = asyncio.get_running_loop()
    retry = Retransmit(loop.time(), give_up_at, first_s, max_s)
    last = "no attempt"
    while True:
        now = loop.time()
        if give_up_at is not None and now > give_up_at:
            raise UplinkGaveUp(f"no answer from {parent} after {retry.attempts} attempt(s); last: {last}")
        if not retry.due(now):
            await asyncio.sleep(max(0.0, retry.next_at - now))
            continue
        retry.sent(now)
        try:
            async with (
                asyncio.timeout(attempt_timeout_s),
                http.post(
                    parent.rstrip("/") + path,
                    data=body,
                    headers={"Content-Type": "application/octet-stream"},
                ) as r,
            ):
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError) as e:
            last = f"{type(e).__name__}: {e}"
            continue  # lost on the way, or its answer was: the parent dedups the next one
        try:
            answer = json.loads(text)
        except ValueError:
            answer = {"error": "not_json", "detail": text[:200]}
        if status == 200:
            retry.answered()
            return answer
        if status == 429 or status >= 500:
            last = f"{status} {answer.get('error')}"
            continue
        retry.answered()
        raise PartialRefused(status, answer)
