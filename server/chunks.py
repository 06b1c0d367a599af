"""Chunked uploads: an update larger than one request (``server.max_body_bytes``) travels in chunks.

Bookkeeping with time passed in; server/app.py moves the bytes. A node opens an upload with the
whole body's size and SHA-256, then sends the body in order, each chunk at most ``chunk_bytes``
with its own SHA-256, at the offset the server has (a chunk at another offset is refused with
the offset to resume from: after a lost connection the node asks for it and goes on). A chunk
whose digest does not match changes nothing. A chunk that matches is checked as part of the
update at once (shoal.wire.UpdateStream: the header as soon as it is complete, then every value
of a dense or half-precision delta): a bad update is refused at its first bad chunk and the
upload is over. Good chunks wait in the upload's staging file (server/staging.py: disk, not
memory). When the last byte arrives the whole digest is checked and the upload is handed to
the service, which reads it back a block at a time into the round's sum (or whole, for the
encodings decoded whole). An upload not finished by its deadline (``server.upload_timeout_s``,
and the open round's deadline) is dropped with its file. At most ``max_sessions`` uploads are
open at once, one per node, each only while its node holds a task in that run; memory is one
chunk per upload being sent, whatever the model's size.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import ShoalError, WireError
from shoal.wire import UpdateStream

from .staging import Staged

_HEX64 = re.compile(r"[0-9a-f]{64}")
MAX_BEGIN_BODY = 1024


class ChunkError(ShoalError):
    """A chunked-upload request refused with nothing changed; ``status`` is the HTTP status."""

    def __init__(self, code: str, detail: str, status: int, **extra: Any):
        super().__init__(detail)
        self.code, self.status, self.extra = code, status, extra


@dataclass
class Session:
    id: str
    owner: tuple[str, str]  # (run, node)
    size: int
    sha256: str
    deadline: float
    staged: Staged
    stream: UpdateStream
    received: int = 0
    busy: bool = False  # a chunk is being read into it
    hasher: Any = field(default_factory=hashlib.sha256)
    last: tuple[int, int, str] | None = None  # (offset, length, SHA-256) of the last chunk taken


class ChunkedUploads:
    """The open chunked uploads of one server (all its runs)."""

    def __init__(self, max_sessions: int, staging_dir: str | None = None):
        self.max_sessions = max_sessions
        self.staging_dir = staging_dir  # where the staging files are (None: the system's temporary directory)
        self.sessions: dict[str, Session] = {}
        self.repeats = 0  # chunks sent again after their answer was lost (check_chunk), answered, not refused

    def begin(
        self,
        run: str,
        node: str,
        obj: Any,
        limit: int,
        now: float,
        deadline: float,
        make_stream: Callable[[int], UpdateStream],
    ) -> Session:
        """Open an upload from ``{"size": n, "sha256": hex}`` (parsed JSON); a node's earlier open
        upload (in any run: one per node) is dropped (it starts over). ``make_stream(size)``: the
        checker of the run's updates. The caller checked that the node holds a task in ``run``."""
        if not isinstance(obj, dict) or set(obj) != {"size", "sha256"}:
            raise ChunkError("malformed", 'send exactly {"size": bytes, "sha256": "64 hex digits"}', 400)
        size, digest = obj["size"], obj["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ChunkError("malformed", "size must be an integer >= 1 (the whole update's bytes)", 400)
        if size > limit:
            raise ChunkError("too_large", f"an update of {size} bytes is over this run's limit of {limit} bytes", 413)
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ChunkError("malformed", "sha256 must be 64 lowercase hex digits (the whole update's)", 400)
        self.expire(now)
        mine = [s for s in self.sessions.values() if s.owner[1] == node]
        if any(s.busy for s in mine):
            raise ChunkError("busy", "a chunk of this node's open upload is still being read; try again", 409)
        for s in mine:
            self.drop(s)
        if len(self.sessions) >= self.max_sessions:
            raise ChunkError(
                "busy", f"all {self.max_sessions} chunked uploads are open (server.ingest_slots); try later", 503
            )
        stream = make_stream(size)
        session = Session(
            secrets.token_hex(16), (run, node), size, digest, deadline, Staged(size, self.staging_dir), stream
        )
        self.sessions[session.id] = session
        return session

    def drop(self, s: Session) -> None:
        """Forget an upload and delete its staged bytes."""
        if self.sessions.get(s.id) is s:
            del self.sessions[s.id]
        s.staged.close()

    def drop_nodes(self, nodes: frozenset[str] | set[str]) -> None:
        """Drop every upload of these nodes (revoked), unless a chunk is being read into it (that
        request ends by itself, and the node's next one is refused)."""
        for s in list(self.sessions.values()):
            if s.owner[1] in nodes and not s.busy:
                self.drop(s)

    def get(self, run: str, node: str, upload: str, now: float) -> Session:
        """The node's open upload (404 if it has none of that id, 410 once its deadline passed)."""
        s = self.sessions.get(upload) if isinstance(upload, str) else None
        if s is None or s.owner != (run, node):
            raise ChunkError("unknown_upload", "no open upload of this node with that id; open one", 404)
        if now >= s.deadline:
            self.drop(s)
            raise ChunkError("upload_expired", "the upload was not finished by its deadline; open a new one", 410)
        return s

    def check_chunk(self, s: Session, offset: int, length: int, digest: str | None, chunk_bytes: int) -> bool:
        """Before a chunk's bytes are read: where it goes and how long it is. True when it is the
        last chunk taken, sent again (same offset, length and SHA-256: a client whose connection
        broke before the answer, or aiohttp repeating an idempotent PUT): nothing to read, nothing
        changes, and it is not a refusal."""
        if s.busy:
            raise ChunkError("busy", "a chunk of this upload is already being read", 409)
        if s.last is not None and (offset, length, digest) == s.last:
            self.repeats += 1
            return True
        if offset != s.received:
            raise ChunkError(
                "bad_offset",
                f"chunk at offset {offset}, the server has {s.received} bytes: send from {s.received}",
                409,
                received=s.received,
            )
        if length < 1 or length > chunk_bytes:
            raise ChunkError("too_large", f"a chunk is 1 to {chunk_bytes} bytes (server.max_body_bytes)", 413)
        if offset + length > s.size:
            raise ChunkError("too_large", f"the chunk ends at byte {offset + length}, the upload has {s.size}", 413)
        if digest is None or not _HEX64.fullmatch(digest):
            raise ChunkError("bad_digest", "send the chunk's SHA-256 (64 hex digits) in X-Shoal-Chunk-Sha256", 400)
        return False

    def accept_chunk(self, s: Session, chunk: memoryview, digest: str) -> bool:
        """The chunk's bytes (read at ``s.received``): counted and staged if their digest matches
        (else nothing changes: ChunkError bad_digest, send it again) and the update stays sound
        with them (else the WireError, and the upload is over). True when the upload is complete
        and its whole digest verified: the caller takes ``s.staged`` (and closes it)."""
        if hashlib.sha256(chunk).hexdigest() != digest:
            raise ChunkError("bad_digest", "the chunk's bytes do not match its SHA-256; send it again", 400)
        try:
            s.stream.feed(chunk)
        except WireError:
            self.drop(s)  # the update itself is refused: resuming cannot help
            raise
        try:
            s.staged.write_at(s.received, chunk)
        except OSError as e:  # the disk is full: this upload cannot go on (others may)
            self.drop(s)
            raise ChunkError("staging_failed", f"the server could not stage the upload ({e}); try later", 503) from None
        s.hasher.update(chunk)
        s.last = (s.received, len(chunk), digest)
        s.received += len(chunk)
        if s.received < s.size:
            return False
        del self.sessions[s.id]
        if s.hasher.hexdigest() != s.sha256:
            s.staged.close()
            raise ChunkError("bad_digest", "the whole update does not match the SHA-256 it was opened with", 400)
        return True

    def expire(self, now: float, holds_task: Callable[[str, str], bool] | None = None) -> int:
        """Drop the uploads past their deadline, and with ``holds_task(run, node)`` those whose
        node no longer holds a task in that run (not those with a chunk being read: it ends by then)."""
        late = [
            s
            for s in self.sessions.values()
            if not s.busy and (now >= s.deadline or (holds_task is not None and not holds_task(*s.owner)))
        ]
        for s in late:
            self.drop(s)
        return len(late)
