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
from shoal.errors import ShoalError, short_repr
from shoal.privacy_state import diverged
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
from shoal.wire import update_parts

from .algorithms import ClientProgram
from .disk_model import DiskModel
from .http import Backoff, NodeError, Refused, Retry, ServerList
from .node_connection import ServerConnection
from .pipeline import ClientPipeline
from .runlog import RunTag
from .task_message import TaskMessage
from .training import LocalTrainer, summarize_means
from .transfer import Body

log = logging.getLogger(__name__)

log.addFilter(RunTag())  # lines of a federation run's work name the run


class PolicyRefusal(ShoalError):
    """The node's operator policy refuses a task of the run (its config is over the node's limits,
    or not the config the node joined with): the node stops taking part in that run."""

    code = "refused"


SPEC_HASH_HEADER = "X-Shoal-Spec-Hash"  # sent with every poll (docs/protocol.md)
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


class Node(ServerConnection):
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
        # train -> client state -> DP (self.privacy) -> encode / secure payload -> upload -> settle
        self.pipeline = ClientPipeline(self.program, self.states, compressor=self.compressor)
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
                    body = await self._until_stop(
                        self._request(
                            "GET", "/v1/task", params=poll, headers={SPEC_HASH_HEADER: self.trainer.spec.hash}
                        )
                    )
                    if body is None:
                        break
                    self.backoff.reset()
                    self._answered()
                    task = TaskMessage.parse(body)  # read once; everything after reads its typed fields
                    if task.status == "done":
                        reason = f" ({task.reason})" if task.reason else ""
                        log.info("server reports done at version %s%s", task.version, reason)
                        if task.evaluate and self.test is not None:  # the final model
                            params = await self._get_model(task.version)
                            if params is not None:
                                flat = params if isinstance(params, torch.Tensor) else params.load()
                                await self._evaluate(flat, task.version, self.test)
                        break
                    if task.status == "work":
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

    def _check_privacy(self, task: TaskMessage) -> None:
        """The task must run this node's privacy mode (NodeError otherwise: stop)."""
        if self.privacy is not None:
            self.privacy.check_task(task.raw)
        elif task.privacy is not None:
            mode = task.privacy.get("mode")
            raise NodeError(
                f"the server runs privacy.mode = {short_repr(mode)}, this node's config has no [privacy]: "
                "run the node with the server's [privacy] table"
            )

    async def _work(self, task: TaskMessage) -> None:
        version = task.version
        if task.key in self.failed_tasks:  # trained once, diverged or refused: not again
            await self._pause(self.poll_s)  # a server that hands it out again is not asked in a tight loop
            return
        refusal = self.check_task(task.raw) if self.check_task is not None else None
        if refusal is not None:  # before the model is fetched or anything is trained
            await self._failed(task, "refused", refusal)
            raise PolicyRefusal(refusal)
        self._check_privacy(task)
        if self.privacy is not None and not self.privacy.allows_next_round():
            self.stop.set()  # this node's own budget: it takes no more work
            return
        chunk = task.upload_chunk_bytes  # the model is larger than one request: download it by ranges
        params = await self._get_model(version, chunk, to_disk=chunk is not None and self._global_on_disk)
        if params is None:
            return  # the server moved on; ask again
        if task.evaluate and self.test is not None:  # the global model, before training on it
            await self._evaluate(params if isinstance(params, torch.Tensor) else params.load(), version, self.test)
        seed = self.privacy.training_seed(task.seed) if self.privacy is not None else task.seed
        broadcast = self._broadcast[1] if self._broadcast[0] == version else {}
        state = self.pipeline.state_of(self.name)
        on_disk = isinstance(params, DiskModel)  # plain FedAvg from the model on disk (client/disk_model.py):
        # it stands in for the global tensor, which LocalTrainer._run reads from the file
        try:
            result = await asyncio.to_thread(
                self.pipeline.train_one,
                self.train,
                task.assignment(self.name, seed),
                cast(torch.Tensor, params),
                state,
                broadcast,
                on_disk,
            )
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
        self.pipeline.keep(self.name, result)  # as the simulator keeps it (a settling program: held)
        report = None
        if self.privacy is not None:
            update, report, problem = self.privacy.release(update, task.raw)
            if problem is not None:  # judged from the noised update alone; the notice says no reason
                await self._failed(task, "diverged", problem)
                return
        if task.secure:  # the update leaves this node only masked (client/secure_node.py)
            from .secure_node import run_secure_round  # secure aggregation only when the config asks

            accepted = await run_secure_round(self, task, update, report)
            self.rounds_done += accepted
            self.pipeline.settle({self.name} if accepted else None)  # SCAFFOLD: Delta c_i went into the sum
            return
        extra = {"round": task.round, **({"privacy": report} if report is not None else {})}
        tag = (task.round, task.seed)  # this upload's entry in the error feedback
        try:
            payload = self.pipeline.encode(update, self.name, task.seed, tag)
        except OutOfHalfRange as e:  # float16 would send Inf: nothing leaves the node
            self.pipeline.settle(None)
            await self._failed(task, "diverged", str(e))
            return
        accepted = False
        try:
            # the header and the delta's own memory: no encoded copy of a dense or half-precision update
            body = Body(update_parts(update, self.trainer.spec, extra, payload=payload, zstd_level=self.zstd_level))
            accepted = await self._upload(task, body)
        finally:  # top-k: what the server did not take goes back into the residual (also on NodeError)
            self.pipeline.feedback(self.name, tag, accepted)
            self.pipeline.settle({self.name} if accepted else None)  # SCAFFOLD: c_i moves only when taken

    def failure_line(self, e: UserCodeError, task: TaskMessage | None = None) -> str:
        """What this node tells the server of its task's failure: the whole line, or under DP (this
        node's own, or the run's) only the task's part and the exception's type, nothing of the data."""
        private = self.privacy is not None or (task is not None and task.privacy is not None)
        return e.public() if private else str(e)

    async def _user_code_failed(self, task: TaskMessage, e: UserCodeError) -> None:
        """The task's own code raised in a round: the server stops waiting for this node's update."""
        self.failed_reason = self.failure_line(e, task)
        await self._failed(task, "failed", self.failed_reason)

    async def _failed(self, task: TaskMessage, reason: str, detail: str) -> None:
        """This task failed here: one line, the server told (POST /v1/failed, docs/protocol.md),
        and the task is remembered so that it is not trained again."""
        round_, version = task.key
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
        self.failed_tasks.add(task.key)
        try:
            await self._request("POST", "/v1/failed", json={"round": round_, "version": version, "reason": reason})
        except (Refused, Retry) as e:
            log.info("%s: the failure was not reported to the server: %s", where, e)

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
