"""The sections of what protects the updates: [privacy] (differential privacy) and
[secure_aggregation]."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from shoal.errors import ConfigError

from .checks import positive

# privacy.mode's choices, named: the privacy sweep runs a grid of them
PrivacyMode = Literal["none", "central", "local", "distributed"]
PRIVACY_MODES = ("none", "central", "distributed", "local")
#: local DP-SGD's steps a round per train.epochs when neither privacy.local_steps nor a sampling rate names them
DEFAULT_STEPS_PER_EPOCH = 10


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
    # distributed DP with secure aggregation in `shoal server` (Poisson): an upper bound on the chance that
    # a sampled node's presence decides whether a round aborts (dropouts and the protocol's thresholds,
    # which the server cannot bound); 1 = the worst case. Below 1 only as the operator declares it
    # (federation.min_abort_bound); docs/privacy.md "Aborted rounds"
    abort_bound: float = 1.0
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
    # local: how many DP-SGD steps a round runs. steps = privacy.local_steps, a number of the config's, whatever
    # a client's example count n_k (at rate B / n_k, an expected batch of B: a round's duration does not follow
    # n_k); epochs = train.epochs passes over the client's data (epochs * round(n_k / B) steps: the
    # round's duration, which the server and anyone timing the upload see, grows with n_k and is NOT covered by
    # the epsilon; samples at q = B / n_k, so local_sampling_rate must be 0)
    local_schedule: Literal["steps", "epochs"] = "steps"
    # local, schedule = steps: DP-SGD steps a round; 0 = train.epochs * round(1/q) with local_sampling_rate q,
    # else train.epochs * 10
    local_steps: int = 0
    # local: DP-SGD's per-example sampling rate q for every client, so a client's epsilon (and the report its node
    # then sends) depends on the config and its rounds only, never on its example count n_k (its expected batch
    # q n_k does, and with it each step's time); 0 = q = B / n_k per client (expected batch B whatever n_k; its
    # epsilon reveals roughly n_k, so a node sends no report unless release = clear, and enforces target_epsilon
    # itself)
    local_sampling_rate: float = 0.0
    # `shoal privacy-sweep`: the grid run after a non-private baseline
    sweep_modes: list[Literal["central", "local", "distributed"]] = field(default_factory=lambda: ["central", "local"])
    sweep_noise_multipliers: list[float] = field(default_factory=lambda: [0.3, 0.6, 1.0, 2.0])  # the sweep's z values
    mia_samples: int = 2000  # members and non-members each, for the membership-inference audit
    canaries: int = 500  # canary clients of the sweep's empirical-epsilon audit (0 = no audit)
    canaries_unseen: int = 1000  # random directions never inserted: the audit's null distribution

    def validate(self) -> None:
        positive("privacy.noise_multiplier", self.noise_multiplier, allow_zero=True)
        positive("privacy.clip_norm", self.clip_norm)
        if not 0 < self.target_quantile < 1:
            raise ConfigError(f"privacy.target_quantile = {self.target_quantile} must be in (0, 1)")
        positive("privacy.clip_lr", self.clip_lr)
        positive("privacy.clipped_count_stddev", self.clipped_count_stddev, allow_zero=True)
        positive("privacy.target_epsilon", self.target_epsilon, allow_zero=True)
        if not 0 < self.delta < 1:
            raise ConfigError(f"privacy.delta = {self.delta} must be in (0, 1)")
        if not 0 <= self.abort_bound <= 1:
            raise ConfigError(f"privacy.abort_bound = {self.abort_bound} must be a probability in [0, 1]")
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
            positive("privacy.gamma", self.gamma, allow_zero=True)
            if not 0 <= self.beta < 1:
                raise ConfigError(f"privacy.beta = {self.beta} must be in [0, 1)")
            if self.sampling != "poisson":
                raise ConfigError(
                    "privacy.mechanism = 'discrete_gaussian' is accounted under Poisson sampling (RDP of the "
                    "paper's bound, or PLD): set privacy.sampling = 'poisson'"
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
        positive("privacy.release_noise_multiplier", self.release_noise_multiplier)
        positive("privacy.release_loss_clip", self.release_loss_clip)
        if not 0 <= self.local_sampling_rate <= 1:
            raise ConfigError(
                f"privacy.local_sampling_rate = {self.local_sampling_rate} must be in [0, 1]; "
                "0 samples at B / n_k per client"
            )
        positive("privacy.local_steps", self.local_steps, allow_zero=True)
        if self.local_schedule == "epochs" and self.local_sampling_rate:
            raise ConfigError(
                f"privacy.local_schedule = 'epochs' samples each client's examples at q = B / n_k, but "
                f"privacy.local_sampling_rate = {self.local_sampling_rate:g} asks for a fixed q (whose steps do "
                "not depend on n_k anyway): set local_schedule = 'steps' (the default) or local_sampling_rate = 0"
            )
        if self.local_schedule == "epochs" and self.local_steps:
            raise ConfigError(
                f"privacy.local_steps = {self.local_steps} with privacy.local_schedule = 'epochs': the epochs "
                "schedule runs train.epochs * round(n_k / B) steps; set local_steps = 0, or local_schedule = "
                "'steps' (the default) to run that many steps whatever n_k"
            )
        if self.release == "noised" and self.mode == "local":
            raise ConfigError(
                "privacy.release = 'noised' with privacy.mode = 'local': the noisy count and loss are charged "
                "per client, local DP-SGD per example; local DP releases no per-round figure of the clients "
                "anyway: use privacy.release = 'withhold'"
            )
        for z in self.sweep_noise_multipliers:
            positive("privacy.sweep_noise_multipliers", z)
        positive("privacy.mia_samples", self.mia_samples)
        positive("privacy.canaries", self.canaries, allow_zero=True)
        if self.canaries == 1:
            raise ConfigError(
                "privacy.canaries = 1: the canary audit fits a Gaussian to the inserted canaries' "
                "cosines and needs at least 2 (or 0 to skip the audit)"
            )
        positive("privacy.canaries_unseen", self.canaries_unseen)
        if self.canaries_unseen < 2:
            raise ConfigError(f"privacy.canaries_unseen = {self.canaries_unseen} must be >= 2")

    def round_steps(self, epochs: int) -> int:
        """Local DP-SGD's steps a round under ``local_schedule = "steps"``, from the config alone
        (``epochs``: train.epochs); 0 under ``"epochs"``, whose steps depend on each client's n_k."""
        if self.local_schedule == "epochs":
            return 0
        if self.local_steps:
            return int(self.local_steps)
        if self.local_sampling_rate:
            return epochs * max(1, round(1 / self.local_sampling_rate))
        return epochs * DEFAULT_STEPS_PER_EPOCH


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
        positive("secure_aggregation.stage_s", self.stage_s)
        if self.min_inputs < MIN_SECURE_INPUTS:
            raise ConfigError(
                f"secure_aggregation.min_inputs = {self.min_inputs} must be >= {MIN_SECURE_INPUTS}: a sum of one "
                "masked input is that input, of two the other's to either node"
            )
        positive("secure_aggregation.degree", self.degree, allow_zero=True)
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
        positive("secure_aggregation.clip", self.clip)
        if not 1 <= self.bits <= 31:
            raise ConfigError(f"secure_aggregation.bits = {self.bits} must be in [1, 31]")
        positive("secure_aggregation.max_weight", self.max_weight, allow_zero=True)
        for stage in ("advertise", "share", "masked", "unmask"):
            v = getattr(self, f"dropout_{stage}")
            if not 0 <= v <= 1:
                raise ConfigError(f"secure_aggregation.dropout_{stage} = {v} must be in [0, 1]")
