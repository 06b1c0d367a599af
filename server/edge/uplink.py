"""The edge's side towards its root (:class:`Uplink`): the poll that names its connected nodes,
the model fetch, closing its rounds and sending their partials (partial_sender.py), with per-round
figures in ``server.out_dir``/edge_metrics.jsonl."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from shoal.aggregation.partial import encode_partial
from shoal.errors import ConfigError, Malformed, ShoalError
from shoal.metrics import json_safe
from shoal.wire import read_header

from ..http_common import (
    notify,
)
from ..service import ModelDownload, spec_mismatch_detail
from .intake import MAX_ROSTER, edge_terms
from .journal import JOURNAL
from .partial_sender import PartialRefused, UplinkGaveUp, send_partial
from .rounds import EdgeRound
from .service import EdgeNodes

log = logging.getLogger(__name__)

POLL_WAIT_S = 1.0  # the edge's poll of the root is held this long at most while the root has no work for it
CLOSE_EVERY_S = 0.05  # how often the edge looks whether its part of the round is due to close
ASYNC_SEND_S = 60.0  # under an async root, a partial is sent again for this long at most
ATTACH_S = 30.0  # an edge whose root never answered stops (one line, why) after trying this long


class Uplink:
    """The edge's side towards its root: the poll, the model fetch, the partials; per-round
    figures into ``server.out_dir``/edge_metrics.jsonl."""

    def __init__(self, edge: EdgeNodes, app: web.Application, http: aiohttp.ClientSession, parent: str, ssl_ctx):
        self.edge, self.app, self.http = edge, app, http
        self.parent = parent.rstrip("/")
        self.ssl = ssl_ctx if ssl_ctx is not None else True
        self.sending: set[asyncio.Task] = set()
        self.wanted = asyncio.Event()  # a node of this edge started waiting for a task (async roots)
        edge.on_want = self.wanted.set
        self.rand = random.Random()
        out = Path(edge.cfg.server.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.metrics = out / "edge_metrics.jsonl"

    def _changed(self) -> None:
        notify(self.app)

    async def poll_root(self, stop: asyncio.Event) -> None:
        """Name the connected nodes to the root, take its answer; fetch the round's model."""
        from shoal.client.http import Backoff, connection_problem, unreachable

        backoff = Backoff()
        done_at: float | None = None
        attached = False  # the root answered once: from then on it may restart, and the edge waits for it
        failing_since: float | None = None
        while not stop.is_set():
            now = time.monotonic()
            if self.edge.done:  # the root is done (and may be gone): tell the nodes, then stop
                done_at = done_at if done_at is not None else now
                if self.edge.finished(now, done_at) and not self.sending:
                    stop.set()
                    return
                await asyncio.sleep(0.2)
                continue
            try:
                nodes = self.edge.connected(now)[:MAX_ROSTER]  # the root takes no more
                body: dict[str, Any] = {"nodes": nodes, "config": edge_terms(self.edge.cfg)}
                buf = self.edge.buffer
                if buf is not None:  # an async root hands out a task to each node that waits for one
                    self.wanted.clear()
                    buf.forget(nodes)
                    body["want"] = sorted(buf.want)
                answer = await self._poll_once(body, buf is not None and not body["want"])
                if answer is None:
                    continue  # a node started waiting for a task: ask again at once, naming it
                if self.edge.from_root(answer, time.monotonic()):
                    self.take_back()
                    self._changed()
                self.prune_journal()
                served = self.edge.root_round
                if served is not None and self.edge.round is not None and not self.edge.round.closed:
                    await self.fetch_model(served[1])
                if buf is not None and buf.tasks:
                    await self.fetch_model(max(v for v, _ in buf.tasks.values()))
                backoff.reset()
                attached, failing_since = True, None
            except ConfigError:
                raise
            except (aiohttp.ClientError, TimeoutError, ValueError, ShoalError) as e:
                if isinstance(e, aiohttp.ClientError | TimeoutError):  # a node's hints, with the edge's keys
                    problem = await connection_problem(
                        self.parent, e, "edge", "hierarchy.parent (--parent)", "hierarchy.parent_ca_cert"
                    )
                    if problem is not None:
                        raise ConfigError(f"the root {self.parent}: {problem}") from None
                now = time.monotonic()
                failing_since = failing_since if failing_since is not None else now
                if not attached and now - failing_since >= ATTACH_S:
                    raise ConfigError(
                        f"the root did not answer this edge for {ATTACH_S:.0f} s: "
                        + unreachable(self.parent, e, "hierarchy.parent (--parent)")
                    ) from None
                delay = backoff.next(self.rand)
                log.warning(
                    "poll of the root %s failed (%s: %s); again in %.2f s", self.parent, type(e).__name__, e, delay
                )
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
                continue

    def prune_journal(self) -> None:
        """After each answer of the root: kept updates of a round this edge does not serve are removed
        (the root moved on, or the run is done: then the journal's folder too)."""
        journal = self.app.get(JOURNAL)
        if journal is None:
            return
        if self.edge.done:
            if journal.folder.exists():
                journal.remove()
            return
        served = self.edge.root_round
        journal.keep_round(None if served is None else served[0])

    def take_back(self) -> None:
        """A new round here: the updates this edge kept of it before a restart go back into its sum."""
        journal, er = self.app.get(JOURNAL), self.edge.round
        if journal is None or er is None or er.closed or self.edge.done:
            return
        taken = 0
        for node, body in journal.entries(er.round, er.version):
            try:
                self.edge.submit(node, memoryview(bytearray(body)), time.monotonic())
                taken += 1
            except ShoalError as e:
                log.warning("round %d: the kept update of %s is not taken back: %s", er.round, node, e)
        journal.keep_round(er.round)
        if taken:
            log.info("round %d: took back %d updates kept before this edge restarted", er.round, taken)

    async def _poll_once(self, body: dict[str, Any], interruptible: bool) -> dict[str, Any] | None:
        """One poll of the root; its answer. ``interruptible``: None as soon as a node of this edge
        starts waiting for a task (the poll in flight does not name it; it is dropped)."""
        request = asyncio.ensure_future(self._post_poll(body))
        if not interruptible:
            return await request
        waiting = asyncio.ensure_future(self.wanted.wait())
        try:
            await asyncio.wait({request, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
        if request.done():
            return request.result()
        request.cancel()
        return None

    async def _post_poll(self, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(
            self.parent + "/v1/edge/poll", params={"wait": str(POLL_WAIT_S)}, json=body, ssl=self.ssl
        ) as r:
            text = await r.text()
            if r.status in (401, 403, 409):
                try:
                    info = json.loads(text)
                except ValueError:
                    info = {}
                info = info if isinstance(info, dict) else {}
                code, detail = str(info.get("error", ""))[:40], str(info.get("detail", text))[:400]
                if r.status != 409 or code in ("not_supported", "config_mismatch"):
                    raise ConfigError(f"the root {self.parent} refuses this edge ({r.status} {code}): {detail}")
            if r.status != 200:
                raise Malformed(f"{r.status}: {text[:300]}")
            answer = json.loads(text)
        if not isinstance(answer, dict):
            raise Malformed(f"the root's poll answer is not one: {text[:200]}")
        return answer

    async def fetch_model(self, version: int) -> None:
        """The root's model of ``version``, cached and served to this edge's nodes as the root's bytes."""
        from shoal.client.transfer import download

        cached = self.edge.root_model
        if cached is not None and cached.version == version:
            return
        headers = {"If-None-Match": cached.etag} if cached is not None else {}
        got = await download(
            self.http, self.parent + "/v1/model", self.ssl, headers, 2 * self.edge.update_limit, None, self.rand
        )
        if got is None:
            return  # 304: the root is still at the version cached here
        body, etag = got
        assert isinstance(body, bytearray)  # downloaded whole, in memory (not to_disk)
        header = read_header(body, len(body))[0]
        if header.get("spec_hash") != self.edge.spec.hash:
            raise ConfigError(spec_mismatch_detail(str(header.get("spec_hash"))[:64], self.edge.spec.hash))
        got_version = header.get("version")
        if not isinstance(got_version, int) or isinstance(got_version, bool):
            raise Malformed("the root's model names no version")
        self.edge.took_model(ModelDownload(got_version, etag, b"", memoryview(body)))
        log.info("model of version %d cached (%d bytes)", got_version, len(body))
        self._changed()

    async def close_rounds(self, stop: asyncio.Event) -> None:
        """Close the edge's part of a round when it is due, and send its partial up (under an async
        root: send the buffer up when it is full or its oldest update waited long enough)."""
        while not stop.is_set():
            er = self.edge.round
            now = time.monotonic()
            buf = self.edge.buffer
            if buf is not None and buf.should_flush(now):
                why = "size" if buf.count >= buf.size else "time"
                parts = buf.flush()
                task = asyncio.ensure_future(self.send_buffer(parts, why, now))
                self.sending.add(task)
                task.add_done_callback(self.sending.discard)
            if er is not None and er.should_close(now):
                why = (
                    "complete" if er.complete else "quorum" if er.close_at is None or now < er.close_at else "deadline"
                )
                part, opened = self.edge.close_round(now)
                self._changed()  # nodes still training hear the round is over for them (or of the next edge round)
                if part is not None and not opened:
                    task = asyncio.ensure_future(self.send(er, part, why, now))
                    self.sending.add(task)
                    task.add_done_callback(self.sending.discard)
                elif not opened and not self.edge.relay.secure:  # a secure round's inputs leave in the masked sum
                    log.info("round %d: no update arrived before the close (%s)", er.round, why)
            await asyncio.sleep(CLOSE_EVERY_S)

    async def send_buffer(self, parts: list, why: str, flushed_at: float) -> None:
        """An async edge's buffer, one partial per base version, each sent until the root answers
        (no root deadline: given up after ASYNC_SEND_S)."""
        for part in parts:
            body = encode_partial(part, self.edge.spec.hash, self.edge.cfg.hierarchy.partial_dtype)
            record: dict[str, Any] = {
                "edge": self.edge.name,
                "version": part.version,
                "nodes_in": part.count,
                "nodes": sorted(part.senders),
                "weight": part.total_weight,
                "closed": why,
                "partial_bytes": len(body),
            }
            loop = asyncio.get_running_loop()
            try:
                answer = await send_partial(self.http, self.parent, body, give_up_at=loop.time() + ASYNC_SEND_S)
                record["answer"] = answer.get("status")
                record["root_version"] = answer.get("version")
            except (PartialRefused, UplinkGaveUp) as e:
                record["answer"] = "refused" if isinstance(e, PartialRefused) else "gave_up"
                if isinstance(e, PartialRefused):
                    record["refusal"] = e.answer.get("error")
                log.warning("partial of %d nodes (version %d) not taken: %s", part.count, part.version, e)
            record["sent_after_s"] = round(time.monotonic() - flushed_at, 4)
            assert self.edge.buffer is not None
            if self.edge.buffer.answered(part):
                self.wanted.set()  # its nodes that asked meanwhile get their next task
            with self.metrics.open("a") as f:
                f.write(json.dumps(json_safe(record)) + "\n")

    async def send(self, er: EdgeRound, part, why: str, closed_at: float) -> None:
        body = encode_partial(part, self.edge.spec.hash, self.edge.cfg.hierarchy.partial_dtype)
        loop = asyncio.get_running_loop()
        root_deadline = None if er.close_at is None else er.close_at + self.edge.cfg.hierarchy.edge_margin_s
        give_up = None if root_deadline is None else loop.time() + (root_deadline - time.monotonic())
        started = self.edge.started_at if self.edge.started_at is not None else closed_at
        record: dict[str, Any] = {
            "edge": self.edge.name,
            "round": er.round,
            "version": part.version,
            "nodes_given": len(er.nodes),
            "nodes_in": part.count,
            "nodes": sorted(part.senders),
            "weight": part.total_weight,
            "closed": why,
            "closed_after_s": round(closed_at - started, 4),
            "partial_bytes": len(body),
            "edge_rounds": self.edge.cfg.hierarchy.edge_rounds,
        }
        try:
            answer = await send_partial(self.http, self.parent, body, give_up_at=give_up)
            record["answer"] = answer.get("status")
            log.info(
                "round %d: partial of %d nodes %s by the root (%s)", er.round, part.count, answer.get("status"), why
            )
        except (PartialRefused, UplinkGaveUp) as e:
            record["answer"] = "refused" if isinstance(e, PartialRefused) else "gave_up"
            log.warning("round %d: partial of %d nodes not taken: %s", er.round, part.count, e)
        journal = self.app.get(JOURNAL)
        if journal is not None:  # counted (or never will be): its updates are of no more use on disk
            journal.drop_round(er.round)
        record["sent_after_s"] = round(time.monotonic() - started, 4)
        with self.metrics.open("a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")
