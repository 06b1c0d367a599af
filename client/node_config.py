"""A node operator's config for `shoal node`: where the federation is, which tasks this node
runs (each pinned by the SHA-256 of its source, with the local data it reads) and the limits
a run's config must keep before this node takes part.

No code travels: the server names a task; the node runs it only if its operator installed
that task here under that name and pinned it, and only if the server's copy has the same hash; it
loads its own reference of it, never a text from the network. ``[limits]`` are this operator's
floors (shoal/floors.py): a run's config below any of them is refused with the reason, which the
run's status shows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.config import Config, config_from_dict
from shoal.config.sections import PRIVACY_MODES
from shoal.errors import ConfigError
from shoal.floors import below_floor
from shoal.pki import check_node_name

BUILTIN = "builtin"  # shoal's own task of [model] + [data]; its data is a shard of `shoal data split`


def source_sha256(ref: str) -> str:
    """The SHA-256 of a task reference's source file (what `shoal node pin` prints)."""
    from shoal.server.task_registry import task_sha256

    return task_sha256(ref)


@dataclass(frozen=True)
class AllowedTask:
    """One task this node runs: the name runs give it (its reference unless the operator names it),
    the reference this node loads, its pin and the data it reads."""

    ref: str
    sha256: str
    data: Path
    name: str = ""
    bundle: Path | None = None  # a signed bundle's file this node verified (client/bundle_tasks.py)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.ref)

    def installed_sha256(self) -> str:
        """The SHA-256 of what is installed here now: the task's source, or its bundle's file."""
        if self.bundle is None:
            return source_sha256(self.ref)
        try:
            return hashlib.sha256(self.bundle.read_bytes()).hexdigest()
        except OSError as e:
            raise ConfigError(f"bundle {self.bundle} cannot be read: {e.strerror}") from None


@dataclass
class Limits:
    """What a run's config may ask of this node: its operator's floors (shoal/floors.py;
    max_parameters and max_target_epsilon 0: no limit of that kind)."""

    max_epochs: int = 10
    max_rounds: int = 10_000
    privacy_modes: list[str] = field(default_factory=lambda: list(PRIVACY_MODES))
    min_secure_group: int = 3  # secure aggregation over fewer nodes a round (or a lower min_inputs) is refused
    require_secure_aggregation: bool = False  # take part only in securely aggregated runs
    min_noise_multiplier: float = 0.0  # under DP, privacy.noise_multiplier at least this
    max_target_epsilon: float = 0.0  # under DP, privacy.target_epsilon set and at most this
    min_abort_bound: float = 0.0  # distributed DP, secure: privacy.abort_bound at least this (0: any)
    max_parameters: int = 0  # the largest model this node trains (0: no limit)


@dataclass
class BundlePolicy:
    """[node] keys for signed task bundles (`shoal run submit --bundle`): the publisher keys this
    node trusts (none: it takes no bundle), the data a bundle's task reads here, and the limits of
    the worker process that imports a bundle's task first (client/bundle_tasks.py)."""

    trusted_publishers: list[str] = field(default_factory=list)  # "ed25519:BASE64", as `shoal bundle keygen` prints
    data: Path | None = None  # node.bundle_data: the --data a bundle's task reads on this node
    check_mb: int = 2048  # node.bundle_check_mb: memory of the worker that imports a bundle's task first
    check_s: float = 60.0  # node.bundle_check_s: its time to load the task and build its model
    max_mb: int = 64  # node.bundle_max_mb: the largest bundle this node fetches


@dataclass
class NodeConfig:
    """[node]: the federation's URL (or several, in order of preference: the node moves to the next
    when the one it uses stops answering), this node's credential (a token file, or a certificate and
    key enrolled with `shoal server nodes add --csr`), its device, state folder and poll period."""

    server: str
    token_file: Path | None
    name: str
    cert: Path | None = None
    key: Path | None = None
    ca_cert: Path | None = None
    device: str = "auto"
    state_dir: Path = Path("node-state")
    poll_s: float = 2.0
    limits: Limits = field(default_factory=Limits)
    tasks: dict[str, AllowedTask] = field(default_factory=dict)
    servers: list[str] = field(default_factory=list)  # every URL, ``server`` first ([] = ``server`` alone)
    bundles: BundlePolicy = field(default_factory=lambda: BundlePolicy())  # signed task bundles it takes

    def __post_init__(self) -> None:
        self.servers = self.servers or [self.server]

    def check(self, offer: dict[str, Any]) -> str | None:
        """Why this node refuses a run (None: it takes part). ``offer``: the server's
        {run, task, task_sha256, config}, already checked to be of the right shape."""
        ref, pin, cfg = offer["task"], offer["task_sha256"], offer["config"]
        allowed = self.tasks.get(ref)  # by the name runs give it
        if allowed is None:
            return f"task {ref[:200]} is not allowed on node {self.name} (its node config lists {sorted(self.tasks)})"
        if pin != allowed.sha256:
            return (
                f"task {ref[:200]}: the server's source has sha256 {pin[:16]}..., "
                f"node {self.name} pins {allowed.sha256[:16]}..."
            )
        try:
            mine = allowed.installed_sha256()
        except ConfigError as e:
            return f"task {ref[:200]}: the copy installed on node {self.name} cannot be read: {e}"
        if mine != allowed.sha256:
            return (
                f"task {ref[:200]}: the copy installed on node {self.name} changed "
                f"(sha256 {mine[:16]}..., pinned {allowed.sha256[:16]}...)"
            )
        if allowed.ref != BUILTIN:  # the run's config as this node runs it: with its own reference of the task
            cfg = {**cfg, "task": {**cfg.get("task", {}), "app": allowed.ref}}
        parsed = _run_config(json.dumps(cfg, sort_keys=True, default=str))
        if isinstance(parsed, str):
            return f"the run's config is not one node {self.name} takes: {parsed}"
        return below_floor(self.limits, parsed, f"node {self.name}'s")


@functools.lru_cache(maxsize=64)
def _run_config(text: str) -> Config | str:
    """A run's config (JSON text) read and checked, or why it cannot be: once per config, not at
    each of its tasks (every task of a run carries the same config)."""
    try:
        return config_from_dict(json.loads(text)).validate()
    except ConfigError as e:
        return str(e)


def parse_servers(value: object, where: str) -> list[str]:
    """``node.server`` (or ``shoal node --server``): one URL, several comma-separated, or a TOML list;
    all https:// (or all http:// for --insecure servers); ConfigError naming ``where`` otherwise."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(u, str) for u in items):
        raise ConfigError(f"{where} must be a URL, several comma-separated, or a list of URLs")
    urls = [u.strip().rstrip("/") for u in items if u.strip()]
    if not urls or len(urls) > 64:
        raise ConfigError(f"{where} names {len(urls)} servers; give 1 to 64")
    if not (all(u.startswith("https://") for u in urls) or all(u.startswith("http://") for u in urls)):
        raise ConfigError(f"{where} = {value!r} must start with https:// (or all with http:// for --insecure servers)")
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{where} names a server twice")
    return urls


def load_node_config(path: Path) -> NodeConfig:
    """Read and check a node config (TOML: [node], [limits], [[tasks]]); ConfigError naming the key."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"node config {path} cannot be read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"node config {path} is not TOML: {e}") from None
    unknown = sorted(set(raw) - {"node", "limits", "tasks"})
    if unknown:
        raise ConfigError(f"node config {path}: unknown table [{unknown[0]}]; expected [node], [limits], [[tasks]]")
    node = dict(raw.get("node", {}))
    if "server" not in node:
        raise ConfigError(f"node config {path}: node.server (a URL, or a list of them) is needed")
    servers = parse_servers(node.pop("server"), "node.server")
    node["server"] = servers[0]
    for key in ("server", "name"):
        if not isinstance(node.get(key), str) or not node[key]:
            raise ConfigError(f"node config {path}: node.{key} (a string) is needed")
    check_node_name(node["name"])  # ASCII only: no look-alike of another node's name
    bundles = bundle_policy(node, path)
    known = {"server", "token_file", "cert", "key", "name", "ca_cert", "device", "state_dir", "poll_s"}
    if set(node) - known:
        raise ConfigError(f"node config {path}: unknown key node.{sorted(set(node) - known)[0]}")
    for key in known - {"poll_s"}:
        if key in node and (not isinstance(node[key], str) or not node[key]):
            raise ConfigError(f"node config {path}: node.{key} must be a non-empty string")
    if ("token_file" in node) == ("cert" in node) or ("cert" in node) != ("key" in node):
        raise ConfigError(
            f"node config {path}: give node.token_file (a node added with a token) or node.cert and node.key "
            "(a node enrolled by key), one of the two"
        )
    poll_s = node.get("poll_s", 2.0)
    if not isinstance(poll_s, (int, float)) or not (math.isfinite(poll_s) and 0.1 <= poll_s <= 300):
        raise ConfigError(f"node.poll_s = {poll_s!r} must be a number of seconds in [0.1, 300]")
    limits = Limits()
    for key, value in raw.get("limits", {}).items():
        if not hasattr(limits, key):
            raise ConfigError(f"node config {path}: unknown key limits.{key}")
        want = type(getattr(limits, key))
        if want is float and type(value) is int:
            value = float(value)
        if (
            type(value) is not want
            or (want is float and not math.isfinite(value))
            or (want in (int, float) and value < 0)
        ):
            raise ConfigError(f"limits.{key} = {value!r} must be a {want.__name__} >= 0")
        setattr(limits, key, value)
    if limits.min_secure_group < 3:
        raise ConfigError(f"limits.min_secure_group = {limits.min_secure_group} must be >= 3")
    if limits.min_abort_bound > 1:
        raise ConfigError(f"limits.min_abort_bound = {limits.min_abort_bound} must be a probability in [0, 1]")
    bad = sorted(set(limits.privacy_modes) - set(PRIVACY_MODES))
    if bad:
        raise ConfigError(f"limits.privacy_modes: {bad[0]!r} is not one of {PRIVACY_MODES}")
    tasks = {}
    entries = raw.get("tasks", [])
    if not isinstance(entries, list):
        raise ConfigError(f"node config {path}: tasks must be [[tasks]] tables (ref, sha256, data)")
    for i, t in enumerate(entries):
        if (
            not isinstance(t, dict)
            or not {"ref", "sha256", "data"} <= set(t) <= {"ref", "sha256", "data", "name"}
            or not all(isinstance(v, str) and v for v in t.values())
        ):
            raise ConfigError(
                f"node config {path}: [[tasks]] number {i + 1} needs ref, sha256 and data (and may have name), strings"
            )
        entry = AllowedTask(t["ref"], t["sha256"], Path(t["data"]).expanduser(), t.get("name", ""))
        if entry.name in tasks:
            raise ConfigError(f"node config {path}: two [[tasks]] are named {entry.name!r}")
        tasks[entry.name] = entry
    return NodeConfig(
        server=servers[0],
        servers=servers,
        token_file=Path(node["token_file"]).expanduser() if "token_file" in node else None,
        name=node["name"],
        cert=Path(node["cert"]).expanduser() if "cert" in node else None,
        key=Path(node["key"]).expanduser() if "key" in node else None,
        ca_cert=Path(node["ca_cert"]).expanduser() if node.get("ca_cert") else None,
        device=str(node.get("device", "auto")),
        state_dir=Path(node.get("state_dir", f"{node['name']}-state")).expanduser(),
        poll_s=float(poll_s),
        limits=limits,
        tasks=tasks,
        bundles=bundles,
    )


BUNDLE_KEYS = ("trusted_publishers", "bundle_data", "bundle_check_mb", "bundle_check_s", "bundle_max_mb")


def bundle_policy(node: dict[str, Any], path: Path) -> BundlePolicy:
    """The [node] keys of signed task bundles, taken out of ``node`` and checked; ConfigError
    naming the key otherwise."""
    from shoal.bundle import BundleError, parse_public_key

    got = {k: node.pop(k) for k in BUNDLE_KEYS if k in node}
    keys = got.get("trusted_publishers", [])
    if not isinstance(keys, list) or len(keys) > 64:
        raise ConfigError(f"node config {path}: node.trusted_publishers is a list of at most 64 publisher keys")
    for key in keys:
        try:
            parse_public_key(key)
        except BundleError as e:
            raise ConfigError(f"node config {path}: node.trusted_publishers: {str(key)[:60]!r}: {e}") from None
    data = got.get("bundle_data")
    if data is not None and (not isinstance(data, str) or not data):
        raise ConfigError(f"node config {path}: node.bundle_data must be a path")
    if keys and data is None:
        raise ConfigError(
            f"node config {path}: node.trusted_publishers is set: give node.bundle_data, the data bundles read"
        )
    policy = BundlePolicy(list(dict.fromkeys(keys)), Path(data).expanduser() if data else None)
    for key, attr, low in (
        ("bundle_check_mb", "check_mb", 512),
        ("bundle_check_s", "check_s", 1),
        ("bundle_max_mb", "max_mb", 1),
    ):
        if key in got:
            value, want = got[key], type(getattr(policy, attr))
            if want is float and type(value) is int:
                value = float(value)
            if type(value) is not want or not math.isfinite(value) or value < low:
                raise ConfigError(f"node config {path}: node.{key} = {value!r} must be a {want.__name__} >= {low}")
            setattr(policy, attr, value)
    return policy
