"""A node operator's config for `shoal node`: where the federation is, which tasks this node
runs (each pinned by the SHA-256 of its source, with the local data it reads) and the limits
a run's config must keep before this node takes part.

No code travels: the server names a task; the node runs it only if its operator installed
that task here and pinned it, and only if the server's copy has the same hash.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ConfigError

BUILTIN = "builtin"  # shoal's own task of [model] + [data]; its data is a shard of `shoal data split`
PRIVACY_MODES = ("none", "central", "distributed", "local")


def source_sha256(ref: str) -> str:
    """The SHA-256 of a task reference's source file (what `shoal node pin` prints)."""
    if ref == BUILTIN:
        return BUILTIN
    from shoal.server.federation import RunError, task_sha256

    try:
        return task_sha256(ref)
    except RunError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class AllowedTask:
    """One task this node runs: its reference as runs name it, its pin and the data it reads."""

    ref: str
    sha256: str
    data: Path


@dataclass
class Limits:
    """What a run's config may ask of this node."""

    max_epochs: int = 10
    max_rounds: int = 10_000
    privacy_modes: list[str] = field(default_factory=lambda: list(PRIVACY_MODES))
    min_secure_group: int = 0  # secure aggregation over fewer nodes a round is refused
    require_secure_aggregation: bool = False  # take part only in securely aggregated runs


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

    def __post_init__(self) -> None:
        self.servers = self.servers or [self.server]

    def check(self, offer: dict[str, Any]) -> str | None:
        """Why this node refuses a run (None: it takes part). ``offer``: the server's
        {run, task, task_sha256, config}, already checked to be of the right shape."""
        ref, pin, cfg = offer["task"], offer["task_sha256"], offer["config"]
        allowed = self.tasks.get(ref)
        if allowed is None:
            return f"task {ref[:200]} is not allowed on node {self.name} (its node config lists {sorted(self.tasks)})"
        if pin != allowed.sha256:
            return (
                f"task {ref[:200]}: the server's source has sha256 {pin[:16]}..., "
                f"node {self.name} pins {allowed.sha256[:16]}..."
            )
        mine = source_sha256(ref) if ref != BUILTIN else BUILTIN
        if mine != allowed.sha256:
            return (
                f"task {ref[:200]}: the copy installed on node {self.name} changed "
                f"(sha256 {mine[:16]}..., pinned {allowed.sha256[:16]}...)"
            )
        train, server = cfg.get("train", {}), cfg.get("server", {})
        privacy, secure = cfg.get("privacy", {}), cfg.get("secure_aggregation", {})
        epochs = train.get("epochs", 1)
        if not isinstance(epochs, int) or epochs > self.limits.max_epochs:
            return f"train.epochs = {str(epochs)[:20]} is over node {self.name}'s limit of {self.limits.max_epochs}"
        rounds = server.get("rounds", 10)
        if not isinstance(rounds, int) or rounds > self.limits.max_rounds:
            return f"server.rounds = {str(rounds)[:20]} is over node {self.name}'s limit of {self.limits.max_rounds}"
        mode = privacy.get("mode", "none")
        if mode not in self.limits.privacy_modes:
            return f"privacy.mode = {str(mode)[:20]!r} is not one node {self.name} allows ({self.limits.privacy_modes})"
        enabled = secure.get("enabled", False) is True
        if self.limits.require_secure_aggregation and not enabled:
            return f"node {self.name} takes part only in securely aggregated runs (secure_aggregation.enabled)"
        if enabled and self.limits.min_secure_group:
            group = server.get("clients_per_round", 0) or server.get("min_nodes", 1)
            if not isinstance(group, int) or group < self.limits.min_secure_group:
                return (
                    f"secure aggregation over {str(group)[:10]} nodes a round is below node {self.name}'s "
                    f"minimum group of {self.limits.min_secure_group}"
                )
        return None


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
        if type(value) is not type(getattr(limits, key)):
            raise ConfigError(f"limits.{key} = {value!r} must be a {type(getattr(limits, key)).__name__}")
        setattr(limits, key, value)
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
            or set(t) != {"ref", "sha256", "data"}
            or not all(isinstance(v, str) for v in t.values())
        ):
            raise ConfigError(
                f"node config {path}: [[tasks]] number {i + 1} needs exactly ref, sha256 and data (strings)"
            )
        tasks[t["ref"]] = AllowedTask(t["ref"], t["sha256"], Path(t["data"]).expanduser())
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
    )
