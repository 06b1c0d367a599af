"""A client node: ask the server for work, train on its own data, send the update.

The model, loss and data come from the task (shoal/task.py), built through
shoal.assembly exactly as the server builds it. Only the update (a parameter delta,
the example count and training metrics) and, when asked, the metrics of the global
model on the node's own test data leave the node; the data never does. Network
failures and server restarts are retried with exponential backoff and full jitter
(AWS architecture blog, "Exponential Backoff And Jitter", 2015); a bad token, a
revoked node, an untrusted certificate or another model than the server's are not
retried. SIGINT/SIGTERM let the current step finish, then the node exits.

With ``[privacy]`` (:class:`~shoal.privacy_state.NodePrivacy`, docs/privacy.md "In deployment") the node follows
its own config, not the server's word: in distributed mode it clips and adds its noise share
before the update leaves it, in local mode it trains with DP-SGD on a seed only it knows and
accounts its own epsilon; a server whose task names another privacy mode is refused.

Top-k error feedback: each upload's outcome is reported to the compressor (accepted on 200;
not accepted when refused, too late, or never sent), so what an upload carried is folded back
into the residual unless the server took it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import ssl
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Self, cast

import aiohttp
import torch

from shoal import assembly
from shoal.aggregation.compression import OutOfHalfRange
from shoal.assembly import NodeParts
from shoal.config import Config
from shoal.errors import ShoalError, SpecMismatch, short_repr
from shoal.params import ParamSpec
from shoal.privacy_state import diverged
from shoal.rounds import Assignment
from shoal.seeding import derive_seed
from shoal.shards import Shard
from shoal.signals import on_stop_signals
from shoal.task import (
    ClientData,
    LocalData,
    Task,
    TaskError,
    UserCodeError,
    as_tensors,
    call_part,
    task_name,
)
from shoal.wire import MODEL_AUX, decode_model, default_max_bytes, read_header, update_parts

from .algorithms import ClientProgram
from .disk_model import DiskModel, read_table
from .http import Backoff, NodeError, Refused, Retry, ServerList, check_response, connection_problem
from .runlog import RunTag
from .training import LocalTrainer, summarize_means
from .transfer import CHUNK_DIGEST_HEADER, Body, OnDisk, download

log = logging.getLogger(__name__)

log.addFilter(RunTag())  # lines of a federation run's work name the run


class PolicyRefusal(ShoalError):
    """The node's operator policy refuses a task of the run (its config is over the node's limits,
    or not the config the node joined with): the node stops taking part in that run."""

    code = "refused"


SPEC_HASH_HEADER = "X-Shoal-Spec-Hash"  # sent with every poll (docs/protocol.md)
# Refusals that say nothing against the update itself: no round was open for it (a restarted
# server reopens the same round, with the same task, once its nodes are back), or it already
# arrived. The server hands such a task out again, and the node trains it again.
RETRAINABLE = frozenset({"round_closed", "duplicate"})
_METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]{0,63}")  # what the server takes in an evaluation report


def read_local_data(task: Task, path: Path) -> LocalData:
    """The node's own data from ``--data PATH`` through the task's ``local_data``; a path the
    task cannot read is one TaskError line naming the task, the part and the path."""
    local = call_part(
        task,
        f"local_data({str(path)!r})",
        task.local_data,
        path,
        fix="give --data a path in the format this task's local_data() reads",
    )
    if as_tensors(local) is not None and not isinstance(local, LocalData):
        local = LocalData(train=local)  # an (x, y) pair: training data only
    if not hasattr(local, "train"):
        raise TaskError(
            f"task {task_name(task)}: local_data() returned a {type(local).__name__}; "
            "return shoal.task.LocalData(train=..., test=None)"
        )
    return local


def figures_line(task: Task, means: dict[str, float]) -> str:
    """The task's summarized figures of raw means, for a log line: what ``summarize`` derives
    (R², macro-F1, perplexity) first, then loss and accuracy; the raw parts a task derives them
    from (sums of squares, per-class counts) only when it derives nothing."""
    try:
        summary = summarize_means(task, means)
    except TaskError as e:
        log.warning("%s; the raw means are shown", e)
        summary = dict(means)
    derived = {k: v for k, v in summary.items() if k not in means or means[k] != v}
    shown: dict[str, float] = summary
    if derived:
        shown = {**derived, **{k: summary[k] for k in ("loss", "accuracy") if k in summary}}
    return ", ".join(f"{k} {v:.4g}" for k, v in shown.items()) or "no metrics"


class Node:
    """One node's loop; :meth:`run` returns when the server says done or on stop."""

    def __init__(
        self,
        parts: NodeParts,
        server: str,
        token: str,
        ssl_context: ssl.SSLContext | None = None,
        poll_s: float = 20.0,
        check_task: Callable[[dict], str | None] | None = None,
    ):
        """``parts``: what shoal.assembly builds for a node (:meth:`from_config` builds them);
        ``server``: its URL, or several comma-separated (e.g. edge aggregators: the node moves to
        the next when the one it uses stops answering, client/http.py ServerList); ``token``: its
        bearer token ("" with a client certificate in ``ssl_context``); ``check_task``: why this
        node refuses a task (its run's config travels with each task), or None."""
        if not isinstance(parts, NodeParts):
            raise TypeError(
                f"Node takes the parts shoal.assembly builds, not a {type(parts).__name__}: "
                "Node.from_config(server, token, data, cfg, device, ...) builds them"
            )
        self.parts = parts
        self.servers = ServerList.parse(server, log)
        self.check_task = check_task
        self.token = token
        self.ssl = ssl_context
        self.poll_s = poll_s
        self.task, self.name = parts.task, parts.name
        self.train: ClientData = parts.train
        self.test = parts.test
        self.trainer, self.program = parts.trainer, parts.program
        self.states = parts.states
        self.privacy = parts.privacy
        self.compressor = parts.compressor  # [compression]: the upload's encoding
        cfg = parts.cfg
        self.personal_eval_steps = cfg.algorithm.personal_eval_steps
        self.zstd_level = cfg.compression.zstd_level if cfg.compression.zstd else 0
        self.secure_cfg = cfg.secure_aggregation  # identity key and keys file (client/secure_node.py)
        self._broadcast: tuple[int, dict[str, torch.Tensor]] = (-1, {})  # (version, what came with its model)
        self.stop = asyncio.Event()
        self.rand = random.Random()
        self.backoff = Backoff()
        self._model: tuple[str, int, torch.Tensor | DiskModel] | None = None  # (etag, version, params)
        self.rounds_done = 0
        self.resumed = {"upload": 0, "download": 0}  # chunked transfers that went on after a lost connection
        self.failed_tasks: set[tuple[int, int]] = set()  # (round, version): diverged or refused, not retried
        self.failed_reason: str | None = None  # the task's own code raised: what the server was told

    @classmethod
    def from_config(
        cls,
        server: str,
        token: str,
        data: LocalData | Shard,
        cfg: Config,
        device: torch.device | str,
        ssl_context: ssl.SSLContext | None = None,
        poll_s: float = 20.0,
        name: str = "",
        task: Task | None = None,
        privacy_ledger: Path | None = None,
        check_task: Callable[[dict], str | None] | None = None,
        state_dir: Path | None = None,
    ) -> Self:
        """The node of ``cfg`` on its own ``data`` (``local_data()``'s, or a shard of the built-in
        task), its parts built by shoal.assembly. ``name``: the node's (default: the shard's client
        id, else "node"); ``task``: default the config's; ``privacy_ledger``: the file where a
        local-DP node keeps the rounds it spent (None: in memory); ``state_dir``: the folder where
        the node keeps its client state between rounds and restarts (the algorithm's control
        variates, personal parts, FedBN buffers; None: in memory)."""
        parts = assembly.build(
            cfg, task, "node", data=data, device=device, name=name, state_dir=state_dir, privacy_ledger=privacy_ledger
        )
        return cls(parts, server, token, ssl_context, poll_s, check_task)

    async def run(self, signals: bool = True) -> int:
        """``signals``: SIGINT/SIGTERM stop this node (False: its owner, `shoal node`, sets ``stop``)."""
        if signals:
            on_stop_signals(self._on_signal)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.poll_s + 30)
        connector = aiohttp.TCPConnector(ssl=self._ssl)
        poll = {"wait": str(self.poll_s), **({"eval": "1"} if self.test is not None else {})}
        auth = {"Authorization": f"Bearer {self.token}"} if self.token else {}  # else a client certificate
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=auth) as http:
            self.http = http
            while not self.stop.is_set():
                try:
                    task = await self._until_stop(
                        self._request(
                            "GET", "/v1/task", params=poll, headers={SPEC_HASH_HEADER: self.trainer.spec.hash}
                        )
                    )
                    if task is None:
                        break
                    self.backoff.reset()
                    self._answered()
                    if task["status"] == "done":
                        log.info(
                            "server reports done at version %s%s",
                            task.get("version"),
                            f" ({task['reason']})" if task.get("reason") else "",
                        )
                        if task.get("evaluate") and self.test is not None:  # the final model
                            params = await self._get_model(int(task["version"]))
                            if params is not None:
                                flat = params if isinstance(params, torch.Tensor) else params.load()
                                await self._evaluate(flat, int(task["version"]), self.test)
                        break
                    if task["status"] == "work":
                        await self._work(task)
                except Refused as e:
                    raise NodeError(f"server refused this node's poll: {e}") from None
                except Retry as e:
                    self._lost()
                    delay = self.backoff.next(self.rand)
                    log.warning("%s; retrying in %.2f s", e, delay)
                    try:
                        await asyncio.wait_for(self.stop.wait(), delay)
                    except TimeoutError:
                        pass
        log.info("node %s stops after %d rounds", self.name, self.rounds_done)
        return 0

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

    def _check_privacy(self, task: dict) -> None:
        """The task must run this node's privacy mode (NodeError otherwise: stop)."""
        if self.privacy is not None:
            self.privacy.check_task(task)
        elif task.get("privacy") is not None:
            mode = task["privacy"].get("mode") if isinstance(task["privacy"], dict) else task["privacy"]
            raise NodeError(
                f"the server runs privacy.mode = {short_repr(mode)}, this node's config has no [privacy]: "
                "run the node with the server's [privacy] table"
            )

    async def _work(self, task: dict) -> None:
        version = int(task["version"])
        if (int(task["round"]), version) in self.failed_tasks:  # trained once, diverged or refused: not again
            await self._pause(self.poll_s)  # a server that hands it out again is not asked in a tight loop
            return
        refusal = self.check_task(task) if self.check_task is not None else None
        if refusal is not None:  # before the model is fetched or anything is trained
            await self._failed(task, "refused", refusal)
            raise PolicyRefusal(refusal)
        self._check_privacy(task)
        if self.privacy is not None and not self.privacy.allows_next_round():
            self.stop.set()  # this node's own budget: it takes no more work
            return
        chunk = task.get("upload_chunk_bytes")  # the model is larger than one request: download it by ranges
        chunked = isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0
        params = await self._get_model(version, chunk if chunked else None, to_disk=chunked and self._global_on_disk)
        if params is None:
            return  # the server moved on; ask again
        if task.get("evaluate") and self.test is not None:  # the global model, before training on it
            await self._evaluate(params if isinstance(params, torch.Tensor) else params.load(), version, self.test)
        seed = self.privacy.training_seed(int(task["seed"])) if self.privacy is not None else int(task["seed"])
        broadcast = self._broadcast[1] if self._broadcast[0] == version else {}
        state = self.states.get(self.name) if self.program.keeps_state else {}
        assignment = Assignment(self.name, int(task["round"]), version, seed)
        try:
            if isinstance(params, DiskModel):  # plain FedAvg from the model on disk (client/disk_model.py):
                # it stands in for the global tensor, which LocalTrainer._run reads from the file
                on_disk = cast(torch.Tensor, params)
                result = await asyncio.to_thread(self.program.local, self.train, assignment, on_disk, state, broadcast)
            else:
                result = await asyncio.to_thread(self.program.fit, self.train, assignment, params, state, broadcast)
        except UserCodeError as e:  # the task's own code raised: the server hears of it, this node stops
            await self._user_code_failed(task, e)
            raise
        except KeyError as e:  # the algorithm's broadcast did not come with the model
            raise NodeError(
                f"algorithm.name = {self.program.name!r} needs {e} with the model, and the server sent none: "
                "the server runs another algorithm; use the server's [algorithm] table"
            ) from None
        update = result.update
        update.to_server = result.to_server  # SCAFFOLD's c_i+ - c_i travels beside the update
        # Without DP, or with central DP (the server is trusted with the update itself): checked before
        # anything leaves the node. Under local and distributed DP only what the mechanism released is
        # looked at, after the round is spent (below): an un-noised loss or update would be a notice
        # about one example or client that no noise covers.
        problem = diverged(update) if self.privacy is None or self.privacy.plan.server_noise else None
        if problem is not None:
            await self._failed(task, "diverged", problem)
            return
        if self.program.keeps_state and not self.program.settles:
            self.states.put(self.name, result.state)  # as the simulator keeps it: whether or not it is taken
        report = None
        if self.privacy is not None:
            update, report, problem = self.privacy.release(update, task)
            if problem is not None:  # judged from the noised update alone; the notice says no reason
                await self._failed(task, "diverged", problem)
                return
        if "secure_aggregation" in task:  # the update leaves this node only masked (client/secure_node.py)
            from .secure_node import run_secure_round  # secure aggregation only when the config asks

            accepted = await run_secure_round(self, task, update, report)
            self.rounds_done += accepted
            if accepted and self.program.settles:  # SCAFFOLD: Delta c_i went into the masked sum
                self.states.put(self.name, result.state)
            return
        extra = {"round": int(task["round"]), **({"privacy": report} if report is not None else {})}
        tag = (int(task["round"]), int(task["seed"]))  # this upload's entry in the error feedback
        try:
            payload = self.compressor.encode(update.delta, self.name, int(task["seed"]), tag)
        except OutOfHalfRange as e:  # float16 would send Inf: nothing leaves the node
            await self._failed(task, "diverged", str(e))
            return
        accepted = False
        try:
            # the header and the delta's own memory: no encoded copy of a dense or half-precision update
            body = Body(update_parts(update, self.trainer.spec, extra, payload=payload, zstd_level=self.zstd_level))
            accepted = await self._upload(task, body)
        finally:  # top-k: what the server did not take goes back into the residual (also on NodeError)
            (self.compressor.accepted if accepted else self.compressor.not_accepted)(self.name, tag)
        if accepted and self.program.settles:  # SCAFFOLD: c_i moves only when the server took Delta c_i
            self.states.put(self.name, result.state)

    def failure_line(self, e: UserCodeError, task: dict | None = None) -> str:
        """What this node tells the server of its task's failure: the whole line, or under DP (this
        node's own, or the run's) only the task's part and the exception's type, nothing of the data."""
        private = self.privacy is not None or (task or {}).get("privacy") is not None
        return e.public() if private else str(e)

    async def _user_code_failed(self, task: dict, e: UserCodeError) -> None:
        """The task's own code raised in a round: the server stops waiting for this node's update."""
        self.failed_reason = self.failure_line(e, task)
        await self._failed(task, "failed", self.failed_reason)

    async def _failed(self, task: dict, reason: str, detail: str) -> None:
        """This task failed here: one line, the server told (POST /v1/failed, docs/protocol.md),
        and the task is remembered so that it is not trained again."""
        round_, version = int(task["round"]), int(task["version"])
        run = self.url.rsplit("/runs/", 1)[1] if "/runs/" in self.url else None
        where = f"run {run}, round {round_}" if run else f"round {round_}"
        if reason == "diverged":
            log.warning("training diverged in %s: %s; not uploading", where, detail)
        elif reason == "failed":
            log.error("the task failed in %s: %s", where, detail)
        else:
            log.warning("task of %s refused by this node's policy: %s", where, detail)
        if reason == "diverged" and self.privacy is not None and not self.privacy.plan.server_noise:
            reason = "failed"  # under local and distributed DP a notice carries no reason
        self.failed_tasks.add((round_, version))
        try:
            await self._request("POST", "/v1/failed", json={"round": round_, "version": version, "reason": reason})
        except (Refused, Retry) as e:
            log.info("%s: the failure was not reported to the server: %s", where, e)

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            pass

    async def _upload(self, task: dict, body: Body | bytes) -> bool:
        """POST the update; True when the server accepted it (200), False when it refused it
        or it was never sent (stopping)."""
        body = body if isinstance(body, Body) else Body([body])
        # Retry the upload through transient failures: the task (round, version, seed)
        # is deterministic, so the same update is right after a server restart too.
        backoff = Backoff()
        chunk = task.get("upload_chunk_bytes")
        chunked = isinstance(chunk, int) and not isinstance(chunk, bool) and 0 < chunk < len(body)
        while True:
            try:
                if chunked:
                    assert isinstance(chunk, int)
                    result = await self._upload_chunks(body, chunk)
                else:
                    result = await self._request(
                        "POST",
                        "/v1/update",
                        data=body.whole(),
                        expect100=True,
                        headers={"Content-Type": "application/octet-stream"},
                    )
                log.info("round %s: update accepted (version %s)", task["round"], result.get("version"))
                self.rounds_done += 1
                return True
            except Retry as e:
                if self.stop.is_set():
                    log.warning("stopping with an unsent update: %s", e)
                    return False
                if len(self.urls) > 1:  # this server is gone: so is its round for this node (its drop-out)
                    log.warning("round %s: upload failed (%s); trying the next server", task["round"], e)
                    self._lost(leave=True)
                    return False
                delay = backoff.next(self.rand)
                log.warning("upload failed (%s); retrying in %.2f s", e, delay)
                await asyncio.sleep(delay)
            except Refused as e:  # the same update would be refused again: this task is not trained twice
                log.warning("round %s: update refused: %s", task["round"], e)
                if e.code not in RETRAINABLE:
                    self.failed_tasks.add((int(task["round"]), int(task["version"])))
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

    async def _evaluate(self, params: torch.Tensor, version: int, test: ClientData) -> None:
        """Federated evaluation: the global model on this node's test data, reported with its
        example count (POST /v1/eval). Best effort: a failed report is logged, not retried."""
        # raw means: the server pools every node's means and summarizes once (docs/protocol.md)
        state = self.states.get(self.name) if self.program.keeps_state else {}
        self.program.load_buffers(state)  # FedBN: this node's own statistics
        ev = await asyncio.to_thread(self.trainer.evaluate_data, params, test, 2048, False)
        n = int(ev.pop("num_examples"))
        if self.personal_eval_steps >= 0:  # the personalised model too, reported as personal_*
            seed = derive_seed(int.from_bytes(sha256(self.name.encode()).digest()[:8], "big"), version)
            tuned = await asyncio.to_thread(
                self.program.fine_tuned, self.train, params, state, self.personal_eval_steps, seed
            )
            personal = await asyncio.to_thread(self.trainer.evaluate_data, tuned, test, 2048, False)
            personal.pop("num_examples")
            log.info("version %d, personalised: %s", version, figures_line(self.task, personal))
            ev.update({f"personal_{k}": v for k, v in personal.items()})
        metrics = {k: v for k, v in ev.items() if _METRIC_NAME.fullmatch(k) and math.isfinite(v)}
        if len(metrics) < len(ev):
            log.warning(
                "metrics %s are not reported (names must match [A-Za-z][A-Za-z0-9_.-]*, values be finite)",
                sorted(set(ev) - set(metrics)),
            )
        log.info("version %d on %d local test examples: %s", version, n, figures_line(self.task, ev))
        if not metrics:
            return
        try:
            await self._request("POST", "/v1/eval", json={"version": version, "num_examples": n, "metrics": metrics})
        except (Refused, Retry) as e:
            log.warning("evaluation of version %d not reported: %s", version, e)

    @property
    def _global_on_disk(self) -> bool:
        """Whether a model larger than one request is kept on disk while this node trains
        (client/disk_model.py): its training needs the global model only to start from and to
        subtract (plain FedAvg on the CPU: no proximal term, no client state, no DP-SGD)."""
        return (
            type(self.program) is ClientProgram
            and not self.program.keeps_state
            and type(self.trainer) is LocalTrainer
            and not self.trainer.cfg.prox_mu
            and self.trainer.device.type == "cpu"
        )

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
