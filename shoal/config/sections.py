"""The config's sections: one dataclass per TOML table, each checking its own keys.

Allowed choices are declared once, as ``Literal`` types on the fields: the loader's type
check, :func:`check_choices`, error messages and the factories (:func:`choices`) read them
from there. Settings that are fine alone but not together are checked in ``rules.py``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from shoal.algorithms import AlgorithmName
from shoal.errors import ConfigError

from .rules import check_combinations


def choices(section: type | Any, key: str) -> tuple[str, ...]:
    """The values a ``Literal`` field of a config section allows (declared once, on the field)."""
    hint = typing.get_type_hints(section if isinstance(section, type) else type(section))[key]
    if typing.get_origin(hint) is list:
        (hint,) = typing.get_args(hint)
    return typing.get_args(hint) if typing.get_origin(hint) is Literal else ()


def check_choices(section: Any, name: str) -> None:
    """Every ``Literal`` field holds one of its values (also for sections made in code, not TOML)."""
    if not dataclasses.is_dataclass(section):
        return
    for f in dataclasses.fields(section):
        allowed = choices(section, f.name)
        if not allowed:
            continue
        value = getattr(section, f.name)
        for v in value if isinstance(value, list) else [value]:
            if v not in allowed:
                raise ConfigError(f"{name}.{f.name} = {v!r} is not one of {', '.join(map(repr, allowed))}")


#: The one numeric setting where ``inf`` means something (a full batch); NaN is never a setting.
INFINITE_ALLOWED = frozenset({"train.batch_size"})


def check_finite(section: Any, name: str) -> None:
    """Every number in a section (lists and [task.args] tables included) is finite: NaN passes
    every ``<`` and ``>`` check, so a range check alone would let it through."""
    if not dataclasses.is_dataclass(section):
        return
    for f in dataclasses.fields(section):
        _finite(f"{name}.{f.name}", getattr(section, f.name))


def _finite(key: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        if not (value == math.inf and key in INFINITE_ALLOWED):
            raise ConfigError(f"{key} = {value!r} must be a finite number")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite(f"{key}[{i}]", v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _finite(f"{key}.{k}", v)


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if (isinstance(value, float) and not math.isfinite(value)) or value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key} = {value!r} must be {'>= 0' if allow_zero else '> 0'}")


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
    flower_client_cpus: float = 1.0  # engine=flower: CPUs Ray reserves per client (Flower's default is 2)
    flower_client_gpus: float = 0.0  # engine=flower: GPU fraction per client (0.25 = four per GPU)
    ray_address: str = ""  # engine=ray|flower: an existing Ray cluster ("auto", "host:6379"); "" starts one here
    ray_num_cpus: int = 0  # engine=ray|flower without ray_address: CPUs the local Ray runtime may use (0 = all)
    ray_workers: int = 0  # engine=ray: worker actors; 0 = ray_workers_per_node on each node, else fill the CPUs
    ray_workers_per_node: int = 0  # engine=ray: workers placed on every node of the cluster (0 = Ray places them)
    ray_cpus_per_worker: float = 1.0  # engine=ray: CPUs reserved per worker (also its torch threads)
    ray_gpus_per_worker: float = 0.0  # engine=ray: GPU fraction per worker (0.25 = four workers share a GPU)
    ray_max_restarts: int = 3  # engine=ray: a dead worker is restarted this often; its clients are re-run
    ray_partial_sums: bool = True  # engine=ray: workers sum their clients' updates when the pipeline allows
    # engine=ray / flower: longest wait for the workers (Flower: its clients) to be placed and loaded,
    # before the run stops with one line saying what is missing (never an endless wait)
    ray_start_timeout_s: float = 300.0

    def validate(self) -> None:
        _positive("simulation.rounds", self.rounds)
        _positive("simulation.num_clients", self.num_clients)
        _positive("simulation.clients_per_round", self.clients_per_round, allow_zero=True)
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"simulation.fraction = {self.fraction} must be in (0, 1]")
        _positive("simulation.eval_every", self.eval_every)
        b = self.batch_clients
        if not ((isinstance(b, int) and b >= 1) or b == "auto"):
            raise ConfigError(
                f'simulation.batch_clients = {b!r} must be "auto" or an integer >= 1 (1 trains clients one by one)'
            )
        _positive("simulation.flower_client_cpus", self.flower_client_cpus)
        _positive("simulation.flower_client_gpus", self.flower_client_gpus, allow_zero=True)
        _positive("simulation.ray_num_cpus", self.ray_num_cpus, allow_zero=True)
        _positive("simulation.ray_workers", self.ray_workers, allow_zero=True)
        _positive("simulation.ray_workers_per_node", self.ray_workers_per_node, allow_zero=True)
        _positive("simulation.ray_cpus_per_worker", self.ray_cpus_per_worker)
        _positive("simulation.ray_gpus_per_worker", self.ray_gpus_per_worker, allow_zero=True)
        _positive("simulation.ray_max_restarts", self.ray_max_restarts, allow_zero=True)
        _positive("simulation.ray_start_timeout_s", self.ray_start_timeout_s)
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
        _positive("data.dirichlet_alpha", self.dirichlet_alpha)
        _positive("data.shards_per_client", self.shards_per_client)
        _positive("data.shard_size", self.shard_size)
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
    precision: Literal["fp32", "bf16"] = "fp32"  # fp32 | bf16 (autocast of the forward pass)

    def validate(self) -> None:
        _positive("train.epochs", self.epochs)
        b = self.batch_size
        if not (b == 0 or b == math.inf or (float(b).is_integer() and b > 0)):
            raise ConfigError(f"train.batch_size = {b!r} must be a positive integer, or inf for full batch")
        _positive("train.lr", self.lr)
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"train.momentum = {self.momentum} must be in [0, 1)")
        _positive("train.weight_decay", self.weight_decay, allow_zero=True)
        _positive("train.prox_mu", self.prox_mu, allow_zero=True)
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
        _positive("strategy.server_lr", self.server_lr)
        _positive("strategy.tau", self.tau)
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
        _positive("algorithm.feddyn_alpha", self.feddyn_alpha)
        _positive("algorithm.ditto_lambda", self.ditto_lambda, allow_zero=True)
        _positive("algorithm.personal_epochs", self.personal_epochs)
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
        _positive("robust.krum_f", self.krum_f, allow_zero=True)
        _positive("robust.multikrum_m", self.multikrum_m, allow_zero=True)
        _positive("robust.norm_bound", self.norm_bound, allow_zero=True)
        _positive("robust.max_updates", self.max_updates)


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
        _positive("attack.scale", self.scale)


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
        _positive("compression.q8_chunk", self.q8_chunk)
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"compression.zstd_level = {self.zstd_level} must be in 1..22")


@dataclass
class ServerConfig:
    """The aggregator service (`shoal server`, server/). Node ids are registered node names.

    Model initialisation and client selection use ``simulation.seed``, and the held-out
    set is the one ``[data]`` + ``simulation.num_clients`` + seed describe, so a server
    and ``shoal simulate`` on the same config start from the same model.
    """

    host: str = "127.0.0.1"  # listen address
    port: int = 8443  # listen port
    tls_cert: str = ""  # PEM certificate chain; HTTPS needs both, else --insecure
    tls_key: str = ""  # PEM private key
    tls_client_ca: str = ""  # CA of node certificates (`shoal pki`): nodes enrolled by key log in with them
    mode: Literal["sync", "async"] = "sync"  # sync rounds | async ([asynchronous] algorithm: fedbuff | fedasync)
    rounds: int = 10  # global versions to produce, then the server reports done
    clients_per_round: int = 0  # K; 0 means `fraction` of the connected nodes
    fraction: float = 1.0  # clients_per_round = 0: this share of the connected nodes each round
    min_nodes: int = 1  # connected nodes needed before a round starts
    deadline_s: float = 60.0  # a round closes this long after it starts
    min_fraction: float = 0.5  # share of the selected nodes that must report by the deadline
    poll_s: float = 20.0  # longest a node's GET /v1/task is held open
    max_body_bytes: int = 0  # one request's limit (0: a dense float32 model + 1 MiB); larger updates go in chunks
    ingest_slots: int = 4  # uploads decoded at once (memory: slots x model size)
    # the plain weighted mean's running sum: float64 (exact to float32 rounding), float32 (half the
    # memory; error <= (K-1) * 6e-8 of the mean magnitude, docs/deploy.md), or auto: float32 from
    # 2**27 parameters (a 512 MiB model) up, float64 below
    sum_dtype: Literal["auto", "float64", "float32"] = "auto"
    checkpoint_dir: str = "server/checkpoints"  # checkpoints and the privacy ledger (privacy.json)
    keep_checkpoints: int = 3  # the newest checkpoints kept
    db: str = "server/nodes.sqlite"  # the node registry (SQLite, mode 0600)
    out_dir: str = "server/run"  # metrics.jsonl
    eval: bool = True  # evaluate each new version on the task's central_test_data() (if it gives one)

    # hostile input (docs/protocol.md, "Limits"): what one node may send and hold
    max_examples: int = 1_000_000  # an update claiming more examples is refused (out_of_range)
    max_delta_abs: float = 1e4  # an update with a larger |entry| after decoding is refused; 0 = finite only
    body_timeout_s: float = 30.0  # longest wait for the next bytes of a request body (408 after it)
    upload_timeout_s: float = 300.0  # longest a whole upload may take once its body flows
    uploads_per_node: int = 2  # one node's uploads in flight at once (429 above it)
    idle_timeout_s: float = 75.0  # a connection with no request in flight this long is closed
    admin_token_file: str = ""  # file holding the token of GET /v1/status and /metrics ("" = routes off)
    max_failed_rounds: int = 5  # a run ends after this many rounds in a row without an accepted update (0 = never)
    min_upload_rate: float = 16384.0  # bytes/s an upload must keep after upload_grace_s (408 below it; 0 = off)
    upload_grace_s: float = 5.0  # seconds an upload may send slower than min_upload_rate at first
    max_connections: int = 1024  # connections served at once (TLS: ~290 KB each, plain ~8 KB); past it: 503 and closed
    # the connection guard (docs/security.md): strangers cannot hold the slots enrolled nodes need
    reserved_connections: int = 64  # of max_connections (at most half): only for clients with a tls_client_ca cert
    connections_per_address: int = 128  # connections served at once to one address without a client certificate
    handshake_timeout_s: float = 5.0  # a new connection's TLS handshake and first request head must be done by then
    max_pending_connections: int = 256  # connections still in that stage; past it the oldest silent one is dropped
    pending_per_address: int = 32  # of those, from one address; past it that address's oldest silent one is dropped

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"server.port = {self.port} must be in 1..65535")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("server.tls_cert and server.tls_key go together: set both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError(
                "server.tls_client_ca needs server.tls_cert and server.tls_key: node certificates are checked over TLS"
            )
        _positive("server.rounds", self.rounds)
        _positive("server.clients_per_round", self.clients_per_round, allow_zero=True)
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"server.fraction = {self.fraction} must be in (0, 1]")
        _positive("server.min_nodes", self.min_nodes)
        _positive("server.deadline_s", self.deadline_s)
        if not 0 < self.min_fraction <= 1:
            raise ConfigError(f"server.min_fraction = {self.min_fraction} must be in (0, 1]")
        _positive("server.poll_s", self.poll_s)
        _positive("server.max_body_bytes", self.max_body_bytes, allow_zero=True)
        _positive("server.ingest_slots", self.ingest_slots)
        _positive("server.keep_checkpoints", self.keep_checkpoints)
        _positive("server.max_examples", self.max_examples)
        if not (math.isfinite(self.max_delta_abs) and self.max_delta_abs >= 0):
            raise ConfigError(
                f"server.max_delta_abs = {self.max_delta_abs!r} must be a finite number >= 0 (0 = no bound)"
            )
        for key in ("body_timeout_s", "upload_timeout_s", "idle_timeout_s", "handshake_timeout_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"server.{key} = {v!r} must be a finite number of seconds > 0")
        _positive("server.uploads_per_node", self.uploads_per_node)
        _positive("server.max_failed_rounds", self.max_failed_rounds, allow_zero=True)
        _positive("server.max_connections", self.max_connections)
        for key in ("connections_per_address", "max_pending_connections", "pending_per_address"):
            _positive(f"server.{key}", getattr(self, key))
        _positive("server.reserved_connections", self.reserved_connections, allow_zero=True)
        for key in ("min_upload_rate", "upload_grace_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"server.{key} = {v!r} must be a finite number >= 0")


@dataclass
class AsynchronousConfig:
    """Late and asynchronous updates (docs/staleness.md says how each is weighted).

    ``simulation.mode = "async"`` runs ``algorithm``; ``simulation.mode = "sync"`` with
    ``[heterogeneity] enabled`` uses the deadline keys. Staleness weight s(t):
    constant | polynomial (1 + t)^-a | hinge (1 if t <= b else 1 / (a (t - b) + 1)).
    """

    algorithm: Literal["fedbuff", "fedasync"] = "fedbuff"  # fedbuff (Nguyen et al. 2022) | fedasync (Xie et al. 2019)
    concurrency: int = 10  # clients training at the same time
    buffer_size: int = 10  # FedBuff's K: updates per server step
    alpha: float = 0.6  # FedAsync's mixing weight
    fedasync_mix: Literal["model", "delta"] = (
        "model"  # model: x_client = x_base + delta (paper) | delta: x + alpha_t delta
    )
    staleness_weight: Literal["constant", "polynomial", "hinge"] = "polynomial"  # s(t), see the section
    staleness_a: float = 0.5  # a of polynomial and hinge
    staleness_b: int = 4  # hinge: staleness before the weight decays
    max_staleness: int = 100  # older updates are rejected and counted
    over_selection: float = 0.0  # sync: select ceil(K (1 + over_selection)) clients
    deadline_s: float = 0.0  # sync: round deadline in (virtual) seconds; 0 = none
    min_fraction: float = 0.0  # sync: a round with fewer than this * K results at its deadline fails
    late: Literal["drop", "fold"] = "drop"  # sync: late results are dropped | folded into the next round (weight s(t))

    def validate(self) -> None:
        _positive("asynchronous.concurrency", self.concurrency)
        _positive("asynchronous.buffer_size", self.buffer_size)
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"asynchronous.alpha = {self.alpha} must be in (0, 1]")
        _positive("asynchronous.staleness_a", self.staleness_a, allow_zero=True)
        _positive("asynchronous.staleness_b", self.staleness_b, allow_zero=True)
        _positive("asynchronous.max_staleness", self.max_staleness, allow_zero=True)
        _positive("asynchronous.over_selection", self.over_selection, allow_zero=True)
        _positive("asynchronous.deadline_s", self.deadline_s, allow_zero=True)
        if not 0 <= self.min_fraction <= 1:
            raise ConfigError(f"asynchronous.min_fraction = {self.min_fraction} must be in [0, 1]")


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
            _positive(f"heterogeneity.{k}", getattr(self, k), allow_zero=True)
        if self.step_time_s == 0:
            raise ConfigError("heterogeneity.step_time_s = 0: local training would take no time; use > 0")
        if self.mean_on_s > 0 and self.mean_off_s == 0:
            raise ConfigError("heterogeneity.mean_off_s = 0 with mean_on_s > 0: set both, or mean_on_s = 0 (always on)")


@dataclass
class GossipConfig:
    """Decentralized training without a server (p2p/): `simulation.mode = "gossip"` and `shoal peer`."""

    algorithm: Literal["gossip", "dpsgd", "secure_groups", "group_average"] = (
        "gossip"  # gossip (push-pull with Cyclon views) | dpsgd (Lian et al. 2017) | secure_groups
    )
    # | group_average (Moshpit-style exact averages in grid groups, p2p/group_average.py)
    group_size: int = 4  # secure_groups: peers that securely average together each round;
    # group_average: about this many per group (the virtual grid's side)
    group_weights: Literal["examples", "equal"] = (
        "examples"  # group_average: weight each model by its training examples | "equal"
    )
    group_levels: int = 0  # group_average: grid axes one exchange averages across, each in small groups
    # (0 = all: the exact global average on a full grid; 1 = one group, Moshpit's round)
    merge: Literal["average", "examples", "age"] = "age"  # average | examples | age (Hegedus et al. 2019)
    staleness_exponent: float = 0.0  # weight * (1 + age gap) ** -a for models behind ours
    max_age_gap: int = 0  # models further behind are not merged, further ahead adopted (0: off)
    bound_mode: Literal["clip", "reject"] = (
        "clip"  # robust.norm_bound > 0: clip | reject models farther than it from ours
    )
    merge_bound: float = 2.0  # self-centered clipping: a neighbour's x_j - x_i is clipped to this x the median of
    # recent neighbours' distances (one slot per sender) and our own last step (L2); 0 = off (p2p/merge.py MergeBound)
    merge_radius: float = 0.0  # > 0: a fixed clipping radius (L2) instead of the adaptive one
    max_drift: float = 4.0  # between two local steps merges move a model by a path of at most this x the radius
    # (0 = no budget)
    max_abs: float = 1e4  # a received model with a value beyond this (absolute) is refused; 0 = finite only
    allow_networks: list[str] = field(default_factory=list)  # `shoal peer`: CIDRs contacted whatever their
    # kind (by default only addresses of the kinds of --advertise and --bootstrap; p2p/addresses.py)
    view_size: int = 8  # Cyclon partial view
    shuffle_length: int = 4  # entries swapped per shuffle
    exchanges_per_round: int = 1  # push-pull exchanges a peer starts after each local step
    timeout: float = 1.0  # rounds (simulator) or seconds (peer) before no answer is a failure
    max_failures: int = 2  # consecutive failures before a peer leaves a view
    topology: Literal["ring", "torus", "regular", "small-world", "complete"] = (
        "ring"  # dpsgd: ring | torus | regular | small-world | complete
    )
    degree: int = 4  # regular / small-world degree
    rewire: float = 0.1  # small-world rewiring probability
    latency: float = 0.1  # simulator: mean one-way delay, in rounds (exponential)
    loss: float = 0.0  # simulator: probability that a message is lost
    churn: float = 0.0  # simulator: share of peers offline at any time
    churn_period: float = 10.0  # simulator: mean rounds a peer stays offline
    churn_reset: bool = False  # simulator: a returning peer lost its model (starts at age 0)
    partition_start: int = 0  # simulator: rounds [start, end) split the network in two halves
    partition_end: int = 0  # simulator: the round the partition heals
    eval_peers: int = 0  # evaluate this many peers each time (0 = all)
    period: float = 1.0  # `shoal peer`: seconds between local steps
    rounds: int = 0  # `shoal peer`: stop after this many local steps, writing the final model and metrics
    # (0 = until SIGINT/SIGTERM, which do the same)

    def validate(self) -> None:
        _positive("gossip.group_levels", self.group_levels, allow_zero=True)
        if self.group_size < 2:
            raise ConfigError(f"gossip.group_size = {self.group_size} must be >= 2 (a group of one averages nothing)")
        _positive("gossip.staleness_exponent", self.staleness_exponent, allow_zero=True)
        _positive("gossip.merge_bound", self.merge_bound, allow_zero=True)
        _positive("gossip.merge_radius", self.merge_radius, allow_zero=True)
        _positive("gossip.max_drift", self.max_drift, allow_zero=True)
        _positive("gossip.max_abs", self.max_abs, allow_zero=True)
        _positive("gossip.max_age_gap", self.max_age_gap, allow_zero=True)
        _positive("gossip.view_size", self.view_size)
        if not 1 <= self.shuffle_length <= self.view_size:
            raise ConfigError(f"gossip.shuffle_length = {self.shuffle_length} must be in [1, gossip.view_size]")
        _positive("gossip.exchanges_per_round", self.exchanges_per_round)
        _positive("gossip.timeout", self.timeout)
        _positive("gossip.max_failures", self.max_failures)
        _positive("gossip.degree", self.degree)
        _positive("gossip.latency", self.latency, allow_zero=True)
        for k in ("loss", "rewire"):
            if not 0 <= getattr(self, k) <= 1:
                raise ConfigError(f"gossip.{k} = {getattr(self, k)} must be in [0, 1]")
        if not 0 <= self.churn < 1:
            raise ConfigError(f"gossip.churn = {self.churn} must be in [0, 1)")
        _positive("gossip.churn_period", self.churn_period)
        if self.partition_end < self.partition_start:
            raise ConfigError("gossip.partition_end must be >= gossip.partition_start")
        _positive("gossip.eval_peers", self.eval_peers, allow_zero=True)
        _positive("gossip.period", self.period)
        _positive("gossip.rounds", self.rounds, allow_zero=True)


# privacy.mode's choices, named: the privacy sweep runs a grid of them
PrivacyMode = Literal["none", "central", "local", "distributed"]
PRIVACY_MODES = ("none", "central", "distributed", "local")


@dataclass
class PrivacyConfig:
    """Differential privacy (docs/privacy.md): who adds the noise, how much, how it is counted.

    ``central``: the server clips each client update to ``clip_norm`` and adds Gaussian
    noise of std ``noise_multiplier * clip_norm`` to the sum (DP-FedAvg, McMahan et al.
    2018). ``distributed``: each client clips and adds its 1/n share of that noise, so
    the (securely aggregated) sum carries it. ``local``: DP-SGD on each client (Abadi et
    al. 2016) with per-sample clipping to ``clip_norm``; the one mode gossip simulations
    take (each peer, accounted per peer; config rules refuse the others there).
    """

    mode: PrivacyMode = "none"  # none | central | local | distributed (who adds the noise)
    noise_multiplier: float = 1.0  # z: noise std = z * clip_norm
    clip_norm: float = 1.0  # C: update norm (central/distributed), per-sample gradient norm (local)
    adaptive_clipping: bool = False  # central: Andrew et al. 2021 quantile-based C
    target_quantile: float = 0.5  # gamma: the share of updates left unclipped
    clip_lr: float = 0.2  # eta_C: geometric step of the clip norm
    clipped_count_stddev: float = 0.0  # sigma_b of the noisy count; 0 = clients_per_round / 20 (the paper's choice)
    target_epsilon: float = 0.0  # stop before epsilon would exceed this; 0 = no limit
    delta: float = 1e-5  # the delta of (epsilon, delta)-DP
    accountant: Literal["rdp", "pld"] = "rdp"  # rdp | pld (dp-accounting)
    # central/distributed: how a round picks clients, and so what the accountant assumes:
    # poisson = each client joins with probability q = K/N (add/remove-one analysis);
    # fixed = exactly K of N (replace-one analysis with sensitivity 2C, RDP only)
    sampling: Literal["poisson", "fixed"] = "poisson"
    # distributed DP with secure aggregation: noise shares are sized for t = max(the protocol's
    # threshold, ceil(min_survivors * K)) survivors, and a round with fewer is aborted; 0 = the threshold
    min_survivors: float = 0.0
    # distributed DP's noise: gaussian (continuous shares, then fixed-point encoding) or discrete_gaussian
    # (the distributed discrete Gaussian of Kairouz et al. 2021: integer noise in the modular domain
    # secure aggregation sums; needs secure aggregation)
    mechanism: Literal["gaussian", "discrete_gaussian"] = "gaussian"
    bits: int = 16  # discrete_gaussian: the secure sum lives modulo 2^bits (at most 32)
    gamma: float = 0.0  # discrete_gaussian: the granularity; 0 = the finest the modulus holds
    beta: float = 0.6065306597126334  # discrete_gaussian: conditional rounding's bias, exp(-1/2) as in the paper
    rotation: bool = True  # discrete_gaussian: flatten updates with a randomized Hadamard transform
    # true: selection and noise are seeded from simulation.seed (runs repeat exactly) and the
    # guarantee does not hold against anyone who knows the seed; false: from a CSPRNG keyed by the OS
    reproducible: bool = False
    # what a DP run's records say of each round beyond the model (docs/privacy.md "What a run releases"):
    # withhold = no data-dependent per-round figure (train loss, counts, bytes, clients' own evaluations);
    # noised = the number of results and the train loss with Gaussian noise, charged in epsilon
    # (central / distributed only); clear = everything un-noised, NOT covered by the epsilon
    release: Literal["withhold", "noised", "clear"] = "withhold"
    release_noise_multiplier: float = 5.0  # noised: the count's noise std; the loss sum's is this x loss clip
    release_loss_clip: float = 5.0  # noised: each client's train loss clipped to [0, this] (the loss sum's sensitivity)
    # local: DP-SGD's per-example sampling rate q for every client, with epochs * round(1/q) steps a round, so a
    # client's epsilon (and the report its node then sends) depends on the config and its rounds only, never on its
    # example count n_k; 0 = q = B / n_k per client (its epsilon reveals roughly n_k, so a node sends no report
    # unless release = clear, and enforces target_epsilon itself)
    local_sampling_rate: float = 0.0
    # `shoal privacy-sweep`: the grid run after a non-private baseline
    sweep_modes: list[Literal["central", "local", "distributed"]] = field(default_factory=lambda: ["central", "local"])
    sweep_noise_multipliers: list[float] = field(default_factory=lambda: [0.3, 0.6, 1.0, 2.0])  # the sweep's z values
    mia_samples: int = 2000  # members and non-members each, for the membership-inference audit
    canaries: int = 500  # canary clients of the sweep's empirical-epsilon audit (0 = no audit)
    canaries_unseen: int = 1000  # random directions never inserted: the audit's null distribution

    def validate(self) -> None:
        _positive("privacy.noise_multiplier", self.noise_multiplier, allow_zero=True)
        _positive("privacy.clip_norm", self.clip_norm)
        if not 0 < self.target_quantile < 1:
            raise ConfigError(f"privacy.target_quantile = {self.target_quantile} must be in (0, 1)")
        _positive("privacy.clip_lr", self.clip_lr)
        _positive("privacy.clipped_count_stddev", self.clipped_count_stddev, allow_zero=True)
        _positive("privacy.target_epsilon", self.target_epsilon, allow_zero=True)
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta = {self.delta} must be in (0, 1)")
        if not 0 <= self.min_survivors <= 1:
            raise ConfigError(
                f"privacy.min_survivors = {self.min_survivors} must be a fraction of the round's clients in [0, 1]"
            )
        if self.mechanism == "discrete_gaussian":
            if self.mode != "distributed":
                raise ConfigError(
                    f"privacy.mechanism = 'discrete_gaussian' is distributed DP's (privacy.mode = 'distributed'), "
                    f"not {self.mode!r}: set mechanism = 'gaussian'"
                )
            if not 2 <= self.bits <= 32:
                raise ConfigError(f"privacy.bits = {self.bits} must be in [2, 32] (secure aggregation sums mod 2^32)")
            _positive("privacy.gamma", self.gamma, allow_zero=True)
            if not 0 <= self.beta < 1:
                raise ConfigError(f"privacy.beta = {self.beta} must be in [0, 1)")
            if self.sampling != "poisson" or self.accountant != "rdp":
                raise ConfigError(
                    "privacy.mechanism = 'discrete_gaussian' is accounted with RDP under Poisson sampling (the "
                    "paper's bound with Zhu-Wang amplification): set privacy.sampling = 'poisson' and "
                    "privacy.accountant = 'rdp'"
                )
        if self.sampling == "fixed" and self.accountant != "rdp" and self.mode in ("central", "distributed"):
            raise ConfigError(
                "privacy.sampling = 'fixed' is accounted with RDP (sampling without replacement, replace-one); "
                "dp-accounting's PLD accountant has no such event: set privacy.accountant = 'rdp' or "
                "privacy.sampling = 'poisson'"
            )
        if self.adaptive_clipping and self.mode != "central":
            raise ConfigError(
                f"privacy.adaptive_clipping needs privacy.mode = 'central' (it is {self.mode!r}): the noisy "
                "count of clipped updates is computed by the server; set adaptive_clipping = false"
            )
        _positive("privacy.release_noise_multiplier", self.release_noise_multiplier)
        _positive("privacy.release_loss_clip", self.release_loss_clip)
        if not 0 <= self.local_sampling_rate <= 1:
            raise ConfigError(
                f"privacy.local_sampling_rate = {self.local_sampling_rate} must be in [0, 1]; "
                "0 samples at B / n_k per client"
            )
        if self.release == "noised" and self.mode == "local":
            raise ConfigError(
                "privacy.release = 'noised' with privacy.mode = 'local': the noisy count and loss are charged "
                "per client, local DP-SGD per example; local DP releases no per-round figure of the clients "
                "anyway: use privacy.release = 'withhold'"
            )
        for z in self.sweep_noise_multipliers:
            _positive("privacy.sweep_noise_multipliers", z)
        _positive("privacy.mia_samples", self.mia_samples)
        _positive("privacy.canaries", self.canaries, allow_zero=True)
        if self.canaries == 1:
            raise ConfigError(
                "privacy.canaries = 1: the canary audit fits a Gaussian to the inserted canaries' "
                "cosines and needs at least 2 (or 0 to skip the audit)"
            )
        _positive("privacy.canaries_unseen", self.canaries_unseen)
        if self.canaries_unseen < 2:
            raise ConfigError(f"privacy.canaries_unseen = {self.canaries_unseen} must be >= 2")


#: The smallest sum of masked inputs any config may let be unmasked (server, node, simulator).
MIN_SECURE_INPUTS = 3


@dataclass
class SecureAggregationConfig:
    """Secure aggregation of each round's updates (Bonawitz et al. 2017; SecAgg+ graph of
    Bell et al. 2020); see docs/secure_aggregation.md."""

    enabled: bool = False  # securely aggregate each round (the server sees only the sum)
    graph: Literal["full", "secagg+"] = "full"  # full (every pair masks) | secagg+ (k-regular random graph)
    degree: int = 0  # secagg+ neighbours per client; 0 = about 3 log2(n)
    threshold: float = 0.5  # t = floor(threshold * neighbourhood) + 1 shares unmask
    clip: float = 1.0  # each update entry is clipped to [-clip, clip]
    bits: int = 16  # fixed-point bits per entry; clients x 2^bits must fit 2^32
    max_weight: float = 0.0  # examples weighting: n_k / max_weight (0 = largest client)
    dropout_advertise: float = 0.0  # injected: probability a client drops at each stage
    dropout_share: float = 0.0  # injected: drops at the share stage
    dropout_masked: float = 0.0  # injected: drops at the masked-input stage
    dropout_unmask: float = 0.0  # injected: drops at the unmasking stage
    seed: int = 0  # protocol randomness and injected dropouts
    stage_s: float = 30.0  # `shoal server`: seconds each stage after the first waits for nodes
    min_inputs: int = 3  # a sum of fewer masked inputs is never unmasked (server and every node refuse); >= 3
    malicious_server: bool = False  # the active-adversary variant: signed keys, a consistency round
    keys_file: str = ""  # malicious_server: JSON {node name: base64 Ed25519 public key}, given to every node
    identity_key: str = ""  # malicious_server, on a node: its Ed25519 key (`shoal keygen`)

    def validate(self) -> None:
        _positive("secure_aggregation.stage_s", self.stage_s)
        if self.min_inputs < MIN_SECURE_INPUTS:
            raise ConfigError(
                f"secure_aggregation.min_inputs = {self.min_inputs} must be >= {MIN_SECURE_INPUTS}: a sum of one "
                "masked input is that input, of two the other's to either node"
            )
        _positive("secure_aggregation.degree", self.degree, allow_zero=True)
        if not 0.5 <= self.threshold < 1:
            # t = floor(threshold x m) + 1 shares of m: t > m/2 (the full graph: m = n; SecAgg+: each
            # neighbourhood of degree + 1), else the server can ask one half of a client's share holders
            # for its self-mask and the other half for its mask key, and unmask that client's input
            raise ConfigError(
                f"secure_aggregation.threshold = {self.threshold} must be in [0.5, 1): below 0.5 "
                "a server could collect both secrets of one client and see its update"
            )
        if self.malicious_server:
            if self.graph != "full":
                raise ConfigError("secure_aggregation.malicious_server = true runs over graph = 'full' only")
            if self.threshold < 2 / 3:
                raise ConfigError(
                    f"secure_aggregation.threshold = {self.threshold} with malicious_server = true: "
                    "at least 2/3 (t > 2n/3 against an active server, Bonawitz et al. 2017)"
                )
        if self.graph == "secagg+" and self.degree == 1:
            raise ConfigError(
                "secure_aggregation.degree = 1 splits the clients into pairs whose sums the server "
                "learns; use >= 2 (or 0 for about 3 log2 n)"
            )
        _positive("secure_aggregation.clip", self.clip)
        if not 1 <= self.bits <= 31:
            raise ConfigError(f"secure_aggregation.bits = {self.bits} must be in [1, 31]")
        _positive("secure_aggregation.max_weight", self.max_weight, allow_zero=True)
        for stage in ("advertise", "share", "masked", "unmask"):
            v = getattr(self, f"dropout_{stage}")
            if not 0 <= v <= 1:
                raise ConfigError(f"secure_aggregation.dropout_{stage} = {v} must be in [0, 1]")


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


@dataclass
class FederationConfig:
    """A long-running server that hosts runs submitted with `shoal run submit` (server/federation/runs.py)."""

    enabled: bool = False  # `shoal server` hosts submitted runs instead of one run of its own [task]
    dir: str = "server/federation"  # runs.sqlite and one folder per run (checkpoints, metrics, final model)
    max_runs: int = 2  # runs trained at once; later submissions wait in the queue
    max_queued: int = 32  # runs waiting at once; a submission above it is refused (429)
    tasks: list[str] = field(
        default_factory=list
    )  # tasks a run may name, "NAME=REF" or "REF", beside the built-ins and `shoal server tasks add`
    researcher_tokens_file: str = ""  # file of "name token" lines allowed to submit and follow runs
    run_stall_s: float = 600.0  # a run short of server.min_nodes nodes this long ends failed (0 = it waits)
    task_check_mb: int = 2048  # a submitted run's task is loaded in a worker process of at most this much memory
    task_check_s: float = 60.0  # ... which has this long to load it and build its model (else the run is refused)
    # the federation's floors: a run's config below any of them is refused at submission
    max_epochs: int = 1000  # the most train.epochs a run may ask
    max_rounds: int = 1_000_000  # the most server.rounds a run may ask
    max_parameters: int = 0  # the largest model (parameters) a run may train (0: no limit)
    privacy_modes: list[PrivacyMode] = field(
        default_factory=lambda: ["none", "central", "distributed", "local"]
    )  # modes a run may use
    min_secure_group: int = 3  # secure aggregation: the fewest nodes a round (and min_inputs) a run may set
    require_secure_aggregation: bool = False  # every run must set secure_aggregation.enabled = true
    min_noise_multiplier: float = 0.0  # under DP: the least privacy.noise_multiplier a run may set
    max_target_epsilon: float = 0.0  # under DP: a run must set privacy.target_epsilon at most this (0: no limit)

    def validate(self) -> None:
        _positive("federation.max_runs", self.max_runs)
        _positive("federation.run_stall_s", self.run_stall_s, allow_zero=True)
        _positive("federation.max_queued", self.max_queued, allow_zero=True)
        _positive("federation.task_check_mb", self.task_check_mb)
        if self.task_check_mb < 512:
            raise ConfigError(f"federation.task_check_mb = {self.task_check_mb}: at least 512 (torch alone needs that)")
        _positive("federation.task_check_s", self.task_check_s)
        for key in ("max_epochs", "max_rounds", "max_parameters", "min_noise_multiplier", "max_target_epsilon"):
            _positive(f"federation.{key}", getattr(self, key), allow_zero=True)
        if self.min_secure_group < MIN_SECURE_INPUTS:
            raise ConfigError(
                f"federation.min_secure_group = {self.min_secure_group} must be >= {MIN_SECURE_INPUTS} "
                "(no secure sum of fewer inputs is unmasked)"
            )


@dataclass
class HierarchyConfig:
    """Edge aggregators between the nodes and the root (docs/hierarchy.md): each edge sums its
    nodes' updates and sends one partial up; only the root divides. ``edges = 0`` is flat."""

    edges: int = 0  # simulator: edge aggregators under the root (0 = flat: every client reports to the root)
    assignment: Literal["contiguous", "hash", "random"] = (
        "contiguous"  # clients -> edges: contiguous blocks | a hash of the client id | a seeded shuffle
    )
    edge_rounds: int = 1  # HierFAVG's kappa_2: edge aggregations per root round (1: exactly flat FedAvg)
    edge_failure: float = 0.0  # simulator: probability an edge is lost in a root round (its clients drop out)
    reattach: bool = False  # simulator: a lost edge's clients re-attach to the live edges (in turn) and report there
    link_latency_s: float = 0.0  # simulator: one-way latency of every hop, for the modelled hier_comm_s (0 = none)
    root_mbps: float = 0.0  # simulator: the root's link in Mbit/s, shared by its transfers (0 = not a limit)
    edge_mbps: float = 0.0  # simulator: each edge's link in Mbit/s, shared by its transfers (0 = not a limit)
    client_mbps: float = 0.0  # simulator: each client's link in Mbit/s (0 = not a limit)
    partial_dtype: Literal["float32", "float64"] = (
        "float32"  # the partial's sum on the wire: float32 (half the bytes, rounded once) | float64 (exact)
    )
    edge_names: list[str] = field(default_factory=list)  # `shoal server` (root): node names allowed to send partials
    edge_timeout_s: float = 5.0  # root: an edge silent this long loses its nodes (they may re-attach to another edge)
    parent: str = ""  # `shoal server --parent URL` (an edge): the root's URL; "" = this server is a root
    parent_token_file: str = ""  # an edge: the file with its token at the root (`shoal server nodes add EDGE` there)
    parent_ca_cert: str = ""  # an edge: the CA that signed the root's certificate ("" = the system's trust store)
    edge_quorum: float = 1.0  # an edge closes its part of a round once its nodes' weight reaches this share
    edge_margin_s: float = 1.0  # an edge closes its part of a round this long before the root's deadline
    edge_buffer: int = 0  # an edge under an async root sends its buffer up at this many updates (0 = the root's K)
    edge_flush_s: float = 1.0  # ... or once its oldest buffered update has waited this long
    edge_journal: bool = True  # an edge keeps the round's updates on disk (server.out_dir): a restart takes them back

    def validate(self) -> None:
        _positive("hierarchy.edges", self.edges, allow_zero=True)
        _positive("hierarchy.edge_rounds", self.edge_rounds)
        if not 0 <= self.edge_failure <= 1:
            raise ConfigError(f"hierarchy.edge_failure = {self.edge_failure} must be in [0, 1]")
        if not 0 < self.edge_quorum <= 1:
            raise ConfigError(f"hierarchy.edge_quorum = {self.edge_quorum} must be in (0, 1]")
        if not (math.isfinite(self.edge_margin_s) and self.edge_margin_s >= 0):
            raise ConfigError(f"hierarchy.edge_margin_s = {self.edge_margin_s} must be a number of seconds >= 0")
        for k in ("link_latency_s", "root_mbps", "edge_mbps", "client_mbps"):
            v = getattr(self, k)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"hierarchy.{k} = {v} must be a finite number >= 0 (0: not modelled)")
        _positive("hierarchy.edge_buffer", self.edge_buffer, allow_zero=True)
        if not (math.isfinite(self.edge_flush_s) and self.edge_flush_s > 0):
            raise ConfigError(f"hierarchy.edge_flush_s = {self.edge_flush_s} must be a number of seconds > 0")
        if not (math.isfinite(self.edge_timeout_s) and self.edge_timeout_s > 0):
            raise ConfigError(f"hierarchy.edge_timeout_s = {self.edge_timeout_s} must be a number of seconds > 0")
        if self.parent and not self.parent.startswith(("http://", "https://")):
            raise ConfigError(f"hierarchy.parent = {self.parent!r} must be the root's http:// or https:// URL")


@dataclass
class Config:
    simulation: SimulationConfig = field(default_factory=SimulationConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    asynchronous: AsynchronousConfig = field(default_factory=AsynchronousConfig)
    heterogeneity: HeterogeneityConfig = field(default_factory=HeterogeneityConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    secure_aggregation: SecureAggregationConfig = field(default_factory=SecureAggregationConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    hierarchy: HierarchyConfig = field(default_factory=HierarchyConfig)

    def validate(self) -> Config:
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            check_choices(section, f.name)
            check_finite(section, f.name)
            if hasattr(section, "validate"):
                section.validate()
        check_combinations(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
