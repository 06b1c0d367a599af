"""`shoal node`: a node that joins a federation once and takes part in every run it allows.

It asks the server for the runs open now (``GET /v1/offers``), checks each against its
operator's config (client/node_config.py: the task must be installed here with the same
source hash, the run's settings within this node's limits), refuses the others with the
reason (``POST /runs/{run}/v1/answer``, shown in the run's status), and runs each accepted
one as a client/node.py Node on the run's routes (``/runs/{run}/v1/...``), several at once.
When the server goes away it retries with full-jitter backoff; a run's Node does the same. Given
several servers (``node.server`` a list, or ``shoal node --server URL1,URL2``) it moves to the next
after two failed requests in a row, as `shoal client --server URL1,URL2` does, and each run's Node
gets the same list (starting from the server in use).
SIGINT/SIGTERM let the current steps finish, then it exits.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import random
import re
import ssl
from pathlib import Path
from typing import Any

import aiohttp
import torch

from shoal.config import config_from_dict
from shoal.errors import ConfigError, ShoalError
from shoal.signals import on_stop_signals
from shoal.task import UserCodeError
from shoal.tasks import builtin_local_data

from .http import Backoff, NodeError, Refused, Retry, ServerList, check_response, connection_problem
from .node import Node, read_local_data
from .node_config import BUILTIN, NodeConfig
from .runlog import RUN, RunTag

log = logging.getLogger(__name__)
log.addFilter(RunTag())

_RUN_ID = re.compile(r"run-[0-9]{1,9}")
_SHA = re.compile(r"[0-9a-f]{64}|builtin")
MAX_OFFERS = 64


def node_setting(line: str) -> str:
    """A connection hint written for `shoal client`'s options, in the node config's words."""
    return line.replace("with --ca-cert", "as node.ca_cert in the node's config")


def well_formed_offer(offer: Any) -> bool:
    """The server's offer has the shape this node reads (it comes from the network)."""
    return (
        isinstance(offer, dict)
        and isinstance(offer.get("run"), str)
        and _RUN_ID.fullmatch(offer["run"]) is not None
        and isinstance(offer.get("task"), str)
        and 0 < len(offer["task"]) <= 1024
        and isinstance(offer.get("task_sha256"), str)
        and _SHA.fullmatch(offer["task_sha256"]) is not None
        and isinstance(offer.get("config"), dict)
        and all(isinstance(v, dict) for v in offer["config"].values())
    )


class NodeDaemon:
    """One node's life in a federation: offers in, a Node per accepted run."""

    def __init__(self, cfg: NodeConfig, token: str, device: torch.device, ssl_context: ssl.SSLContext | None):
        """``token``: the node's token, or "" when it logs in with its TLS client certificate."""
        self.cfg = cfg
        self.token = token
        self.device = device
        self.ssl = ssl_context
        self.stop = asyncio.Event()
        self.rand = random.Random()
        self.runs: dict[str, asyncio.Task] = {}  # accepted runs (running or over)
        self.refused: dict[str, str] = {}  # run -> this node's reason (for good)
        self.deferred: dict[str, str] = {}  # run -> why this node cannot take part yet (asked again each poll)
        self.ledgers: dict[Path, str] = {}  # local-DP ledger in use -> the run spending that data's budget
        self.servers = ServerList(cfg.servers, log)  # the one in use: the next when it stops answering
        self.error = ""  # why it stopped, when retrying could not help

    async def run(self) -> int:
        on_stop_signals(self._on_signal)
        timeout = aiohttp.ClientTimeout(total=60, sock_connect=10)
        backoff = Backoff()
        auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}  # else a client certificate
        async with aiohttp.ClientSession(timeout=timeout, headers=auth) as self.http:
            log.info("node %s joins %s with %d allowed tasks", self.cfg.name, self.url, len(self.cfg.tasks))
            while not self.stop.is_set():
                try:
                    offers = await self._request("GET", "/v1/offers")
                    backoff.reset()
                    self._answered()
                    runs = offers.get("runs") if isinstance(offers, dict) else None
                    for offer in runs[:MAX_OFFERS] if isinstance(runs, list) else []:
                        if not well_formed_offer(offer):
                            log.warning("ignoring a malformed offer from the server: %s", str(offer)[:200])
                            continue
                        if offer["run"] not in self.runs and offer["run"] not in self.refused:
                            await self._consider(offer)
                    delay = self.cfg.poll_s
                except Retry as e:
                    self._lost()
                    delay = backoff.next(self.rand)
                    log.warning("%s; retrying in %.2f s", e, delay)
                except NodeError as e:  # retrying cannot help (a certificate, a scheme): `shoal node` exits 2
                    self.error = node_setting(str(e))
                    log.error("%s", self.error)
                    self.stop.set()
                    break
                try:
                    await asyncio.wait_for(self.stop.wait(), delay)
                except TimeoutError:
                    pass
            if self.runs:  # each run's Node sees the same stop and finishes its step
                await asyncio.wait(list(self.runs.values()), timeout=30)
        log.info("node %s stops: took part in %d runs, refused %d", self.cfg.name, len(self.runs), len(self.refused))
        return 2 if self.error else 0

    @property
    def url(self) -> str:
        """The server in use."""
        return self.servers.url

    def _lost(self) -> None:
        """The server in use did not answer; after a few failures in a row the daemon moves to the
        next server of its list (the runs it takes part in move on their own, client/node.py)."""
        self.servers.lost(asyncio.get_running_loop().time())

    def _answered(self) -> None:
        self.servers.answered(asyncio.get_running_loop().time())

    def _on_signal(self) -> None:
        log.info("signal received: finishing the current steps, then exiting")
        self.stop.set()

    async def _consider(self, offer: dict[str, Any]) -> None:
        """Join the offered run, or refuse it: for good when its task or config is not this node's
        to run (policy, limits, a task that does not load here), for now when the cause passes
        (this data set's local-DP ledger is spent by another run: asked again at each poll)."""
        run = offer["run"]
        reason = self.cfg.check(offer)
        ledger = self.ledger(offer)
        if reason is None and self.ledgers.get(ledger, run) != run:
            busy = (
                f"node {self.cfg.name}'s data for task {offer['task'][:200]} is trained with local DP by "
                f"{self.ledgers[ledger]}; one local-DP run at a time spends a data set's budget (this node "
                "takes part once that run is over)"
            )
            if self.deferred.get(run) != busy:  # told once, not at every poll
                log.info("%s deferred: %s", run, busy)
                await self._answer(run, {"answer": "refused", "reason": busy[:500], "temporary": True})
            self.deferred[run] = busy
            return
        node = None
        if reason is None:
            try:
                node = await asyncio.to_thread(self._node_for, offer)
            except (ShoalError, OSError) as e:  # a run this node cannot take part in: say why
                reason = f"node {self.cfg.name} cannot run it: {e}"
        self.deferred.pop(run, None)
        if node is None:
            self.refused[run] = reason or "refused"
            log.warning("%s refused: %s", run, self.refused[run])
            await self._answer(run, {"answer": "refused", "reason": self.refused[run][:500]})
            return
        await self._answer(run, {"answer": "joined"})
        log.info("%s joined: task %s", run, offer["task"])
        if node.privacy is not None and node.privacy.plan.dp_sgd:
            self.ledgers[ledger] = run
        self.runs[run] = asyncio.ensure_future(self._take_part(run, node, ledger))

    def check_task(self, joined: dict[str, Any], task: dict[str, Any]) -> str | None:
        """Why this node refuses one task of a run it joined (None: it trains it). The run's task,
        pin and config travel with each task; each time they must be those the node joined with
        and within its operator's limits (the installed task's source is hashed again too)."""
        sent = {key: task.get(key) for key in ("run", "task", "task_sha256", "config")}
        if not well_formed_offer(sent):
            return (
                f"a task of {joined['run']} came without its run's task and config (run, task, task_sha256, "
                f"config); node {self.cfg.name} trains only tasks whose config it checked"
            )
        for key in ("run", "task", "task_sha256"):
            if sent[key] != joined[key]:
                return (
                    f"a task of {joined['run']} names {key} {str(sent[key])[:200]!r}; the node joined {joined[key]!r}"
                )
        theirs: dict[str, dict] = sent["config"]  # type: ignore[assignment]  # checked by well_formed_offer
        ours: dict[str, dict] = joined["config"]
        if theirs != ours:
            changed = sorted(
                f"{name}.{key}"
                for name in set(theirs) | set(ours)
                for key in set(theirs.get(name, {})) | set(ours.get(name, {}))
                if theirs.get(name, {}).get(key) != ours.get(name, {}).get(key)
            )
            return (
                f"the config of {joined['run']} changed since node {self.cfg.name} joined it "
                f"({', '.join(changed[:5])[:300]}); a run's config is fixed when it is submitted"
            )
        return self.cfg.check(sent)

    def ledger(self, offer: dict[str, Any]) -> Path:
        """Where a local-DP node keeps the rounds spent on the data a task reads: one ledger per data
        set, across runs, so every run's epsilon goes on from what the earlier runs spent on it."""
        allowed = self.cfg.tasks.get(offer["task"])
        data = str(allowed.data.expanduser().resolve()) if allowed is not None else offer["task"]
        return self.cfg.state_dir / f"data-{hashlib.sha256(data.encode()).hexdigest()[:16]}.privacy.json"

    def _node_for(self, offer: dict[str, Any]) -> Node:
        """The run's config with this node's device, its task, its data: a Node on the run's routes."""
        from shoal.assembly import task_from_config
        from shoal.shards import load_shard

        allowed = self.cfg.tasks[offer["task"]]
        raw = {k: dict(v) for k, v in offer["config"].items()}
        if allowed.ref != BUILTIN:  # this node's own reference of the task the run names
            raw["task"] = {**raw.get("task", {}), "app": allowed.ref}
        raw["train"] = {**raw.get("train", {}), "device": str(self.device)}
        cfg = config_from_dict(raw).validate()
        task = task_from_config(cfg)
        if allowed.ref == BUILTIN:
            local = builtin_local_data(task, load_shard(allowed.data))  # type: ignore[arg-type]
        else:
            local = read_local_data(task, allowed.data)
        node = Node.from_config(
            ",".join(f"{u}/runs/{offer['run']}" for u in self.servers.in_turn()),  # the one in use first
            self.token,
            local,
            cfg,
            self.device,
            self.ssl,
            poll_s=cfg.server.poll_s,
            name=self.cfg.name,
            task=task,
            privacy_ledger=self.ledger(offer),
            check_task=functools.partial(self.check_task, offer),
            state_dir=self.client_state_dir(offer),
        )
        size, most = node.trainer.spec.numel, self.cfg.limits.max_parameters
        if most and size > most:
            raise ConfigError(f"the model has {size} parameters, over node {self.cfg.name}'s limit of {most}")
        return node

    def client_state_dir(self, offer: dict[str, Any]) -> Path:
        """Where this node keeps a run's client state (control variates, personal parts): one folder
        per run, named by the run and a digest of its task and config, so that a run id the server
        reuses after its database was reset never inherits another run's state."""
        what = json.dumps([offer["run"], offer["task"], offer.get("config", {})], sort_keys=True, default=str)
        return self.cfg.state_dir / f"{offer['run']}-{hashlib.sha256(what.encode()).hexdigest()[:12]}.state"

    async def _take_part(self, run: str, node: Node, ledger: Path) -> None:
        RUN.set(run)  # this asyncio task's lines (and its training threads') name the run
        node.stop = self.stop  # the daemon's signal stops every run's loop
        try:
            await node.run(signals=False)
            log.info("%s: over for this node after %d rounds", run, node.rounds_done)
        except UserCodeError as e:  # the task's own code raised: the run's status says so (under DP, without data)
            log.error("%s: this node stops taking part: %s", run, e)
            try:
                reason = node.failed_reason or node.failure_line(e)
                await self._answer(run, {"answer": "failed", "reason": reason[:500]})
            except (Retry, NodeError):
                pass
        except ShoalError as e:  # a task refused by this node's policy, or the run's config not this node's
            log.error("%s: this node stops taking part: %s", run, e)
            try:
                await self._answer(run, {"answer": "refused", "reason": str(e)[:500]})
            except (Retry, NodeError):
                pass
        except Exception:
            log.exception("%s: unexpected error; this node stops taking part", run)
        finally:
            if self.ledgers.get(ledger) == run:
                del self.ledgers[ledger]

    async def _answer(self, run: str, body: dict[str, Any]) -> None:
        try:
            await self._request("POST", f"/runs/{run}/v1/answer", json=body)
        except Refused as e:
            log.warning("%s: the server did not take this node's answer: %s", run, e)

    async def _request(self, method: str, path: str, **kw) -> Any:
        url = self.url + path
        try:
            async with self.http.request(method, url, ssl=self.ssl if self.ssl is not None else True, **kw) as resp:
                await check_response(resp)
                return await resp.json()
        except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ValueError) as e:
            problem = await connection_problem(self.url, e)  # a bad certificate, the wrong scheme
            if problem is not None:
                raise problem from None
            raise Retry(f"{method} {path}: {type(e).__name__}: {e}") from None
