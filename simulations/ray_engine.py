"""The Ray engine: shoal's own protocols in the driver, local training on a pool of Ray actors.

``simulation.engine = "ray"``. The driver is an :class:`InProcessSimulation` (sync rounds, the
virtual clock's FedBuff / FedAsync and deadline rounds, the client steps: attacks, distributed-DP
noise shares, compression and the wire; secure aggregation; central DP; accounting; evaluation),
whose client pool is :class:`RayClients`: a round's assignments are cut into contiguous parts of
about equal examples, one per worker, and the updates come back in assignment order.

Workers (simulations/ray_worker.py's ``RayWorker``) are long-lived actors, each with one model
replica, that run the in-process engine's client pipeline (client/pipeline.py). Each client trains
with its assignment's seed (its batches and its dropout draws), so its update does not depend on
the worker that trains it. A client's state (FedBN buffers, SCAFFOLD's control variate, personal
parameters: client/state.py) stays in the driver's store; it travels with the assignment and the
new state comes back with the update. Hence the same config and seed give the in-process engine's
model (up to float summation order).

Partial sums (:class:`SummedRound`): when a round's pipeline is a plain weighted mean (no client
step but a dense wire, no secure aggregation, no robust rule or DP mean), each worker returns
``sum_k w_k delta_k`` of its clients instead of their updates, so the driver's memory and
traffic are O(model) per worker, not per client.

Restarts: actors restart up to ``simulation.ray_max_restarts`` times; a call lost with its actor
is sent again, to the restarted actor or to another, and since training depends only on the
global model, the data, the seed and the local state, the round's result does not change.

Ray is an optional extra (``shoal[ray]``) and is imported only inside functions here.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shoal.aggregation import Strategy, WeightedMean
from shoal.algorithms import algorithm_of
from shoal.assembly import with_absolute_task
from shoal.client.algorithms import ClientResult
from shoal.config import Config
from shoal.errors import ConfigError, EngineError
from shoal.rounds import Assignment
from shoal.seeding import derive_seed
from shoal.tasks import BuiltinTask
from shoal.update import PartialSum, Update

from .client_data import client_id
from .gossip.network import GossipNetwork
from .inprocess import RUNNERS, InProcessSimulation, PlainRound, RoundRunner
from .ray_worker import RayWorker, WorkerSetup, WorkItem, clients_digest
from .run_loop import OnRecord, run_engine

if TYPE_CHECKING:
    from shoal.task import Task

log = logging.getLogger(__name__)

# How long a call waits for its worker to come back after a crash before it goes to another.
RESTART_WAIT_S = 120.0


def ray_init_args(cfg: Config) -> dict[str, Any]:
    """``ray.init`` arguments: the cluster at ``simulation.ray_address``, or a new local runtime
    (never one found on the machine) whose workers run at the driver's priority: Ray's default
    niceness of 15 made them lose the CPU to any other process (docs/results.md, "Ray engine")."""
    sim = cfg.simulation
    if sim.ray_address:
        return {"address": sim.ray_address}
    return {
        "address": "local",
        "num_cpus": sim.ray_num_cpus or os.cpu_count() or 1,
        "include_dashboard": False,
        "_system_config": {"worker_niceness": 0},
    }


def worker_count(cfg: Config, cpus: float, gpus: float, nodes: int) -> int:
    """How many workers: ``ray_workers``, or ``ray_workers_per_node`` on each node, or as many
    as the cluster's CPUs (and GPUs, when workers take a share of one) hold; a ConfigError
    when the cluster cannot hold what was asked."""
    sim = cfg.simulation
    per_cpu, per_gpu = sim.ray_cpus_per_worker, sim.ray_gpus_per_worker
    fit = math.floor(cpus / per_cpu + 1e-9)
    if per_gpu > 0:
        fit = min(fit, math.floor(gpus / per_gpu + 1e-9))
    n = sim.ray_workers or sim.ray_workers_per_node * nodes or fit
    if n < 1 or n > fit:
        raise ConfigError(
            f"the Ray cluster has {cpus:g} CPU(s) and {gpus:g} GPU(s) on {nodes} node(s): it holds {fit} worker(s) "
            f"of simulation.ray_cpus_per_worker = {per_cpu:g} and ray_gpus_per_worker = {per_gpu:g}, "
            f"not {max(n, 1)}; lower simulation.ray_workers / ray_workers_per_node or the per-worker resources"
        )
    return n


@dataclass
class Submission:
    """Calls sent to workers, not read yet (WorkerPool.submit / collect)."""

    method: str
    args: list[tuple]
    owners: list[int]
    refs: list[Any]


class WorkerPool:
    """Long-lived RayWorker actors and calls that survive a worker's death.

    Starts a local Ray runtime (or joins ``simulation.ray_address``) unless Ray is already
    initialised, and shuts it down on :meth:`close` only if it started it. A pool may serve
    several simulations one after another (workers rebuild when the config changes).
    ``on_submitted`` (a test hook) runs after a call's work was sent, before its results are read."""

    def __init__(self, cfg: Config):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        t0 = time.perf_counter()
        self._started = not ray.is_initialized()
        self.start_timeout_s = cfg.simulation.ray_start_timeout_s
        if self._started:
            with warnings.catch_warnings():  # Ray's notice of a future default; workers pick devices themselves
                warnings.filterwarnings("ignore", category=FutureWarning, module="ray")
                ray.init(**ray_init_args(cfg))
        sim = cfg.simulation
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
        res = ray.cluster_resources()
        self.size = worker_count(cfg, res.get("CPU", 0.0), res.get("GPU", 0.0), len(nodes))
        threads = max(1, int(sim.ray_cpus_per_worker))
        actor = ray.remote(RayWorker)
        opts: dict[str, Any] = {
            "num_cpus": sim.ray_cpus_per_worker,
            "num_gpus": sim.ray_gpus_per_worker,
            "max_restarts": sim.ray_max_restarts,
            "max_task_retries": 0,  # the driver re-sends a lost call itself (possibly to another worker)
        }
        self.opts = opts
        self.actors: list[Any]
        if sim.ray_workers_per_node:
            places = [n["NodeID"] for n in nodes for _ in range(sim.ray_workers_per_node)]
            self.actors = [
                actor.options(**opts, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                    threads
                )
                for node in places
            ]
        else:
            self.actors = [actor.options(**opts).remote(threads) for _ in range(self.size)]
        self.on_submitted: Callable[[WorkerPool, str], None] | None = None
        self.resubmitted = 0  # calls sent again after their worker died
        self.start_s = time.perf_counter() - t0
        log.info("ray: %d worker(s) on %d node(s)", len(self.actors), len(nodes))

    def __len__(self) -> int:
        return len(self.actors)

    def wait_ready(self, sub: Submission, what: str) -> None:
        """EngineError, with what the cluster has free, unless every call of ``sub`` finishes within
        ``simulation.ray_start_timeout_s`` (workers that Ray cannot place wait for ever otherwise)."""
        import ray

        ready, pending = ray.wait(sub.refs, num_returns=len(sub.refs), timeout=self.start_timeout_s)
        if pending:
            free = ray.available_resources()
            raise EngineError(
                f"{len(pending)} of {len(sub.refs)} Ray workers did not {what} within simulation.ray_start_timeout_s = "
                f"{self.start_timeout_s:g} s: each asks for {self.opts['num_cpus']:g} CPU(s) and "
                f"{self.opts['num_gpus']:g} GPU(s), and the cluster has {free.get('CPU', 0):g} CPU(s) and "
                f"{free.get('GPU', 0):g} GPU(s) free now (another Ray job may hold them): free them, ask for fewer "
                "workers or resources, or raise the timeout"
            )

    def call(self, method: str, args: list[tuple], offset: int = 0) -> list[Any]:
        """``method(*args[p])`` on worker ``(offset + p) % size`` for each part p, in parallel;
        the results in ``args`` order. A call whose worker dies is sent again (see the module doc)."""
        return self.collect(self.submit(method, args, offset))

    def submit(self, method: str, args: list[tuple], offset: int = 0) -> Submission:
        """Send the calls of :meth:`call` without waiting; :meth:`collect` reads them."""
        n = len(self.actors)
        owners = [(offset + p) % n for p in range(len(args))]
        refs = [getattr(self.actors[w], method).remote(*a) for w, a in zip(owners, args)]
        if self.on_submitted is not None:
            self.on_submitted(self, method)
        return Submission(method, args, owners, refs)

    def collect(self, sub: Submission) -> list[Any]:
        return [self._result(sub.method, a, w, ref) for a, w, ref in zip(sub.args, sub.owners, sub.refs)]

    def _result(self, method: str, args: tuple, worker: int, ref: Any) -> Any:
        """The call's result; while its worker restarts (ActorUnavailableError) the call is sent
        to it again, and once it is gone for good (ActorDiedError) to the next worker."""
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        n = len(self.actors)
        w = worker
        for _ in range(n):
            deadline = time.monotonic() + RESTART_WAIT_S
            delay = 0.05
            while True:
                try:
                    return ray.get(ref)
                except RayActorError as e:
                    self.resubmitted += 1
                    log.warning("ray worker %d lost a %s call (%s); sending it again", w, method, type(e).__name__)
                    if isinstance(e, ActorDiedError) or time.monotonic() > deadline:
                        break
                    time.sleep(delay)
                    delay = min(2 * delay, 2.0)
                    ref = getattr(self.actors[w], method).remote(*args)
            w = (w + 1) % n
            ref = getattr(self.actors[w], method).remote(*args)
        raise RuntimeError(f"every Ray worker failed the {method} call; the round cannot finish")

    def close(self) -> None:
        """Stop the workers (and the Ray runtime if this pool started it)."""
        import ray

        if not ray.is_initialized():
            return
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._started:
            ray.shutdown()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_contiguous(weights: list[int], parts: int) -> list[range]:
    """``len(weights)`` items cut into at most ``parts`` contiguous, non-empty runs of about equal weight."""
    n = len(weights)
    parts = min(parts, n)
    if parts <= 1:
        return [range(n)] if n else []
    cum = list(itertools.accumulate(max(w, 1) for w in weights))
    cuts: list[int] = []
    for p in range(1, parts):
        cut = bisect.bisect_left(cum, cum[-1] * p / parts) + 1
        cut = min(max(cut, (cuts[-1] if cuts else 0) + 1), n - (parts - p))
        cuts.append(cut)
    return [range(a, b) for a, b in zip([0, *cuts], [*cuts, n])]


def setup_key(cfg: Config, *extra: Any) -> str:
    text = json.dumps([cfg.to_dict(), *extra], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def prepare_workers(
    pool: WorkerPool, setup: WorkerSetup, task: Task, numel: int, digest: str, count: str
) -> list[dict[str, Any]]:
    """Every worker builds itself for ``setup``; its model size and clients' fingerprint must be
    the driver's (``numel``, ``digest`` of ``count``, e.g. "8 clients"), else a ConfigError."""
    cfg = setup.cfg
    if not cfg.task.app and type(task) is not BuiltinTask:
        raise ConfigError(
            f"simulation.engine = 'ray' rebuilds the task on every worker from [task] app, but this run's "
            f"task ({type(task).__name__}) was given as an object: name it with task.app = "
            "'path/to/file.py:name' (or --task) so that workers can load it"
        )
    sub = pool.submit("prepare", [(setup,)] * len(pool))
    pool.wait_ready(sub, "start and load the task")
    infos = pool.collect(sub)
    for i, info in enumerate(infos):
        if info["numel"] != numel or info["digest"] != digest:
            raise ConfigError(
                f"Ray worker {i} built a task with {info['num_clients']} clients and a model of "
                f"{info['numel']} parameters, not the driver's {count} and {numel}: the task must give "
                "the same data and model wherever it is loaded (task.app, [task.args], seed)"
            )
    return infos


def worker_figures(pool: WorkerPool, infos: list[dict[str, Any]], prepare_s: float) -> dict[str, Any]:
    """For summary.json: the workers, their nodes, re-sent calls, start-up and peak memory."""
    peaks = [round(st["peak_rss_mb"], 1) for st in pool.call("stats", [()] * len(pool))]
    return {
        "ray_worker_peak_rss_mb": peaks,
        "engine": "ray",
        "ray_workers": len(infos),
        "ray_nodes": len({i["node"] for i in infos}),
        "ray_resubmitted": pool.resubmitted,
        "ray_start_s": round(pool.start_s, 3),  # Ray runtime and worker processes
        "ray_prepare_s": round(prepare_s, 3),  # workers loading the task, data and model
    }


class RayClients:
    """The ClientPool of the Ray engine: the selected clients train on the pool's workers."""

    def __init__(self, sim: InProcessSimulation, pool: WorkerPool, owns_pool: bool = False):
        cfg = sim.cfg
        self.sim = sim
        self.pool = pool
        self.owns_pool = owns_pool
        n = len(sim.client_ids)
        sizes = [sim.shards.size(i) for i in range(n)]
        self.setup = WorkerSetup(
            setup_key(cfg, sim.rounds.sample_size(n), max(sizes, default=0)),
            cfg,
            sim.rounds.sample_size(n),
            max(sizes, default=0),
        )
        t0 = time.perf_counter()
        digest = clients_digest(sim.shards, sim.client_ids)
        infos = prepare_workers(pool, self.setup, sim.task, sim.spec.numel, digest, f"{n} clients")
        self.prepare_s = time.perf_counter() - t0
        self.infos = infos
        self._offset = 0
        log.info(
            "ray: %d worker(s) on %d node(s), devices %s, up to %d clients batched per worker",
            len(infos),
            len({i["node"] for i in infos}),
            ",".join(sorted({i["device"] for i in infos})),
            max(i["batched"] for i in infos),
        )

    def _parts(self, tasks: list[Assignment]) -> tuple[list[list[WorkItem]], int]:
        sim = self.sim
        keeps = sim.program.keeps_state
        items = [
            WorkItem(
                sim.client_index(t.client_id),
                t,
                {k: v.cpu() for k, v in sim.client_state(t.client_id).items()} if keeps else None,
            )
            for t in tasks
        ]
        runs = split_contiguous([sim.shards.size(it.index) for it in items], len(self.pool))
        offset = self._offset
        self._offset = (self._offset + len(runs)) % len(self.pool)  # spread single launches over workers
        return [[items[i] for i in r] for r in runs], offset

    def _global(self, global_params: torch.Tensor):
        import ray

        return ray.put(global_params.detach().float().cpu().numpy())

    def train(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        if tasks:
            yield from self.submit(tasks, global_params)()

    def submit(
        self, tasks: list[Assignment], global_params: torch.Tensor
    ) -> Callable[[], list[tuple[Assignment, Update]]]:
        """Send ``tasks`` to the workers now; the returned function waits for their updates (in the
        order LocalClients gives them), so the virtual clock goes on while the workers train."""
        parts, offset = self._parts(tasks)
        g = self._global(global_params)
        broadcast = {k: v.detach().cpu() for k, v in self.sim.broadcast().items()}
        sub = self.pool.submit("train", [(self.setup, g, part, broadcast) for part in parts], offset)
        device = global_params.device

        def results() -> list[tuple[Assignment, Update]]:
            chunks = self.pool.collect(sub)
            done = [(it, res) for part, chunk in zip(parts, chunks) for it, res in zip(part, chunk)]
            out = []
            for k in self._order(tasks):
                it, (delta, n, metrics, state, to_server) = done[k]
                t = it.task
                update = Update(torch.from_numpy(np.array(delta)).to(device), int(n), t.version, t.client_id, metrics)
                result = ClientResult(update, state or {}, to_server)
                out.append((t, self.sim.keep_result(t.client_id, result)))
            return out

        return results

    def _order(self, tasks: list[Assignment]) -> list[int]:
        """The order LocalClients would hand these results on in (the batched trainer's: most local
        steps first), so that whatever follows (secure aggregation's stochastic rounding draws from
        one generator in arrival order; sums round in it) sees the in-process engine's order."""
        batched = self.sim.batched
        if batched is None:
            return list(range(len(tasks)))
        return batched.order([self.sim.shards.size(self.sim.client_index(t.client_id)) for t in tasks])

    def train_sums(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[PartialSum]:
        """Each worker's partial sum of its part of ``tasks`` (SummedRound)."""
        if not tasks:
            return
        sim = self.sim
        sim.participants.update(t.client_id for t in tasks)
        parts, offset = self._parts(tasks)
        g = self._global(global_params)
        results = self.pool.call("train_sum", [(self.setup, g, part) for part in parts], offset)
        for res in results:
            sim.wire.count_up(res["bytes_up"])
            for code, k in res["rejected"].items():
                sim.rounds.rejected[code] = sim.rounds.rejected.get(code, 0) + k
            for cid, state in res["local_states"].items():
                sim.states.put(cid, state)
            yield PartialSum(
                torch.from_numpy(np.array(res["weighted_sum"])),
                float(res["total_weight"]),
                sim.cfg.strategy.weighting,
                list(res["senders"]),
                int(res["num_examples"]),
                float(res["loss_sum"]),
                tasks[0].version,
            )

    def figures(self) -> dict[str, Any]:
        return worker_figures(self.pool, self.infos, self.prepare_s)

    def close(self) -> None:
        if self.owns_pool:
            self.pool.close()


def summing_blocker(sim: InProcessSimulation) -> str | None:
    """Why this simulation's rounds need each client's update (None: workers may sum them)."""
    cfg = sim.cfg
    if not cfg.simulation.ray_partial_sums:
        return "simulation.ray_partial_sums = false"
    if not algorithm_of(cfg).summable:
        return f"algorithm.name = {cfg.algorithm.name!r} returns each client's state and step"
    if cfg.secure_aggregation.enabled:
        return "secure aggregation masks each update"
    if cfg.compression.encoding != "dense":
        return f"compression.encoding = {cfg.compression.encoding!r} encodes each update"
    steps = [type(s).__name__ for s in sim.client_steps if s is not sim.wire]
    if steps:
        return f"client steps act on each update ({', '.join(steps)})"
    strategy = sim.rounds.strategy
    agg = getattr(strategy, "aggregator", None)
    if type(strategy) is not Strategy or type(agg) is not WeightedMean:
        return f"the {type(agg).__name__} aggregator needs each update"
    return None


class SummedRound:
    """The round runner when workers may sum: each worker's clients reach the strategy as one
    PartialSum (InProcessSimulation.run_round submits it with SyncRounds.submit_sum)."""

    def __init__(self, sim: InProcessSimulation):
        if not isinstance(sim.clients, RayClients):
            raise TypeError("SummedRound needs the Ray engine's client pool")
        self.sim = sim
        self.clients = sim.clients

    def updates(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[tuple[Assignment, Update]]:
        return PlainRound(self.sim).updates(tasks, global_params)

    def partial_sums(self, tasks: list[Assignment], global_params: torch.Tensor) -> Iterator[PartialSum]:
        return self.clients.train_sums(tasks, global_params)


class RayPeers:
    """The PeerPool of gossip on Ray (simulations/gossip/network.py): the peers a round trains
    are cut into contiguous parts, one per worker; each new model row comes back in order.
    The driver keeps the network, the models, the algorithm and every message."""

    def __init__(self, net: GossipNetwork, pool: WorkerPool):
        self.net, self.pool = net, pool
        n = len(net.shards)
        self.setup = WorkerSetup(setup_key(net.cfg, "gossip"), net.cfg, 1, max(map(net.shards.size, range(n))))
        ids = net.data.client_ids
        names = [str(c) for c in ids] if ids is not None else [client_id(i) for i in range(n)]
        t0 = time.perf_counter()
        digest = clients_digest(net.shards, names)
        self.infos = prepare_workers(pool, self.setup, net.task, net.spec.numel, digest, f"{n} peers")
        self.prepare_s = time.perf_counter() - t0
        self._offset = 0

    def train(self, indices: list[int], models: torch.Tensor, round: int) -> Iterator[tuple[int, torch.Tensor]]:
        net = self.net
        seed = net.cfg.simulation.seed
        items = [(i, models[i].detach().cpu().numpy(), derive_seed(seed, round, i)) for i in indices]
        runs = split_contiguous([net.shards.size(i) for i in indices], len(self.pool))
        offset = self._offset
        self._offset = (self._offset + len(runs)) % len(self.pool)  # spread single wakes over workers
        results = self.pool.call("train_peers", [(self.setup, [items[k] for k in r]) for r in runs], offset)
        rows = [row for part in results for row in part]
        for i, row in zip(indices, rows):
            yield i, torch.from_numpy(np.array(row)).to(net.device)  # Ray hands back read-only arrays

    def figures(self) -> dict[str, Any]:
        return worker_figures(self.pool, self.infos, self.prepare_s)


def ray_peers(pool: WorkerPool) -> Callable[[GossipNetwork], RayPeers]:
    """The ``peers`` factory of a gossip simulation whose peers train on ``pool``'s workers."""
    return lambda net: RayPeers(net, pool)


def ray_simulation(cfg: Config, pool: WorkerPool | None = None) -> InProcessSimulation:
    """An InProcessSimulation whose clients train on Ray workers: ``pool`` (shared by the caller)
    or a pool made here, closed by ``sim.clients.close()``."""
    cfg = with_absolute_task(cfg)  # workers import the task file themselves, maybe elsewhere
    own = pool is None
    pool = pool if pool is not None else WorkerPool(cfg)

    def runner(sim: InProcessSimulation) -> RoundRunner:
        """The runner the parts name (shoal.assembly chose it); only a plain round may instead
        let each worker send its clients' partial sum."""
        if sim.parts.runner != "plain":
            return RUNNERS[sim.parts.runner](sim)
        why = summing_blocker(sim)
        if why is None:
            log.info("ray: workers send partial sums (plain weighted mean)")
            return SummedRound(sim)
        log.info("ray: workers send each client's update: %s", why)
        return PlainRound(sim)

    try:
        return InProcessSimulation.from_config(cfg, clients=lambda s: RayClients(s, pool, owns_pool=own), runner=runner)
    except BaseException:
        if own:
            pool.close()
        raise


def run_ray_simulation(
    cfg: Config,
    out_dir: str | Path | None = None,
    progress: bool | None = None,
    on_record: OnRecord | None = None,
    pool: WorkerPool | None = None,
) -> dict[str, Any]:
    """``simulation.engine = "ray"``: the run of experiment.run_simulation (sync rounds, or the
    virtual clock for async / heterogeneity) with the clients on Ray workers."""
    if cfg.simulation.mode == "gossip":  # the network and its messages here, local training on the workers
        from .gossip import run_gossip_simulation

        cfg = with_absolute_task(cfg)
        own = pool is None
        pool = pool if pool is not None else WorkerPool(cfg)
        try:
            return run_gossip_simulation(cfg, out_dir, progress, on_record, peers=ray_peers(pool))
        finally:
            if own:
                pool.close()
    sim = ray_simulation(cfg, pool)
    try:
        if cfg.simulation.mode == "async" or cfg.heterogeneity.enabled:  # on the virtual clock
            from .virtual_run import run_virtual

            return run_virtual(sim.cfg, out_dir, progress, on_record, sim=sim)
        return run_engine(lambda: sim, sim.cfg, out_dir, progress, on_record)
    finally:
        if isinstance(sim.clients, RayClients):
            sim.clients.close()
