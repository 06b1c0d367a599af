"""Moving a model or an update larger than one request between a node and the server, in chunks.

Downloads (GET /v1/model with ``Range``): the node asks for one byte range at a time, checks
each against the SHA-256 the server sends with it, writes it into one preallocated buffer at its
offset, and after a lost connection asks again from the offset it has (resumable); the first
answer names the version (ETag) and the whole model's SHA-256, later ones must be of the same
version (``If-Match``; 412 when the model moved on: start over), and the whole is checked at the
end. The buffer is the only copy: the parameters are decoded as a view of it.

Uploads (docs/protocol.md, "Chunked uploads"): :class:`Body` is the update as parts (its header
and the delta's own memory, shoal.wire.update_parts), hashed and sliced into chunks without
being joined, so a node holds its update once plus one chunk.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
from collections.abc import Sequence

import aiohttp

from shoal.diskfile import UnnamedFile

from .http import Backoff, Retry, check_response

CHUNK_DIGEST_HEADER = "X-Shoal-Chunk-Sha256"  # each chunk of a chunked upload or download
MODEL_DIGEST_HEADER = "X-Shoal-Sha256"  # the whole model, with every download answer
MAX_RESUMES = 20  # lost connections one download goes on from before it gives up (then the task is retried)
log = logging.getLogger(__name__)
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+)")


class Body:
    """An upload's bytes as parts (bytes or memoryviews), never joined."""

    def __init__(self, parts: Sequence[bytes | bytearray | memoryview]):
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.size = sum(len(p) for p in self.parts)

    def __len__(self) -> int:
        return self.size

    def sha256(self) -> str:
        h = hashlib.sha256()
        for p in self.parts:
            h.update(p)
        return h.hexdigest()

    def slice(self, start: int, end: int) -> bytearray:
        """Bytes ``[start, end)``: one chunk, copied once to be sent."""
        out = bytearray(max(end - start, 0))
        base, at = 0, 0
        for p in self.parts:
            a, b = max(start - base, 0), min(end - base, len(p))
            if a < b:
                out[at : at + b - a] = p[a:b]
                at += b - a
            base += len(p)
        return out

    def chunk(self, start: int, end: int) -> memoryview | bytearray:
        """Bytes ``[start, end)`` to send: a view of the update's own memory when they lie in one part
        (every chunk of a large update but the first: no copy), else :meth:`slice`."""
        base = 0
        for p in self.parts:
            if base <= start and end <= base + len(p):
                return p[start - base : end - base]
            base += len(p)
        return self.slice(start, end)

    def whole(self) -> bytearray:
        """The body in one buffer (an update small enough for one request)."""
        return self.slice(0, self.size)


async def read_into(resp: aiohttp.ClientResponse, view: memoryview) -> None:
    """The response's body into ``view``, exactly (Retry if it is shorter or longer)."""
    got = 0
    while True:
        data = await resp.content.readany()
        if not data:
            break
        if got + len(data) > len(view):
            raise Retry(f"the server sent more than the {len(view)} bytes it announced")
        view[got : got + len(data)] = data
        got += len(data)
    if got != len(view):
        raise Retry(f"the answer ended after {got} of {len(view)} bytes")


class OnDisk(UnnamedFile):
    """A downloaded model in an unnamed temporary file (shoal/diskfile.py): a large model's bytes
    cost disk and page cache the kernel may evict, not resident memory. Read back a block at a
    time (:meth:`read_at`)."""

    def __init__(self, size: int, dir: str | None = None):
        super().__init__(size, dir, "the downloaded model")


async def download(
    http: aiohttp.ClientSession,
    url: str,
    ssl,
    headers: dict[str, str],
    limit: int,
    chunk: int | None,
    rand: random.Random,
    resumed: dict[str, int] | None = None,
    to_disk: bool = False,
) -> tuple[bytearray | OnDisk, str] | None:
    """The model at ``url`` into one buffer, whole (``chunk`` None) or by ranges of ``chunk``
    bytes resumed after lost connections; ``(body, etag)``, or None on 304 (``headers`` may
    hold If-None-Match). At most ``limit`` bytes are taken. Retry on what retrying may fix.
    ``to_disk`` (with ``chunk``): each checked range goes to an :class:`OnDisk` file instead of
    memory, so the node holds one range of the model, not the model."""
    buf: bytearray | OnDisk | None = None
    etag, whole, offset, size = "", "", 0, 0
    backoff, resumes = Backoff(), 0
    running = hashlib.sha256()  # the whole model's digest, range by range in order
    scratch = bytearray(chunk) if to_disk and chunk is not None else None  # one range, reused
    while True:
        ask = dict(headers) if buf is None else {"If-Match": etag}
        if chunk is not None:
            end = offset + chunk if buf is None else min(offset + chunk, size)
            ask["Range"] = f"bytes={offset}-{end - 1}"
        try:
            async with http.get(url, headers=ask, ssl=ssl) as resp:
                if resp.status == 304:
                    return None
                if resp.status == 412:  # a new version while we read the old one: start over
                    if isinstance(buf, OnDisk):
                        buf.close()
                    buf, offset, running = None, 0, hashlib.sha256()
                    continue
                await check_response(resp)
                start, stop, total = _span(resp)
                if buf is None:
                    if total > limit:
                        raise Retry(f"the server's model is {total} bytes, over this node's limit of {limit}")
                    if start != 0:
                        raise Retry(f"the first range starts at byte {start}, not 0")
                    buf, size = (OnDisk(total) if scratch is not None else bytearray(total)), total
                    etag, whole = resp.headers.get("ETag", ""), resp.headers.get(MODEL_DIGEST_HEADER, "")
                elif start != offset or total != size or resp.headers.get("ETag", "") != etag:
                    raise Retry(f"asked for byte {offset} of {etag}, got {start} of {resp.headers.get('ETag')}")
                if isinstance(buf, OnDisk):
                    if scratch is None or stop - start > len(scratch):
                        raise Retry(f"the server sent a range of {stop - start} bytes, over the {chunk} asked for")
                    piece = memoryview(scratch)[: stop - start]
                else:
                    piece = memoryview(buf)[start:stop]
                await read_into(resp, piece)
                digest = resp.headers.get(CHUNK_DIGEST_HEADER)
                if digest is not None and hashlib.sha256(piece).hexdigest() != digest:
                    raise aiohttp.ClientPayloadError(f"bytes {start}..{stop} do not match their SHA-256")
                if isinstance(buf, OnDisk):
                    buf.write_at(start, piece)
                running.update(piece)
                offset = stop
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            resumes += 1
            if buf is None or chunk is None or resumes > MAX_RESUMES:
                raise Retry(f"model download failed at byte {offset}: {type(e).__name__}: {e}") from None
            await asyncio.sleep(backoff.next(rand))  # then on from the offset we have
            log.info("model download resumes at byte %d of %d (%s: %s)", offset, size, type(e).__name__, e)
            if resumed is not None:
                resumed["download"] = resumed.get("download", 0) + 1
            continue
        backoff.reset()
        if offset == size:
            break
    assert buf is not None  # the loop ends only once a first answer made it
    if whole and running.hexdigest() != whole:
        if isinstance(buf, OnDisk):
            buf.close()
        raise Retry("the downloaded model does not match its SHA-256; downloading it again")
    return buf, etag


def _span(resp: aiohttp.ClientResponse) -> tuple[int, int, int]:
    """``(start, stop, total)`` of an answer's bytes: its Content-Range (206) or the whole (200: also
    a server that ignores Range, whose whole is taken on a first request)."""
    if resp.status == 206:
        m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
        if m is None:
            raise Retry(f"a 206 answer without a valid Content-Range: {resp.headers.get('Content-Range')!r}")
        a, b, total = (int(x) for x in m.groups())
        if not a <= b < total:
            raise Retry(f"Content-Range {a}-{b}/{total} is not a range of the model")
        return a, b + 1, total
    if resp.status != 200 or resp.content_length is None:
        raise Retry(f"the model answer has status {resp.status} and no Content-Length")
    return 0, resp.content_length, resp.content_length
