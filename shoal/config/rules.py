"""Settings that are fine alone but not together: one ConfigError naming both keys.

``self`` in these functions is the whole :class:`shoal.config.Config`.
"""

from __future__ import annotations

from typing import Any

from shoal.algorithms import algorithm_of, refusal
from shoal.errors import ConfigError

MAX_EDGE_ROUNDS = 4096  # hierarchy.edge_rounds at an edge process (server/edge/rounds.py numbers its models by it)


def check_combinations(self: Any) -> None:
    """Settings that are fine alone but not together."""
    if self.simulation.engine == "flower":
        unsupported = [
            name
            for name, on in (
                (f"simulation.mode = {self.simulation.mode!r}", self.simulation.mode != "sync"),
                ("heterogeneity.enabled", self.heterogeneity.enabled),
                (f"privacy.mode = {self.privacy.mode!r}", self.privacy.mode != "none"),
                ("secure_aggregation.enabled", self.secure_aggregation.enabled),
                (f"attack.kind = {self.attack.kind!r}", self.attack.kind != "none"),
                (f"compression.encoding = {self.compression.encoding!r}", self.compression.encoding != "dense"),
            )
            if on
        ]
        if unsupported:
            raise ConfigError(
                f"simulation.engine = 'flower' runs plain sync rounds (robust rules included) and cannot run "
                f"{', '.join(unsupported)}; use simulation.engine = 'inprocess'"
            )
    if self.secure_aggregation.enabled:
        why = None
        if self.simulation.mode != "sync":
            why = f"simulation.mode = {self.simulation.mode!r}: secure aggregation runs in sync rounds"
        elif self.heterogeneity.enabled:
            why = "heterogeneity.enabled = true: the virtual-clock engine trains clients one at a time"
        elif self.server.mode != "sync":
            why = f"server.mode = {self.server.mode!r}: secure aggregation runs in sync rounds"
        elif self.robust.rule != "mean":
            why = f"robust.rule = {self.robust.rule!r}: the server sees only the masked sum, not single updates"
        elif self.compression.encoding != "dense":
            why = (
                f"compression.encoding = {self.compression.encoding!r}: masks live in a fixed-point "
                "field over the dense vector"
            )
        elif self.privacy.mode == "central":
            why = (
                "privacy.mode = 'central': the server cannot clip updates it cannot see; use "
                "privacy.mode = 'distributed' (clients clip and add noise shares before masking)"
            )
        if why:
            raise ConfigError(f"secure_aggregation.enabled = true with {why}")
        least = self.secure_aggregation.min_inputs
        for key in ("simulation.clients_per_round", "server.clients_per_round"):
            k = getattr(self, key.split(".")[0]).clients_per_round
            if 0 < k < least:
                raise ConfigError(
                    f"{key} = {k} with secure aggregation: a sum of fewer than secure_aggregation.min_inputs = "
                    f"{least} masked inputs is never unmasked, so every round would abort; select at least "
                    f"{least} (3 is the least any config allows: a sum of 1 input is that input)"
                )
    if self.simulation.mode == "gossip":
        check_gossip_settings(self)
    _check_async_robust(self)
    _check_algorithm(self)
    _check_hierarchy(self)
    dp = self.privacy.mode
    if self.privacy.mechanism == "discrete_gaussian" and not self.secure_aggregation.enabled:
        raise ConfigError(
            "privacy.mechanism = 'discrete_gaussian' adds integer noise in the modular domain that secure "
            "aggregation sums: set secure_aggregation.enabled = true (or privacy.mechanism = 'gaussian')"
        )
    if dp in ("central", "distributed") and self.robust.rule != "mean":
        raise ConfigError(
            f"privacy.mode = {dp!r} with robust.rule = {self.robust.rule!r}: the DP mean's noise is "
            "calibrated to a clipped sum, which a robust rule does not compute; use robust.rule = "
            "'mean' (the clipping bounds each client's influence) or privacy.mode = 'local'"
        )
    if dp == "distributed" and self.compression.encoding != "dense":
        raise ConfigError(
            f"privacy.mode = 'distributed' with compression.encoding = {self.compression.encoding!r}: each "
            "client's noise share would be added before the encoding, which then drops (topk) or rescales "
            "(q8) the noise, so the sum would carry less noise than accounted; shoal does not add noise "
            "after the encoding. Use compression.encoding = 'dense', or privacy.mode = 'central' (the "
            "server clips the decoded update and adds the noise itself)"
        )
    if dp != "none":
        _check_privacy_mode(self, dp)
    if dp == "local":
        _check_local_batch(self)


def _check_privacy_mode(self: Any, dp: str) -> None:
    """Where each privacy.mode is accounted: sync rounds (all three), gossip (local DP-SGD only)."""
    mode = self.simulation.mode
    if mode == "gossip":
        if dp != "local":
            raise ConfigError(
                f"privacy.mode = {dp!r} with simulation.mode = 'gossip': no server clips and adds noise to "
                "an aggregate in gossip; use privacy.mode = 'local' (every peer trains with DP-SGD and its "
                "example-level epsilon is accounted per peer)"
            )
        return  # gossip runs its own rounds, never on the virtual clock (heterogeneity is not used)
    if self.heterogeneity.enabled:
        raise ConfigError(
            f"privacy.mode = {dp!r} with heterogeneity.enabled = true: the virtual-clock engine does not "
            "count epsilon; set heterogeneity.enabled = false"
        )
    if mode != "sync":
        local = " or 'gossip' (privacy.mode = 'local' only)" if dp == "local" else ""
        raise ConfigError(
            f"privacy.mode = {dp!r} needs simulation.mode = 'sync'{local} (it is {mode!r}): "
            "the accountant counts sampled synchronous rounds"
        )


def _check_local_batch(self: Any) -> None:
    """Local DP-SGD on a fixed schedule divides each step's noisy sum by train.batch_size, never by
    anything of a client's data; a full batch (B = n_k) is the data's. Its steps (Opacus' per-sample
    gradients) run in float32: a train.precision it would not apply is refused, not ignored."""
    if self.train.precision != "fp32":
        raise ConfigError(
            f"train.precision = {self.train.precision!r} with privacy.mode = 'local': the DP-SGD trainer "
            "computes its per-sample gradients in float32 and would ignore it; use train.precision = 'fp32'"
        )
    p, b = self.privacy, self.train.batch_size
    if (p.local_schedule == "steps" or p.local_sampling_rate) and (not b or b == float("inf")):
        raise ConfigError(
            f"train.batch_size = {b!r} (the full local dataset) with privacy.mode = 'local': DP-SGD's "
            "steps divide the noisy gradient sum by B, which must not depend on a client's example count, "
            "and a full batch of n_k examples makes every step's time tell n_k; set a finite "
            "train.batch_size (the expected batch)"
        )


def _check_async_robust(self: Any) -> None:
    """Robust rules in async mode run over FedBuff's buffer of K updates (aggregation/fedbuff.py)."""
    a, rb = self.asynchronous, self.robust
    if "async" not in (self.simulation.mode, self.server.mode) or rb.rule == "mean":
        return
    if a.algorithm == "fedasync":
        raise ConfigError(
            f"robust.rule = {rb.rule!r} with asynchronous.algorithm = 'fedasync': FedAsync applies one update "
            f"at a time, and a {rb.rule} of one update is that update; use asynchronous.algorithm = 'fedbuff' "
            "(the rule combines its K buffered updates) or robust.rule = 'mean' with robust.norm_bound > 0"
        )
    if a.buffer_size > rb.max_updates:
        raise ConfigError(
            f"asynchronous.buffer_size = {a.buffer_size} exceeds robust.max_updates = "
            f"{rb.max_updates}: FedBuff's rule holds the K buffered updates; raise the limit"
        )
    if rb.rule in ("krum", "multikrum") and a.buffer_size <= 2 * rb.krum_f + 2:
        raise ConfigError(
            f"robust.rule = {rb.rule!r} with krum_f = {rb.krum_f} needs asynchronous.buffer_size "
            f"> 2 krum_f + 2 = {2 * rb.krum_f + 2} (it is {a.buffer_size})"
        )


def _check_algorithm(self: Any) -> None:
    """``[algorithm]`` runs in the simulator's sync rounds; where its math needs each client's
    update, or a second per-client message, the combination is refused with the reason."""
    name, sim = self.algorithm.name, self.simulation
    declared = algorithm_of(self)
    if self.algorithm.personal_eval_steps >= 0 and self.privacy.mode != "none":
        raise ConfigError(
            f"algorithm.personal_eval_steps = {self.algorithm.personal_eval_steps} with privacy.mode = "
            f"{self.privacy.mode!r}: the fine-tuned models are trained on clients' data without noise and their "
            "metrics are released in metrics.jsonl, outside the epsilon; set personal_eval_steps = -1"
        )
    if self.algorithm.keep_optimizer_state:
        keep = None
        if self.train.momentum == 0:
            keep = "train.momentum = 0: plain SGD has no optimizer state"
        elif declared.keep_optimizer_refusal:
            keep = f"algorithm.name = {name!r}: {declared.keep_optimizer_refusal}"
        elif sim.mode != "sync" or self.heterogeneity.enabled:
            keep = "a mode other than sync rounds (in-process, on Ray or on Flower)"
        elif self.privacy.mode == "local":
            keep = "privacy.mode = 'local': the DP-SGD trainer keeps its own optimizer"
        if keep:
            raise ConfigError(f"algorithm.keep_optimizer_state = true with {keep}")
    why = refusal(self)  # the algorithm's declared modes, privacy modes and server step (shoal/algorithms.py)
    if why:
        raise ConfigError(f"algorithm.name = {name!r} with {why}")


def _check_edge(self: Any) -> None:
    """An edge aggregator (`shoal server --parent URL`) sums FedAvg updates (sync rounds, or FedBuff at an
    async root), or relays secure aggregation and adds its nodes' masked inputs."""
    unsupported = [
        (name, why)
        for name, on, why in (
            (
                f"asynchronous.algorithm = {self.asynchronous.algorithm!r}",
                self.server.mode == "async" and self.asynchronous.algorithm != "fedbuff",
                "an async root takes edge partials into FedBuff's buffer only (FedAsync mixes each update as it comes)",
            ),
            (
                "robust.norm_bound",
                self.server.mode == "async" and self.robust.norm_bound > 0,
                "a norm bound needs each update, not a sum",
            ),
            (
                f"privacy.mode = {self.privacy.mode!r}",
                self.privacy.mode not in ("none", "distributed")
                or (
                    self.privacy.mode == "distributed"
                    and (not self.secure_aggregation.enabled or self.server.mode != "sync")
                ),
                "DP runs through edges as distributed DP with secure aggregation in sync rounds only (each node clips "
                "and adds its noise share before masking; a plain sum would hide the clipping from the root's DP mean)",
            ),
            (
                f"algorithm.name = {self.algorithm.name!r}",
                not algorithm_of(self).summable,
                "the algorithm needs each node's own step and state, not a sum",
            ),
            (f"robust.rule = {self.robust.rule!r}", self.robust.rule != "mean", "a robust rule needs each update"),
            ("federation.enabled", self.federation.enabled, "an edge serves one run"),
            (
                f"hierarchy.edge_rounds = {self.hierarchy.edge_rounds}",
                self.server.mode == "async" and self.hierarchy.edge_rounds > 1,
                "an async root has no rounds for edge rounds to fit in (set it to 1)",
            ),
            (
                f"hierarchy.edge_rounds = {self.hierarchy.edge_rounds}",
                self.hierarchy.edge_rounds > MAX_EDGE_ROUNDS,
                f"an edge runs at most {MAX_EDGE_ROUNDS} edge rounds per root round",
            ),
        )
        if on
    ]
    if unsupported:
        raise ConfigError(
            f"hierarchy.parent = {self.hierarchy.parent!r} makes this server an edge aggregator, which cannot run "
            + "; ".join(f"{name} ({why})" for name, why in unsupported)
        )
    _check_secure_tiers(self, f"hierarchy.parent = {self.hierarchy.parent!r}")


def _check_hierarchy(self: Any) -> None:
    """Simulated edge aggregators sum plain FedAvg updates (docs/hierarchy.md, what works and what not yet)."""
    if self.hierarchy.parent:
        _check_edge(self)
    h = self.hierarchy
    links = [k for k in ("link_latency_s", "root_mbps", "edge_mbps", "client_mbps") if getattr(h, k)]
    if links and (not h.edges or self.secure_aggregation.enabled):
        raise ConfigError(
            f"hierarchy.{links[0]} models the transfers of the simulator's virtual edges (hier_comm_s), "
            + (
                "which secure aggregation's stages do not fit (unset it, or secure_aggregation.enabled = false)"
                if h.edges
                else "and hierarchy.edges = 0 has none: set hierarchy.edges (the records price flat beside it)"
            )
        )
    if not h.edges:
        return
    unsupported = [
        name
        for name, on in (
            (f"simulation.mode = {self.simulation.mode!r}", self.simulation.mode != "sync"),
            (f"simulation.engine = {self.simulation.engine!r}", self.simulation.engine == "flower"),
            ("heterogeneity.enabled", self.heterogeneity.enabled),
            (f"algorithm.name = {self.algorithm.name!r}", not algorithm_of(self).summable),
            (f"robust.rule = {self.robust.rule!r}", self.robust.rule != "mean"),
            (
                f"privacy.mode = {self.privacy.mode!r}",
                self.privacy.mode not in ("none", "distributed")
                or (self.privacy.mode == "distributed" and not self.secure_aggregation.enabled),
            ),
        )
        if on
    ]
    if unsupported:
        dp = (
            " (distributed DP runs through edges with secure aggregation only: in the clear an edge would see "
            "its nodes' noise shares and the root's DP mean could not count them in a sum)"
            if self.privacy.mode == "distributed"
            else ""
        )
        raise ConfigError(
            f"hierarchy.edges = {self.hierarchy.edges} simulates edge aggregators that sum plain FedAvg updates "
            f"in sync rounds, and cannot run {', '.join(unsupported)} yet{dp}; set hierarchy.edges = 0 (flat)"
        )
    _check_secure_tiers(self, f"hierarchy.edges = {self.hierarchy.edges}")


def _check_secure_tiers(self: Any, what: str) -> None:
    """Secure aggregation through edges: the edges relay and add masked vectors, only the root unmasks."""
    sa = self.secure_aggregation
    if not sa.enabled:
        return
    if self.hierarchy.edge_rounds != 1:
        raise ConfigError(
            f"{what} with secure_aggregation.enabled and hierarchy.edge_rounds = {self.hierarchy.edge_rounds}: an "
            "edge round needs the edge's own mean, which secure aggregation across tiers hides from it; set "
            "hierarchy.edge_rounds = 1"
        )
    if sa.malicious_server:
        raise ConfigError(
            f"{what} with secure_aggregation.malicious_server = true: the consistency round through edges is not "
            "built; the honest-but-curious variant runs across tiers"
        )


def check_gossip_settings(cfg: Any) -> None:
    """Refuse ``[robust]`` / ``[compression]`` settings that gossip cannot honour, by name."""
    g = cfg.gossip
    if cfg.compression.encoding == "topk":
        raise ConfigError(
            "compression.encoding = 'topk' with gossip: top-k of a whole model drops most of it, and error "
            "feedback needs a reference model both peers share, which push-pull with random partners does not "
            "keep; use 'q8' (8-bit model) and/or compression.zstd = true"
        )
    if g.algorithm == "group_average":
        if cfg.robust.rule != "mean" or cfg.robust.norm_bound > 0:
            raise ConfigError(
                "[robust] with gossip.algorithm = 'group_average': a group's reducers average exactly what "
                "arrived, with no robust rule yet; set robust.rule = 'mean' and robust.norm_bound = 0, or use "
                "gossip.algorithm = 'dpsgd' (robust mixing) or 'gossip' (bounded merges)"
            )
        if cfg.compression.encoding != "dense" or cfg.compression.zstd:
            raise ConfigError(
                "[compression] with gossip.algorithm = 'group_average': model slices travel as dense float32; "
                "set compression.encoding = 'dense' and compression.zstd = false"
            )
    if g.algorithm == "gossip" and cfg.robust.rule != "mean":
        raise ConfigError(
            f"robust.rule = {cfg.robust.rule!r} with gossip.algorithm = 'gossip': a push-pull merge sees one "
            "model at a time, so there is nothing to take a median of; use robust.norm_bound > 0 (clipped or "
            "rejecting merge) or gossip.algorithm = 'dpsgd', which mixes a whole neighbourhood through the rule"
        )
