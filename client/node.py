"""A client node: ask the server for work, train on the local shard, send the update.

Only the update (a parameter delta, the example count and training metrics) leaves
the node; the shard never does. Network failures and server restarts are retried
with exponential backoff and full jitter (AWS architecture blog, "Exponential Backoff
And Jitter", 2015); a bad token, a revoked node or an untrusted certificate are not
retried. SIGINT/SIGTERM let the current step finish, then the node exits.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import ssl
from dataclasses import dataclass

import aiohttp
import torch

from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.errors import ShoalError
from shoal.models import build_model
from shoal.shards import Shard
from shoal.aggregation.compression import Compressor
from shoal.wire import decode_model, encode_update

log = logging.getLogger(__name__)


class NodeError(ShoalError):
    """The server refused this node for good (bad token, revoked) or cannot be trusted."""

    code = "node_error"


class _Retry(Exception):
    """A transient failure: wait and try again."""


@dataclass
class Backoff:
    """Full-jitter exponential backoff: sleep U(0, min(cap, base * 2^attempt))."""

    base: float = 0.2
    cap: float = 5.0
    attempt: int = 0

    def next(self, rand: random.Random) -> float:
        delay = rand.uniform(0, min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


class Node:
    """One node's loop; :meth:`run` returns when the server says done or on stop."""

    def __init__(self, server: str, token: str, shard: Shard, cfg: Config, device: torch.device,
                 ssl_context: ssl.SSLContext | None = None, poll_s: float = 20.0, name: str = ""):
        self.url = server.rstrip("/")
        self.token = token
        self.shard = shard
        self.name = name or shard.client_id
        self.ssl = ssl_context
        self.poll_s = poll_s
        model = build_model(cfg.model.name, shard.input_shape, shard.num_classes)
        self.trainer = LocalTrainer(model, cfg.train, device)
        self.compressor = Compressor(cfg.compression)  # [compression]: the upload's encoding
        self.zstd_level = cfg.compression.zstd_level if cfg.compression.zstd else 0
        self.secure_cfg = cfg.secure_aggregation  # identity key and keys file (client/secure_node.py)
        self.x, self.y = shard.x.to(device), shard.y.to(device)
        self.stop = asyncio.Event()
        self.rand = random.Random()
        self.backoff = Backoff()
        self._model: tuple[str, int, torch.Tensor] | None = None  # (etag, version, params)
        self.rounds_done = 0

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError):
                pass
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.poll_s + 30)
        connector = aiohttp.TCPConnector(ssl=self._ssl)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector,
                                         headers={"Authorization": f"Bearer {self.token}"}) as http:
            self.http = http
            while not self.stop.is_set():
                try:
                    task = await self._until_stop(self._get_json("/v1/task", {"wait": str(self.poll_s)}))
                    if task is None:
                        break
                    self.backoff.reset()
                    if task["status"] == "done":
                        log.info("server reports done at version %s", task.get("version"))
                        break
                    if task["status"] == "work":
                        await self._work(task)
                except _Retry as e:
                    delay = self.backoff.next(self.rand)
                    log.warning("%s; retrying in %.2f s", e, delay)
                    try:
                        await asyncio.wait_for(self.stop.wait(), delay)
                    except asyncio.TimeoutError:
                        pass
        log.info("node %s stops after %d rounds", self.name, self.rounds_done)
        return 0

    def _on_signal(self) -> None:
        log.info("signal received: finishing the current step, then exiting")
        self.stop.set()

    async def _until_stop(self, coro):
        """Await ``coro`` unless stop is asked first (then None)."""
        task = asyncio.ensure_future(coro)
        stopper = asyncio.ensure_future(self.stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if task in done:
            return task.result()
        task.cancel()
        return None

    async def _work(self, task: dict) -> None:
        version = int(task["version"])
        params = await self._get_model(version)
        if params is None:
            return  # the server moved on; ask again
        update = await asyncio.to_thread(
            self.trainer.train, params, self.x, self.y, int(task["seed"]), version, self.name
        )
        if "secure_aggregation" in task:  # the update leaves this node only masked (client/secure_node.py)
            from .secure_node import run_secure_round  # it imports this module's request helpers

            self.rounds_done += await run_secure_round(self, task, update)
            return
        payload = self.compressor.encode(update.delta, self.name, int(task["seed"]))
        body = encode_update(update, self.trainer.spec, {"round": int(task["round"])},
                             payload=payload, zstd_level=self.zstd_level)
        # Retry the upload through transient failures: the task (round, version, seed)
        # is deterministic, so the same update is right after a server restart too.
        backoff = Backoff()
        while True:
            try:
                result = await self._request("POST", "/v1/update", data=body, expect100=True,
                                             headers={"Content-Type": "application/octet-stream"})
                log.info("round %s: update accepted (version %s)", task["round"], result.get("version"))
                self.rounds_done += 1
                return
            except _Retry as e:
                if self.stop.is_set():
                    log.warning("stopping with an unsent update: %s", e)
                    return
                delay = backoff.next(self.rand)
                log.warning("upload failed (%s); retrying in %.2f s", e, delay)
                await asyncio.sleep(delay)
            except _Refused as e:
                log.warning("round %s: update refused: %s", task["round"], e)
                return

    async def _get_model(self, version: int) -> torch.Tensor | None:
        """The global model of ``version``, from the cache when the ETag still matches."""
        headers = {"If-None-Match": self._model[0]} if self._model else {}
        for attempt in range(2):
            try:
                async with self.http.get(self.url + "/v1/model", headers=headers, ssl=self._ssl) as resp:
                    await self._check(resp)
                    if resp.status == 304 and self._model and self._model[1] == version:
                        return self._model[2]
                    body = await resp.read()
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                raise _Retry(f"model download failed: {e}") from None
            if resp.status == 304:
                headers = {}
                continue
            params, header = decode_model(body, self.trainer.spec)
            self._model = (resp.headers.get("ETag", ""), int(header["version"]), params)
            break
        if self._model is None or self._model[1] != version:
            return None
        return self._model[2]

    @property
    def _ssl(self):
        return self.ssl if self.ssl is not None else True

    async def _get_json(self, path: str, params: dict) -> dict:
        return await self._request("GET", path, params=params)

    async def _request(self, method: str, path: str, **kw) -> dict:
        try:
            async with self.http.request(method, self.url + path, ssl=self._ssl, **kw) as resp:
                await self._check(resp)
                return await resp.json()
        except aiohttp.ClientConnectorCertificateError as e:
            raise NodeError(f"the server's TLS certificate is not trusted: {e.certificate_error} "
                            "(pass the private CA with --ca-cert)") from None
        except aiohttp.ClientSSLError as e:
            raise NodeError(f"TLS handshake with {self.url} failed: {e}") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as e:
            raise _Retry(f"{method} {path}: {type(e).__name__}: {e}") from None

    async def _check(self, resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        try:
            info = await resp.json()
        except Exception:
            info = {"error": "http_error", "detail": await resp.text()}
        msg = f"{resp.status} {info.get('error')}: {info.get('detail')}"
        if resp.status in (401, 403):
            raise NodeError(f"server refused this node: {msg}")
        if resp.status >= 500 or resp.status in (408, 429):  # busy, timed out, too many in flight: retry
            raise _Retry(msg)
        raise _Refused(msg)


class _Refused(Exception):
    """The server refused this request (4xx): do not send it again."""
