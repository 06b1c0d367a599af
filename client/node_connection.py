"""A node's connection to its server: requests, retries, the global model's download and the
update's upload (whole, or in resumable chunks).

:class:`ServerConnection` is the half of client/node.py's ``Node`` that speaks HTTP to the server
(docs/protocol.md); the node's loop, training and privacy are the other half. Transient failures
are :class:`~shoal.client.http.Retry` (retried with backoff), refusals
:class:`~shoal.client.http.Refused` (never sent again); a node given several servers (edge
aggregators) moves to the next when the one in use stops answering.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from hashlib import sha256

import aiohttp
import torch

from shoal.errors import SpecMismatch
from shoal.params import ParamSpec
from shoal.wire import MODEL_AUX, decode_model, default_max_bytes, read_header

from .disk_model import DiskModel, read_table
from .http import Backoff, NodeError, Refused, Retry, ServerList, check_response, connection_problem
from .runlog import RunTag
from .task_message import TaskMessage
from .training import LocalTrainer
from .transfer import CHUNK_DIGEST_HEADER, Body, OnDisk, download

log = logging.getLogger(__name__)

log.addFilter(RunTag())  # lines of a federation run's work name the run

# Refusals that say nothing against the update itself: no round was open for it (a restarted
# server reopens the same round, with the same task, once its nodes are back), or it already
# arrived. The server hands such a task out again, and the node trains it again.
RETRAINABLE = frozenset({"round_closed", "duplicate"})


class ServerConnection:
    """The node's requests to its server (the attributes are set by the node's constructor)."""

    servers: ServerList
    ssl: ssl.SSLContext | None
    http: aiohttp.ClientSession
    stop: asyncio.Event
    rand: random.Random
    trainer: LocalTrainer
    rounds_done: int
    resumed: dict[str, int]  # chunked transfers that went on after a lost connection
    failed_tasks: set[tuple[int, int]]  # (round, version): diverged or refused, not retried
    _model: tuple[str, int, torch.Tensor | DiskModel] | None  # (etag, version, params)
    _broadcast: tuple[int, dict[str, torch.Tensor]]  # (version, what came with its model)

    @property
    def url(self) -> str:
        """The server in use."""
        return self.servers.url

    @property
    def urls(self) -> list[str]:
        return self.servers.urls

    def _lost(self, leave: bool = False) -> None:
        """The server in use did not answer; after a few failures in a row (or at once with
        ``leave``) the next one of the list is tried (an edge aggregator that died: its nodes
        re-attach to another)."""
        self.servers.lost(asyncio.get_running_loop().time(), leave)

    def _answered(self) -> None:
        self.servers.answered(asyncio.get_running_loop().time())

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _upload(self, task: TaskMessage, body: Body | bytes) -> bool:
        """POST the update; True when the server accepted it (200), False when it refused it
        or it was never sent (stopping)."""
        body = body if isinstance(body, Body) else Body([body])
        # Retry the upload through transient failures: the task (round, version, seed)
        # is deterministic, so the same update is right after a server restart too.
        backoff = Backoff()
        chunk = task.upload_chunk_bytes
        while True:
            try:
                if chunk is not None and chunk < len(body):
                    result = await self._upload_chunks(body, chunk)
                else:
                    result = await self._request(
                        "POST",
                        "/v1/update",
                        data=body.whole(),
                        expect100=True,
                        headers={"Content-Type": "application/octet-stream"},
                    )
                log.info("round %s: update accepted (version %s)", task.round, result.get("version"))
                self.rounds_done += 1
                return True
            except Retry as e:
                if self.stop.is_set():
                    log.warning("stopping with an unsent update: %s", e)
                    return False
                if len(self.urls) > 1:  # this server is gone: so is its round for this node (its drop-out)
                    log.warning("round %s: upload failed (%s); trying the next server", task.round, e)
                    self._lost(leave=True)
                    return False
                delay = backoff.next(self.rand)
                log.warning("upload failed (%s); retrying in %.2f s", e, delay)
                await asyncio.sleep(delay)
            except Refused as e:  # the same update would be refused again: this task is not trained twice
                log.warning("round %s: update refused: %s", task.round, e)
                if e.code not in RETRAINABLE:
                    self.failed_tasks.add(task.key)
                return False

    async def _upload_chunks(self, body: Body, chunk: int) -> dict:
        """An update larger than one request, in chunks (docs/protocol.md, "Chunked uploads"): open
        it with its size and SHA-256, send each chunk with its own SHA-256 at the offset the server
        has; after a lost connection ask the server for that offset and go on from it. Returns the
        server's answer to the last chunk (the upload's); Retry when the upload must start over."""
        opened = await self._request("POST", "/v1/uploads", json={"size": len(body), "sha256": body.sha256()})
        upload, step = str(opened["upload"]), min(chunk, int(opened.get("chunk_bytes", chunk)))
        received, backoff = 0, Backoff()
        while True:
            end = min(received + step, len(body))
            part = body.chunk(received, end)
            try:
                result = await self._request(
                    "PUT",
                    f"/v1/uploads/{upload}",
                    params={"offset": str(received)},
                    data=part,
                    headers={"Content-Type": "application/octet-stream", CHUNK_DIGEST_HEADER: sha256(part).hexdigest()},
                )
            except (Retry, Refused) as e:
                if isinstance(e, Refused) and e.code not in ("bad_offset", "bad_digest", "busy"):
                    raise  # the upload is gone (expired, unknown) or the update refused: the caller decides
                if self.stop.is_set():
                    raise Retry(f"stopping with a chunked upload at byte {received}: {e}") from None
                await asyncio.sleep(backoff.next(self.rand))
                state = await self._request("GET", f"/v1/uploads/{upload}")  # where to go on from
                received = int(state["received"])
                self.resumed["upload"] += 1
                log.info("chunked upload resumes at byte %d of %d (%s)", received, len(body), e)
                continue
            backoff.reset()
            if end == len(body):
                return result
            received = int(result["received"])

    async def _get_model(
        self, version: int, chunk: int | None = None, to_disk: bool = False
    ) -> torch.Tensor | DiskModel | None:
        """The global model of ``version``, from the cache when the ETag still matches; by ranges of
        ``chunk`` bytes (resumable, client/transfer.py) when the task says the model is larger than
        one request. The parameters are a view of the one buffer the download filled, or with
        ``to_disk`` the checked file it filled (:class:`DiskModel`)."""
        headers = {"If-None-Match": self._model[0]} if self._model else {}
        limit = (default_max_bytes(self.trainer.spec) + 64 * len(self.trainer.spec.entries)) * (1 + len(MODEL_AUX))
        for _attempt in range(2):
            got = await download(
                self.http, self.url + "/v1/model", self._ssl, headers, limit, chunk, self.rand, self.resumed, to_disk
            )
            if got is None:  # 304: the cached model is current
                if self._model and self._model[1] == version:
                    return self._model[2]
                headers = {}
                continue
            body, etag = got
            if self._model is not None and isinstance(self._model[2], DiskModel):
                self._model[2].close()  # the version before: its file goes
            self._model = None
            params: torch.Tensor | DiskModel
            try:
                if isinstance(body, OnDisk):
                    params = DiskModel(body, self.trainer.spec)
                    header = params.header
                else:
                    params, header = decode_model(body, self.trainer.spec, copy=False)
            except SpecMismatch as e:
                raise NodeError(self._spec_mismatch(body, e)) from None
            self._model = (etag, int(header["version"]), params)
            self._broadcast = (int(header["version"]), header.get("aux_tensors", {}))
            break
        if self._model is None or self._model[1] != version:
            return None
        return self._model[2]

    def _spec_mismatch(self, body: bytes | bytearray | OnDisk, e: SpecMismatch) -> str:
        """One line: both spec hashes, the first tensor that differs, and the fix (``body``: the
        downloaded model, in memory or in its file)."""
        mine = self.trainer.spec
        try:
            header = read_table(body)[1] if isinstance(body, OnDisk) else read_header(body, len(body))[0]
            theirs = ParamSpec.from_json(header["spec"])
        except Exception:
            return f"the server's model does not fit this node's: {e}"
        a, b = theirs.to_json(), mine.to_json()
        if a == b:  # the exchanged tensors agree: what differs is what never travels
            return (
                f"model spec mismatch: the server's model has spec hash {header.get('spec_hash')!r}, this node's "
                f"{mine.hash!r}, with the same exchanged tensors: the frozen parameters differ (another base "
                "checkpoint or pretrained weights): load the same base model as the server"
            )
        diff = next(((x, y) for x, y in zip(a, b) if x != y), None)
        first = (
            f"first difference: server {diff[0][0]} {diff[0][1]}, node {diff[1][0]} {diff[1][1]}"
            if diff
            else f"server {len(a)} tensors, node {len(b)}"
        )
        return (
            f"model spec mismatch: the server's model has spec hash {header.get('spec_hash')!r}, this node's "
            f"{mine.hash!r} ({first}): run the node with the same task and model as the server "
            "(--task / [task] app and [task.args]; for the built-in task the same [model] and [data])"
        )

    @property
    def _ssl(self):
        return self.ssl if self.ssl is not None else True

    async def _request(self, method: str, path: str, **kw) -> dict:
        try:
            async with self.http.request(method, self.url + path, ssl=self._ssl, **kw) as resp:
                await self._check(resp)
                return await resp.json()
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
            problem = await connection_problem(self.url, e)  # a bad certificate, the wrong scheme: one line
            if problem is not None:
                raise problem from None
            raise Retry(f"{method} {path}: {type(e).__name__}: {e}") from None

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        await check_response(resp)
