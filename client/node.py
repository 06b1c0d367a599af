"""A client node: ask the server for work, train on its own data, send the update.

The model, loss and data come from the task (shoal/task.py), built through
shoal.assembly exactly as the server builds it. Only the update (a parameter delta,
the example count and training metrics) and, when asked, the metrics of the global
model on the node's own test data leave the node; the data never does. Network
failures and server restarts are retried with exponential backoff and full jitter
(AWS architecture blog, "Exponential Backoff And Jitter", 2015); a bad token, a
revoked node, an untrusted certificate or another model than the server's are not
retried. SIGINT/SIGTERM let the current step finish, then the node exits.

With ``[privacy]`` (:class:`NodePrivacy`, docs/privacy.md "In deployment") the node follows
its own config, not the server's word: in distributed mode it clips and adds its noise share
before the update leaves it, in local mode it trains with DP-SGD on a seed only it knows and
accounts its own epsilon; a server whose task names another privacy mode is refused.

Top-k error feedback: each upload's outcome is reported to the compressor (accepted on 200;
not accepted when refused, too late, or never sent), so what an upload carried is folded back
into the residual unless the server took it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import re
import secrets
import ssl
from collections.abc import Callable
from hashlib import sha256
from pathlib import Path
from typing import Self, cast

import aiohttp
import torch

from shoal import assembly
from shoal.accounting import LocalDpSgdAccountant, budget_allows, check_delta_against, dp_sgd_schedule
from shoal.aggregation.compression import OutOfHalfRange
from shoal.aggregation.dp import clip_to_norm, make_generator, noise_share, share_std
from shoal.assembly import NodeParts
from shoal.config import Config
from shoal.errors import ConfigError, ShoalError, short_repr
from shoal.privacy_plan import LOCAL_UPLOAD_EXAMPLES, plan_of
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
from shoal.tasks import BuiltinTask
from shoal.update import Update
from shoal.wire import update_parts

from .algorithms import ClientProgram
from .disk_model import DiskModel
from .http import Backoff, NodeError, Refused, Retry, ServerList
from .node_connection import ServerConnection
from .pipeline import ClientPipeline
from .runlog import RunTag
from .task_message import TaskMessage
from .training import LocalTrainer
from .training_report import diverged, figures_line
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


def builtin_local_data(task: BuiltinTask, shard: Shard) -> LocalData:
    """A shard of `shoal data split` for the built-in task: the model takes the shard's
    input shape and classes (as nodes did before tasks existed); the shard's own test data
    (``test_x`` / ``test_y``), when it has some, is the node's local test set."""
    task.input_shape = shard.input_shape
    task.num_classes = shard.num_classes or task.num_classes
    test = None if shard.test_x is None or shard.test_y is None else (shard.test_x, shard.test_y)
    return LocalData(train=(shard.x, shard.y), test=test)


class NodePrivacy:
    """This node's side of ``[privacy]``; the node's own config is its promise to its data.

    * ``central``: nothing is added here (the server clips and adds the noise, which is
      what central DP trusts it to do); the node checks that the server runs central DP
      with its z and C.
    * ``distributed``: clip to C and add N(0, z²C²/t) before the update leaves the node; the
      noise comes from the OS, never from the server's seed. In the clear t is the task's; with
      secure aggregation the share is added after the key directory, and t must be one this node
      can hold the server to (no more than its checked neighbourhood, and it unmasks no sum of
      fewer survivors): a task that asks for more is refused (client/secure_node.py).
    * ``local``: DP-SGD (the trainer) on a seed only this node knows (with the server's
      seed the server could redraw the noise and the example samples), and the node's own
      epsilon over its data size, batch, epochs and the rounds it took part in. That count
      is kept in a ledger file, so a restarted node goes on from it; the node takes no work
      that would pass ``privacy.target_epsilon``, and reports its epsilon with each update only
      where the report reveals nothing of its data (PrivacyPlan.node_reports).
    """

    def __init__(self, cfg: Config, name: str, num_train: int, ledger: Path | None = None):
        p = cfg.privacy
        if p.noise_multiplier <= 0:
            raise ConfigError(
                f"privacy.mode = {p.mode!r} with privacy.noise_multiplier = 0 adds no noise (epsilon "
                "is infinite); set a noise multiplier > 0, or privacy.mode = 'none'"
            )
        self.plan = plan_of(cfg)
        self.p, self.mode, self.name, self.ledger = p, p.mode, name, ledger
        self.accountant: LocalDpSgdAccountant | None = None
        if self.plan.dp_sgd:
            try:  # DP-SGD protects one of this node's examples
                check_delta_against(p.delta, num_train, "examples on this node")
            except ValueError as e:
                raise ConfigError(str(e)) from None
            self.schedule = dp_sgd_schedule(
                num_train, cfg.train.batch(num_train), cfg.train.epochs, p.local_sampling_rate
            )
            self.accountant = self.plan.local_accountant({name: self.schedule})
            self.accountant.load_state_dict({**self.accountant.state_dict(), "participations": {name: self._load()}})
            if p.target_epsilon and self.rounds == 0 and self.accountant.next_epsilon() > p.target_epsilon:
                raise ConfigError(
                    f"privacy.target_epsilon = {p.target_epsilon:g} is below the epsilon of one round of DP-SGD on "
                    f"this node's {num_train} examples ({self.accountant.next_epsilon():.3g} at delta = "
                    f"{p.delta:g}); raise it or raise privacy.noise_multiplier"
                )
            q, steps = self.schedule
            log.info(
                "local DP: DP-SGD on %d examples, sampling rate %.4g, %d steps a round, z = %g; epsilon = %.4g "
                "after %d rounds so far",
                num_train,
                q,
                steps,
                p.noise_multiplier,
                self.epsilon,
                self.rounds,
            )

    @property
    def rounds(self) -> int:
        return self.accountant.rounds_of(self.name) if self.accountant is not None else 0

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon if self.accountant is not None else 0.0

    def _ledger_entry(self) -> dict:
        return {
            "node": self.name,
            "schedule": list(self.schedule),
            "noise_multiplier": self.p.noise_multiplier,
            "accountant": self.p.accountant,
            "rounds": self.rounds,
        }

    def _load(self) -> int:
        """The rounds this node already spent on its data (0 without a ledger)."""
        if self.ledger is None or not self.ledger.exists():
            return 0
        try:
            saved = json.loads(self.ledger.read_text())
            rounds = int(saved["rounds"])
            same = (
                saved["node"],
                [float(v) for v in saved["schedule"]],
                float(saved["noise_multiplier"]),
                saved["accountant"],
            ) == (self.name, [float(v) for v in self.schedule], self.p.noise_multiplier, self.p.accountant)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(
                f"the privacy ledger {self.ledger} cannot be read ({type(e).__name__}: {e}); without "
                "it the rounds already spent are unknown: restore it, or give --privacy-ledger another "
                "file if this node's data was never trained on"
            ) from None
        if not same:
            raise ConfigError(
                f"the privacy ledger {self.ledger} was written for node {saved['node']!r} with DP-SGD schedule "
                f"{saved['schedule']} (sampling rate, steps a round), z = {saved['noise_multiplier']} and the "
                f"{saved['accountant']} accountant; this node now runs {list(self.schedule)}, z = "
                f"{self.p.noise_multiplier}, {self.p.accountant}: its {rounds} earlier rounds cannot be composed "
                "with these; keep the earlier settings, or use another ledger only for other data"
            )
        return rounds

    def _save(self) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.ledger.with_name(self.ledger.name + ".tmp")
            tmp.write_text(json.dumps(self._ledger_entry()))
            tmp.replace(self.ledger)
        except OSError as e:  # without its ledger the node cannot keep its own account: it stops
            raise ConfigError(
                f"the privacy ledger {self.ledger} cannot be written ({e}); give --privacy-ledger a writable file"
            ) from None

    def check_task(self, task: dict) -> None:
        """NodeError unless the server's task runs this node's privacy mode (and, where the
        server adds or divides the noise, with this node's z and C)."""
        info = task.get("privacy")
        if not isinstance(info, dict) or info.get("mode") != self.mode:
            theirs = info.get("mode") if isinstance(info, dict) else "none"
            raise NodeError(
                f"the server runs privacy.mode = {short_repr(theirs)}, this node's config says "
                f"{self.mode!r}: no update leaves this node with another privacy than its own config's"
            )
        if self.plan.dp_sgd:
            return
        for key in ("noise_multiplier", "clip_norm"):
            v, mine = info.get(key), getattr(self.p, key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isclose(v, mine, rel_tol=1e-9):
                raise NodeError(
                    f"the server runs privacy.{key} = {short_repr(v)}, this node's config says {mine:g}: "
                    "run the node with the server's [privacy] table"
                )
        if self.plan.client_shares:
            t = info.get("noise_shares")
            if not isinstance(t, int) or isinstance(t, bool) or t < 1:
                raise NodeError(f"the task's privacy.noise_shares = {short_repr(t)} must be an integer >= 1")
            if self.p.mechanism == "discrete_gaussian" and not isinstance(task.get("secure_aggregation"), dict):
                raise NodeError(
                    "this node adds its discrete-Gaussian noise while encoding for secure aggregation, and the "
                    "task runs none: refusing to send the update in the clear"
                )

    def allows_next_round(self) -> bool:
        """Local DP: False (with a log line) when one more round would pass privacy.target_epsilon."""
        return self.accountant is None or budget_allows(self.accountant, self.p.target_epsilon, self.p.delta)

    def training_seed(self, task_seed: int) -> int:
        """Local DP trains on a seed only this node knows; otherwise the task's (reproducible runs)."""
        return secrets.randbits(63) if self.plan.dp_sgd else task_seed

    def protect(self, update: Update, task: dict) -> Update:
        """What leaves the node. Distributed DP: clip to C, add this node's share N(0, z²C²/t).
        Local DP: the DP-SGD update and nothing data-dependent beside it (no train loss, local
        steps or example count: it says 1 example, and the server weighs local-DP updates alike)."""
        if self.plan.dp_sgd:
            return Update(update.delta, LOCAL_UPLOAD_EXAMPLES, update.base_version, update.sender, {})
        if not self.plan.client_shares or "secure_aggregation" in task:  # secure: after the key directory
            return update
        return self.add_share(update, int(task["privacy"]["noise_shares"]), task.get("round"))

    def release(self, update: Update, task: dict) -> tuple[Update, dict | None, str | None]:
        """What leaves the node for a trained update, without I/O: the protected update
        (:meth:`protect`), the report sent with it (:meth:`spend`: the round is counted first) and
        what is wrong with what the mechanism released (:meth:`released_problem`; then the node sends
        a notice without a reason instead of the update)."""
        update = self.protect(update, task)
        report = self.spend(int(task["round"]))  # counted before anything leaves the node
        return update, report, self.released_problem(update, task)

    def released_problem(self, update: Update, task: dict) -> str | None:
        """Local and distributed DP: what is wrong with the update the mechanism released (NaN/Inf in
        the noised delta; its loss is never looked at), or None. With secure aggregation the share is
        added later, after the key directory (client/secure_node.py): nothing is judged here. The clip
        maps a non-finite update to 0 and DP-SGD drops a non-finite example's gradient, so a noised
        update is finite; this is the last guard, on released values only."""
        if self.plan.server_noise or (self.plan.client_shares and "secure_aggregation" in task):
            return None
        return diverged(Update(update.delta, update.num_examples, update.base_version, update.sender, {}))

    def add_share(self, update: Update, t: int, round_) -> Update:
        """Distributed DP: clip to C and add N(0, z²C²/t) from the OS's entropy. With secure
        aggregation t is one this node checked against the key directory (client/secure_node.py)."""
        clipped, norm = clip_to_norm(update.delta, self.p.clip_norm)
        update.delta = noise_share(
            clipped, self.p.clip_norm, self.p.noise_multiplier, t, make_generator(update.delta.device, None)
        )  # OS entropy
        log.info(
            "round %s: update of norm %.4g clipped to C = %g, noise share N(0, %.4g^2) added (t = %d)",
            round_,
            norm,
            self.p.clip_norm,
            share_std(self.p.clip_norm, self.p.noise_multiplier, t),
            t,
        )
        return update

    def spend(self, round_: int) -> dict | None:
        """Local DP: count this round (the update is about to leave), save the ledger, log and
        return the report sent with the update: {epsilon, epsilon_next, delta, rounds}; None when
        the run withholds reports (PrivacyPlan.node_reports: the epsilon at q = B / n_k would tell
        the server roughly how many examples this node holds). The node's own budget check
        (:meth:`allows_next_round`) does not depend on it."""
        if self.accountant is None:
            return None
        self.accountant.record_round([self.name])
        self._save()
        report = {
            "epsilon": self.epsilon,
            "epsilon_next": self.accountant.next_epsilon(),
            "delta": self.p.delta,
            "rounds": self.rounds,
        }
        log.info(
            "round %d: local DP epsilon = %.4g at delta = %g after %d rounds (%.4g after one more%s)",
            round_,
            report["epsilon"],
            self.p.delta,
            self.rounds,
            report["epsilon_next"],
            f"; target {self.p.target_epsilon:g}" if self.p.target_epsilon else "",
        )
        return report if self.plan.node_reports else None


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
