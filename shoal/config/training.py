"""The sections of what a client does and where its data and model come from: [simulation],
[task], [data], [model], [train], [strategy], [algorithm], [robust], [attack], [compression],
[heterogeneity] and [output]."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.algorithms import AlgorithmName
from shoal.errors import ConfigError

from .checks import positive


@dataclass
class SimulationConfig:
    """The many-clients-on-one-machine experiment."""

    seed: int = 0  # seeds the model, the split, client selection and training (same seed, same numbers)
    rounds: int = 50  # server rounds (sync) or global versions (async) to run
    num_clients: int = 30  # clients to make where the dataset has no natural split
    clients_per_round: int = 10  # K; 0 means use `fraction`
    fraction: float = 0.1  # C: a fraction of all clients each round (at least 1)
    eval_every: int = 1  # evaluate the global model every k rounds (and the last)
    engine: Literal["inprocess", "ray", "flower"] = (
        "inprocess"  # inprocess (simulations/inprocess.py) | ray (workers, simulations/ray_engine.py) | flower
    )
    mode: Literal["sync", "async", "gossip"] = (
        "sync"  # sync rounds | async (FedAsync/FedBuff, [asynchronous]) | gossip ([gossip], no server)
    )
    device: str = "auto"  # where simulated clients train: auto | cpu | cuda[:N]
    progress: bool = True  # progress bar on a terminal
    batch_clients: int | str = "auto"  # clients trained at once (vmap): auto | N | 1 (one by one)
    cuda_graphs: bool = True  # on a GPU, record each batched local step once and replay it (fewer launches)
    flower_client_cpus: float = 1.0  # engine=flower: CPUs Ray reserves per client (Flower's default is 2)
    flower_client_gpus: float = 0.0  # engine=flower: GPU fraction per client (0.25 = four per GPU)
    ray_address: str = ""  # engine=ray|flower: an existing Ray cluster ("auto", "host:6379"); "" starts one here
    ray_num_cpus: int = 0  # engine=ray|flower without ray_address: CPUs the local Ray runtime may use (0 = all)
    ray_workers: int = 0  # engine=ray: worker actors; 0 = ray_workers_per_node on each node, else fill the CPUs
    ray_workers_per_node: int = 0  # engine=ray: workers placed on every node of the cluster (0 = Ray places them)
    ray_cpus_per_worker: float = 1.0  # engine=ray: CPUs reserved per worker (also its torch threads)
    ray_gpus_per_worker: float = 0.0  # engine=ray: GPU fraction per worker (0.25 = four workers share a GPU)
    # engine=ray, local runtime: let several workers share one GPU; false runs the in-process engine there
    # instead, which batches the whole round's clients on that GPU (docs/ray.md, "One GPU")
    ray_share_gpu: bool = False
    ray_max_restarts: int = 3  # engine=ray: a dead worker is restarted this often; its clients are re-run
    ray_partial_sums: bool = True  # engine=ray: workers sum their clients' updates when the pipeline allows
    # engine=ray / flower: longest wait for the workers (Flower: its clients) to be placed and loaded,
    # before the run stops with one line saying what is missing (never an endless wait)
    ray_start_timeout_s: float = 300.0

    def validate(self) -> None:
        positive("simulation.rounds", self.rounds)
        positive("simulation.num_clients", self.num_clients)
        positive("simulation.clients_per_round", self.clients_per_round, allow_zero=True)
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"simulation.fraction = {self.fraction} must be in (0, 1]")
        positive("simulation.eval_every", self.eval_every)
        b = self.batch_clients
        if not ((isinstance(b, int) and b >= 1) or b == "auto"):
            raise ConfigError(
                f'simulation.batch_clients = {b!r} must be "auto" or an integer >= 1 (1 trains clients one by one)'
            )
        positive("simulation.flower_client_cpus", self.flower_client_cpus)
        positive("simulation.flower_client_gpus", self.flower_client_gpus, allow_zero=True)
        positive("simulation.ray_num_cpus", self.ray_num_cpus, allow_zero=True)
        positive("simulation.ray_workers", self.ray_workers, allow_zero=True)
        positive("simulation.ray_workers_per_node", self.ray_workers_per_node, allow_zero=True)
        positive("simulation.ray_cpus_per_worker", self.ray_cpus_per_worker)
        positive("simulation.ray_gpus_per_worker", self.ray_gpus_per_worker, allow_zero=True)
        positive("simulation.ray_max_restarts", self.ray_max_restarts, allow_zero=True)
        positive("simulation.ray_start_timeout_s", self.ray_start_timeout_s)
        if self.ray_share_gpu and self.engine != "ray":
            raise ConfigError(
                f"simulation.ray_share_gpu = true applies to simulation.engine = 'ray' (Ray workers on one GPU), "
                f"not to {self.engine!r}: drop it or set the engine"
            )
        if self.ray_workers and self.ray_workers_per_node:
            raise ConfigError(
                "simulation.ray_workers and simulation.ray_workers_per_node are both set: "
                "give the total or the number per node, not both"
            )


@dataclass
class DataConfig:
    """Which dataset and how it is split into client shards."""

    dataset: Literal["synthetic", "mnist", "fashion-mnist", "femnist"] = "synthetic"  # the built-in task's data
    dir: str = ""  # folder of the dataset files (not needed for synthetic)
    partition: Literal["natural", "iid", "dirichlet", "shards"] = "natural"  # how examples go to clients
    dirichlet_alpha: float = 0.5  # dirichlet: label skew (smaller is more skewed)
    shards_per_client: int = 2  # McMahan's pathological non-IID split
    shard_size: int = 300  # shards: examples per shard
    synthetic_alpha: float = 1.0  # Synthetic(alpha, beta) of Li et al. (FedProx)
    synthetic_beta: float = 1.0  # how much the clients' features differ
    synthetic_iid: bool = False  # Synthetic-IID: every client draws from one distribution
    test_fraction: float = 0.2  # held-out share of each synthetic client's samples
    max_clients: int = 0  # femnist: use only the first N writers (0 = all)
    verify_checksums: bool = True  # check the dataset files' SHA-256 before reading them

    def validate(self) -> None:
        positive("data.dirichlet_alpha", self.dirichlet_alpha)
        positive("data.shards_per_client", self.shards_per_client)
        positive("data.shard_size", self.shard_size)
        if not 0 < self.test_fraction < 1:
            raise ConfigError(f"data.test_fraction = {self.test_fraction} must be in (0, 1)")
        if self.dataset != "synthetic" and not self.dir:
            raise ConfigError(
                f"data.dir is empty: dataset {self.dataset!r} is read from files; "
                "set it in the config or with --set data.dir=PATH"
            )


@dataclass
class ModelConfig:
    name: Literal["logreg", "2nn", "cnn", "femnist_cnn"] = "logreg"  # the built-in task's model


@dataclass
class TrainConfig:
    """Local training on a client (the same on simulated and real nodes)."""

    epochs: int = 1  # E
    batch_size: int | float = 10  # B; `inf` (TOML) or 0 means the full local dataset
    lr: float = 0.01  # the local SGD learning rate
    momentum: float = 0.0  # local SGD momentum
    weight_decay: float = 0.0  # local L2 weight decay
    prox_mu: float = 0.0  # FedProx proximal term (Li et al. 2020); 0 is FedAvg
    device: str = "auto"  # auto | cpu | cuda | cuda:N (client nodes)
    # fp32 | tf32 (on a GPU: matmuls and convolutions in TensorFloat-32) | bf16 (autocast of the forward pass)
    precision: Literal["fp32", "tf32", "bf16"] = "fp32"

    def validate(self) -> None:
        positive("train.epochs", self.epochs)
        b = self.batch_size
        if not (b == 0 or b == math.inf or (float(b).is_integer() and b > 0)):
            raise ConfigError(f"train.batch_size = {b!r} must be a positive integer, or inf for full batch")
        positive("train.lr", self.lr)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum = {self.momentum} must be in [0, 1)")
        positive("train.weight_decay", self.weight_decay, allow_zero=True)
        positive("train.prox_mu", self.prox_mu, allow_zero=True)
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device = {self.device!r}: use auto, cpu, cuda or cuda:N")

    def batch(self, n: int) -> int:
        """The batch size for a client holding ``n`` examples."""
        b = self.batch_size
        return n if b == 0 or b == math.inf else min(int(b), n)


@dataclass
class StrategyConfig:
    """Server-side aggregation (Reddi et al. 2021 for the FedOpt family)."""

    name: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = "fedavg"  # the server optimizer
    weighting: Literal["examples", "uniform"] = "examples"  # examples (McMahan) | uniform
    server_lr: float = 1.0  # eta
    server_momentum: float = 0.9  # FedAvgM's beta
    beta1: float = 0.9  # FedAdam/FedYogi first-moment decay
    beta2: float = 0.99  # FedAdam/FedYogi second-moment decay
    tau: float = 1e-3  # adaptivity (FedAdam/Yogi/Adagrad)

    def validate(self) -> None:
        positive("strategy.server_lr", self.server_lr)
        positive("strategy.tau", self.tau)
        for k in ("server_momentum", "beta1", "beta2"):
            v = getattr(self, k)
            if not 0 <= v < 1:
                raise ConfigError(f"strategy.{k} = {v} must be in [0, 1)")


@dataclass
class AlgorithmConfig:
    """What clients do beyond plain local SGD, and what they keep between their rounds
    (simulation, sync rounds; docs/algorithms.md). The personal part of FedPer / FedRep is the
    task's ``personal`` parameters (shoal/task.py)."""

    name: AlgorithmName = (
        "fedavg"  # fedavg (FedProx: train.prox_mu) | scaffold | fednova | feddyn | ditto | fedper | fedrep
    )
    feddyn_alpha: float = 0.01  # feddyn: alpha, the weight of the dynamic regulariser (Acar et al. 2021)
    ditto_lambda: float = 0.1  # ditto: lambda, how strongly the personal model is pulled to the global one
    personal_epochs: int = 1  # ditto: epochs on the personal model; fedrep: epochs on the head first
    personal_eval_steps: int = -1  # fed_personal_* metrics after this many fine-tuning steps; -1 = off
    state_dir: str = ""  # clients' state between rounds: "" in memory, else safetensors files in this folder
    keep_optimizer_state: bool = False  # each client's SGD momentum carries over to its next round (else zero)

    def validate(self) -> None:
        positive("algorithm.feddyn_alpha", self.feddyn_alpha)
        positive("algorithm.ditto_lambda", self.ditto_lambda, allow_zero=True)
        positive("algorithm.personal_epochs", self.personal_epochs)
        if self.personal_eval_steps < -1:
            raise ConfigError(f"algorithm.personal_eval_steps = {self.personal_eval_steps} must be >= -1 (-1 = off)")


@dataclass
class RobustConfig:
    """Robust aggregation against faulty or malicious clients (aggregation/robust.py)."""

    rule: Literal["mean", "median", "trimmed_mean", "krum", "multikrum"] = "mean"  # how updates are combined
    trim_beta: float = 0.1  # trimmed_mean: drop this fraction at each end, per coordinate
    krum_f: int = 0  # krum/multikrum: Byzantine clients tolerated (needs n > 2f + 2)
    multikrum_m: int = 0  # multikrum: updates averaged; 0 means n - f
    norm_bound: float = 0.0  # clip each update to this L2 norm first; 0 = off
    max_updates: int = 1024  # buffered rules hold at most this many updates (memory bound)

    def validate(self) -> None:
        if not 0 <= self.trim_beta < 0.5:
            raise ConfigError(f"robust.trim_beta = {self.trim_beta} must be in [0, 0.5)")
        positive("robust.krum_f", self.krum_f, allow_zero=True)
        positive("robust.multikrum_m", self.multikrum_m, allow_zero=True)
        positive("robust.norm_bound", self.norm_bound, allow_zero=True)
        positive("robust.max_updates", self.max_updates)


@dataclass
class AttackConfig:
    """Simulated misbehaving clients (simulations/attacks.py)."""

    kind: Literal["none", "sign_flip", "scale", "gaussian", "label_flip", "nan", "inf"] = "none"  # what attackers send
    fraction: float = 0.0  # share of clients that attack (the first ones of a seeded shuffle)
    scale: float = 10.0  # sign_flip: delta -> -scale*delta; scale: delta -> scale*delta;
    # gaussian: delta -> N(0, scale^2)

    def validate(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ConfigError(f"attack.fraction = {self.fraction} must be in [0, 1]")
        positive("attack.scale", self.scale)


@dataclass
class CompressionConfig:
    """How client updates are encoded on the wire (aggregation/compression.py)."""

    # dense float32 | float16, bfloat16 (half precision) | q8 (8-bit, chunked) | topk (sparse)
    encoding: Literal["dense", "float16", "bfloat16", "q8", "topk"] = "dense"
    topk_fraction: float = 0.01  # topk: share of coordinates sent (with error feedback)
    q8_chunk: int = 1024  # q8: coordinates per float32 scale
    zstd: bool = False  # zstd-compress the encoded tensors
    zstd_level: int = 3  # zstd: compression level

    def validate(self) -> None:
        if not 0 < self.topk_fraction <= 0.5:
            raise ConfigError(
                f"compression.topk_fraction = {self.topk_fraction} must be in (0, 0.5] "
                "(above half, top-k costs more bytes than dense)"
            )
        positive("compression.q8_chunk", self.q8_chunk)
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"compression.zstd_level = {self.zstd_level} must be in 1..22")


@dataclass
class HeterogeneityConfig:
    """Simulated client speed, network delay and availability on a virtual clock
    (simulations/virtual_clock.py). Async mode always runs on the virtual clock."""

    enabled: bool = False  # sync mode: run on the virtual clock with these settings
    step_time_s: float = 0.05  # seconds per local step for a client of speed 1
    speed_sigma: float = 0.0  # client speed ~ lognormal(0, sigma); 0 = all equal
    network_delay_s: float = 0.0  # mean of an exponential delay, each way
    mean_on_s: float = 0.0  # mean available period (exponential); 0 = always available
    mean_off_s: float = 0.0  # mean unavailable period (exponential)
    max_virtual_time_s: float = 0.0  # stop at this virtual time; 0 = run simulation.rounds
    eval_interval_s: float = 0.0  # evaluate every so many virtual seconds; 0 = every eval_every versions

    def validate(self) -> None:
        for k in (
            "step_time_s",
            "speed_sigma",
            "network_delay_s",
            "mean_on_s",
            "mean_off_s",
            "max_virtual_time_s",
            "eval_interval_s",
        ):
            positive(f"heterogeneity.{k}", getattr(self, k), allow_zero=True)
        if self.step_time_s == 0:
            raise ConfigError("heterogeneity.step_time_s = 0: local training would take no time; use > 0")
        if self.mean_on_s > 0 and self.mean_off_s == 0:
            raise ConfigError("heterogeneity.mean_off_s = 0 with mean_on_s > 0: set both, or mean_on_s = 0 (always on)")


@dataclass
class TaskConfig:
    """The user's task (shoal/task.py): ``app = "path/to/file.py:name"`` or ``"package.module:name"``;
    ``[task.args]`` are passed to it. Empty: the built-in task of ``[model]`` + ``[data]``."""

    app: str = ""  # the task: path/to/file.py:name or package.module:name ("" = built-in)
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments passed to the task

    def validate(self) -> None:
        if self.app and ":" not in self.app:
            raise ConfigError(f"task.app = {self.app!r}: expected path/to/file.py:name or package.module:name")
        if self.args and not self.app:
            raise ConfigError("[task.args] is set but task.app is empty: name the task the args are for")


@dataclass
class OutputConfig:
    dir: str = "runs/latest"  # `shoal simulate`: metrics.jsonl, summary.json and plots go here
    plots: bool = True  # draw the plots (matplotlib)
    tensorboard: bool = False  # also write TensorBoard event files beside metrics.jsonl (shoal[tensorboard])
