"""The sections of how clients meet: [server] (and its [asynchronous] rounds), a long-running
[federation] of runs, [hierarchy] of edge aggregators, and [gossip] peers without a server."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from shoal.errors import ConfigError

from .checks import positive
from .privacy import MIN_SECURE_INPUTS, PrivacyMode


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
        positive("server.rounds", self.rounds)
        positive("server.clients_per_round", self.clients_per_round, allow_zero=True)
        if not 0 < self.fraction <= 1:
            raise ConfigError(f"server.fraction = {self.fraction} must be in (0, 1]")
        positive("server.min_nodes", self.min_nodes)
        positive("server.deadline_s", self.deadline_s)
        if not 0 < self.min_fraction <= 1:
            raise ConfigError(f"server.min_fraction = {self.min_fraction} must be in (0, 1]")
        positive("server.poll_s", self.poll_s)
        positive("server.max_body_bytes", self.max_body_bytes, allow_zero=True)
        positive("server.ingest_slots", self.ingest_slots)
        positive("server.keep_checkpoints", self.keep_checkpoints)
        positive("server.max_examples", self.max_examples)
        if not (math.isfinite(self.max_delta_abs) and self.max_delta_abs >= 0):
            raise ConfigError(
                f"server.max_delta_abs = {self.max_delta_abs!r} must be a finite number >= 0 (0 = no bound)"
            )
        for key in ("body_timeout_s", "upload_timeout_s", "idle_timeout_s", "handshake_timeout_s"):
            v = getattr(self, key)
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"server.{key} = {v!r} must be a finite number of seconds > 0")
        positive("server.uploads_per_node", self.uploads_per_node)
        positive("server.max_failed_rounds", self.max_failed_rounds, allow_zero=True)
        positive("server.max_connections", self.max_connections)
        for key in ("connections_per_address", "max_pending_connections", "pending_per_address"):
            positive(f"server.{key}", getattr(self, key))
        positive("server.reserved_connections", self.reserved_connections, allow_zero=True)
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
        positive("asynchronous.concurrency", self.concurrency)
        positive("asynchronous.buffer_size", self.buffer_size)
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"asynchronous.alpha = {self.alpha} must be in (0, 1]")
        positive("asynchronous.staleness_a", self.staleness_a, allow_zero=True)
        positive("asynchronous.staleness_b", self.staleness_b, allow_zero=True)
        positive("asynchronous.max_staleness", self.max_staleness, allow_zero=True)
        positive("asynchronous.over_selection", self.over_selection, allow_zero=True)
        positive("asynchronous.deadline_s", self.deadline_s, allow_zero=True)
        if not 0 <= self.min_fraction <= 1:
            raise ConfigError(f"asynchronous.min_fraction = {self.min_fraction} must be in [0, 1]")


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
    max_bundle_mb: int = 64  # largest signed task bundle, initial model included (`run submit --bundle`; 0: none)
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
    # distributed DP with secure aggregation: the least privacy.abort_bound a run may declare (the operator's
    # bound on a node deciding a round's abort; 1 = the worst case; docs/privacy.md "Aborted rounds")
    min_abort_bound: float = 1.0

    def validate(self) -> None:
        positive("federation.max_runs", self.max_runs)
        positive("federation.run_stall_s", self.run_stall_s, allow_zero=True)
        positive("federation.max_queued", self.max_queued, allow_zero=True)
        positive("federation.task_check_mb", self.task_check_mb)
        if self.task_check_mb < 512:
            raise ConfigError(f"federation.task_check_mb = {self.task_check_mb}: at least 512 (torch alone needs that)")
        positive("federation.task_check_s", self.task_check_s)
        positive("federation.max_bundle_mb", self.max_bundle_mb, allow_zero=True)
        for key in ("max_epochs", "max_rounds", "max_parameters", "min_noise_multiplier", "max_target_epsilon"):
            positive(f"federation.{key}", getattr(self, key), allow_zero=True)
        if not 0 <= self.min_abort_bound <= 1:
            raise ConfigError(f"federation.min_abort_bound = {self.min_abort_bound} must be a probability in [0, 1]")
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
        positive("hierarchy.edges", self.edges, allow_zero=True)
        positive("hierarchy.edge_rounds", self.edge_rounds)
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
        positive("hierarchy.edge_buffer", self.edge_buffer, allow_zero=True)
        if not (math.isfinite(self.edge_flush_s) and self.edge_flush_s > 0):
            raise ConfigError(f"hierarchy.edge_flush_s = {self.edge_flush_s} must be a number of seconds > 0")
        if not (math.isfinite(self.edge_timeout_s) and self.edge_timeout_s > 0):
            raise ConfigError(f"hierarchy.edge_timeout_s = {self.edge_timeout_s} must be a number of seconds > 0")
        if self.parent and not self.parent.startswith(("http://", "https://")):
            raise ConfigError(f"hierarchy.parent = {self.parent!r} must be the root's http:// or https:// URL")


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
    merge_far: float = 4.0  # > 0: a model more than this x the larger of the radius and the distance our model
    # has come from its start (the radius alone for a model pointing back toward that start) is refused, not
    # clipped, unless most recently heard senders are that far (we are the outlier: clip toward them); 4 refuses a
    # sign-flipping or scaling (x10) insider and still merges an honest minority whose local steps are several
    # times longer (docs/results.md); 0 = clip however far
    max_abs: float = 1e4  # a received model with a value beyond this (absolute) is refused; 0 = finite only
    allow_networks: list[str] = field(default_factory=list)  # `shoal peer`: CIDRs contacted whatever their
    # kind (by default only addresses of the kinds of --advertise and --bootstrap; p2p/addresses.py)
    view_size: int = 8  # Cyclon partial view
    shuffle_length: int = 4  # entries swapped per shuffle
    samplers: int = 16  # min-wise samplers behind the history sample (Brahms): each keeps the ID of least
    # keyed hash of all it learned, so repeating an ID gains an attacker nothing; failed IDs are reset out
    push_share: float = 0.45  # at most this share of a view from pushes (Brahms's alpha)
    pull_share: float = 0.45  # at most this share from shuffle answers (beta); the rest, at least one slot,
    # from the history sample (gamma = 1 - push_share - pull_share)
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
        positive("gossip.group_levels", self.group_levels, allow_zero=True)
        if self.group_size < 2:
            raise ConfigError(f"gossip.group_size = {self.group_size} must be >= 2 (a group of one averages nothing)")
        positive("gossip.staleness_exponent", self.staleness_exponent, allow_zero=True)
        positive("gossip.merge_bound", self.merge_bound, allow_zero=True)
        positive("gossip.merge_radius", self.merge_radius, allow_zero=True)
        positive("gossip.max_drift", self.max_drift, allow_zero=True)
        positive("gossip.merge_far", self.merge_far, allow_zero=True)
        if 0 < self.merge_far < 1:
            raise ConfigError(f"gossip.merge_far = {self.merge_far} must be 0 (off) or >= 1 (a multiple of the radius)")
        positive("gossip.max_abs", self.max_abs, allow_zero=True)
        positive("gossip.max_age_gap", self.max_age_gap, allow_zero=True)
        positive("gossip.view_size", self.view_size)
        if not 1 <= self.shuffle_length <= self.view_size:
            raise ConfigError(f"gossip.shuffle_length = {self.shuffle_length} must be in [1, gossip.view_size]")
        positive("gossip.samplers", self.samplers)
        for k in ("push_share", "pull_share"):
            if not 0 <= getattr(self, k) < 1:
                raise ConfigError(f"gossip.{k} = {getattr(self, k)} must be in [0, 1)")
        if self.push_share + self.pull_share >= 1:
            raise ConfigError(
                f"gossip.push_share + gossip.pull_share = {self.push_share + self.pull_share} must be < 1 "
                "(the rest of the view comes from the history sample)"
            )
        positive("gossip.exchanges_per_round", self.exchanges_per_round)
        positive("gossip.timeout", self.timeout)
        positive("gossip.max_failures", self.max_failures)
        positive("gossip.degree", self.degree)
        positive("gossip.latency", self.latency, allow_zero=True)
        for k in ("loss", "rewire"):
            if not 0 <= getattr(self, k) <= 1:
                raise ConfigError(f"gossip.{k} = {getattr(self, k)} must be in [0, 1]")
        if not 0 <= self.churn < 1:
            raise ConfigError(f"gossip.churn = {self.churn} must be in [0, 1)")
        positive("gossip.churn_period", self.churn_period)
        if self.partition_end < self.partition_start:
            raise ConfigError("gossip.partition_end must be >= gossip.partition_start")
        positive("gossip.eval_peers", self.eval_peers, allow_zero=True)
        positive("gossip.period", self.period)
        positive("gossip.rounds", self.rounds, allow_zero=True)
