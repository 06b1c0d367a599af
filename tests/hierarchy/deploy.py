"""A hierarchy of real processes on 127.0.0.1: a root `shoal server`, edges (`shoal server --parent`)
and `shoal client` nodes, each given the edges as its list of servers. Used by the process test and
by bench/hierarchy.py --processes. Every process is killed when the context ends."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from shoal.config import load_config
from shoal.pki import write_secret
from shoal.server.registry import Registry
from shoal.shard_split import write_shards
from tests.ports import free_port
from tests.spawn import kill_group, python_process

CONFIG = """
[simulation]
seed = 7
num_clients = {n}
clients_per_round = {n}
progress = false
[data]
dataset = "synthetic"
[model]
name = "logreg"
[train]
batch_size = 10
lr = 0.05
[server]
host = "127.0.0.1"
port = {port}
rounds = {rounds}
min_nodes = {n}
poll_s = 1.0
deadline_s = {deadline}
min_fraction = 0.5
keep_checkpoints = 100
checkpoint_dir = "{tmp}/ck"
db = "{tmp}/nodes.sqlite"
out_dir = "{tmp}/run"
eval = false
admin_token_file = "{tmp}/admin.token"
{server_extra}
[hierarchy]
edge_names = {edges}
edge_timeout_s = 2.0
edge_margin_s = 0.5
{hierarchy_extra}
"""

REPO = Path(__file__).resolve().parents[2]
REATTACHED = re.compile(r"attached to (\S+), ([0-9.]+) s after the last server stopped answering")


def shoal(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return python_process(args, log, env=env)


class Hierarchy:
    """A root, ``edges`` edge aggregators and ``n`` nodes; node i lists the edges starting from
    edge ``i * edges // n`` (its own), then the others in turn (``edges = 0``: flat, every node
    polls the root)."""

    def __init__(
        self,
        tmp: Path,
        n: int,
        edges: int,
        rounds: int,
        deadline: float,
        extra: str = "",
        values: dict[str, str] | None = None,
        add: dict[str, str] | None = None,
    ):
        """``extra``: TOML tables appended to the config (e.g. [secure_aggregation]); ``values``: new
        TOML values for keys CONFIG sets (each key appears once in it); ``add``: TOML lines added to
        its [server] (key ``server``) and [hierarchy] (key ``hierarchy``) tables."""
        self.tmp, self.n = tmp, n
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.edge_names = [f"edge-{chr(97 + e)}" for e in range(edges)]
        self.edge_ports = {e: free_port() for e in self.edge_names}
        self.admin = secrets.token_urlsafe(32)
        write_secret(tmp / "admin.token", self.admin.encode())
        self.config = tmp / "cfg.toml"
        text = CONFIG
        for key, value in (values or {}).items():
            text, found = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
            assert found == 1, f"{key} is not a key of the test config"
        self.config.write_text(
            text.format(
                n=n,
                port=self.port,
                rounds=rounds,
                deadline=deadline,
                tmp=tmp,
                edges=json.dumps(self.edge_names),
                server_extra=(add or {}).get("server", ""),
                hierarchy_extra=(add or {}).get("hierarchy", ""),
            )
            + extra  # more tables (e.g. [secure_aggregation])
        )
        self.cfg = load_config(self.config)
        self.shards = write_shards(self.cfg, tmp / "shards")
        reg = Registry(self.cfg.server.db)
        for name in [p.stem for p in self.shards] + self.edge_names:  # every node enrolled at the root
            write_secret(tmp / f"{name}.token", reg.add(name).encode())
        reg.close()
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []

    def _start(self, tag: str, args: list[str]) -> subprocess.Popen:
        log = self.tmp / f"{tag}.log"
        self.logs.append(log)
        p = self.procs[tag] = shoal(args, log)
        return p

    def root(self) -> subprocess.Popen:
        return self._start("root", ["server", "--config", str(self.config), "--insecure"])

    def edge(self, name: str, sets: dict | None = None) -> subprocess.Popen:
        """Edge ``name`` with the root's config; ``sets``: config values of its own (``--set``)."""
        sets = {
            "server.port": self.edge_ports[name],
            "server.out_dir": str(self.tmp / name),
            "hierarchy.parent_token_file": str(self.tmp / f"{name}.token"),
            **(sets or {}),
        }
        args = ["server", "--config", str(self.config), "--insecure", "--parent", self.url]
        for k, v in sets.items():
            args += ["--set", f"{k}={json.dumps(v)}"]
        return self._start(name, args)

    def start_servers(self, timeout: float = 120, edge_sets: dict[str, dict] | None = None) -> None:
        """The root and every edge, once all of them accept connections (:meth:`listening`);
        ``edge_sets``: an edge's own config values (:meth:`edge`), by its name; such an edge may
        stop at once (it is not waited for)."""
        self.root()
        for e in self.edge_names:
            self.edge(e, (edge_sets or {}).get(e))
        self.listening(timeout, skip=list(edge_sets or {}))

    def start_nodes(self) -> None:
        """Every node as a `shoal client` (:meth:`node`)."""
        for i in range(self.n):
            self.node(i)

    def listening(self, timeout: float, skip: list[str] | None = None) -> None:
        """Wait until the root and every edge (but ``skip``) accept connections."""
        end = time.monotonic() + timeout
        for port in [self.port, *(p for e, p in self.edge_ports.items() if e not in (skip or []))]:
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > end:
                        raise AssertionError(f"port {port} not listening after {timeout} s\n{self.dump()}") from None
                    time.sleep(0.1)

    def edge_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.edge_ports[name]}"

    def node(self, i: int) -> subprocess.Popen:
        shard = self.shards[i]
        first = i * len(self.edge_names) // self.n
        order = self.edge_names[first:] + self.edge_names[:first]
        servers = ",".join(self.edge_url(e) for e in order) or self.url  # no edges: the root itself
        args = ["client", "--server", servers, "--token-file", str(self.tmp / f"{shard.stem}.token")]
        args += ["--data", str(shard), "--config", str(self.config), "--device", "cpu"]
        return self._start(shard.stem, args)

    def hosts(self, count: int, dropout: float = 0.0, seed: int = 0, silent: list[str] | None = None) -> list[str]:
        """The ``n`` nodes in ``count`` node hosts (tests/hierarchy/nodehost.py: the real node code,
        many nodes on one event loop per process); node i in host ``i % count``, with the same list
        of servers as :meth:`node` gives it. Each host writes its uploads' outcomes to
        ``host-K.events.jsonl`` (:meth:`events`). Returns the hosts' tags."""
        tags = []
        for k in range(count):
            nodes = []
            for i in range(k, self.n, count):
                first = i * len(self.edge_names) // self.n
                order = self.edge_names[first:] + self.edge_names[:first]
                servers = ",".join(self.edge_url(e) for e in order) or self.url
                stem = self.shards[i].stem
                nodes.append(
                    {
                        "name": stem,
                        "shard": str(self.shards[i]),
                        "token_file": str(self.tmp / f"{stem}.token"),
                        "servers": servers,
                    }
                )
            spec = self.tmp / f"host-{k}.json"
            events = self.tmp / f"host-{k}.events.jsonl"
            spec.write_text(
                json.dumps(
                    {
                        "silent": silent or [],
                        "config": str(self.config),
                        "nodes": nodes,
                        "dropout": dropout,
                        "seed": seed,
                        "events": str(events),
                    }
                )
            )
            tag = f"host-{k}"
            log = self.tmp / f"{tag}.log"
            self.logs.append(log)
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            self.procs[tag] = python_process([str(spec)], log, module="tests.hierarchy.nodehost", env=env, cwd=REPO)
            tags.append(tag)
        return tags

    def events(self) -> list[dict]:
        """Every hosted node's upload outcomes (:meth:`hosts`)."""
        out: list[dict] = []
        for path in sorted(self.tmp.glob("host-*.events.jsonl")):
            out += [json.loads(line) for line in path.read_text().splitlines()]
        return out

    def node_edge(self, i: int) -> str:
        return self.edge_names[i * len(self.edge_names) // self.n]

    def status(self) -> dict | None:
        req = urllib.request.Request(self.url + "/v1/status", headers={"Authorization": f"Bearer {self.admin}"})
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def rss_mb(self, tag: str) -> float | None:
        """The process's resident memory now (VmRSS), MB; None once it ended."""
        try:
            text = Path(f"/proc/{self.procs[tag].pid}/status").read_text()
        except OSError:
            return None
        m = re.search(r"VmRSS:\s+(\d+) kB", text)
        return int(m.group(1)) / 1024 if m else None

    def wait_status(self, pred, timeout: float, sample=None) -> dict:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = self.status()
            if sample is not None:
                sample()
            if st is not None and pred(st):
                return st
            if st is None and "root" in self.procs and self.procs["root"].poll() is not None:
                raise AssertionError(f"the root ended before the status condition was met\n{self.dump()}")
            time.sleep(0.1)
        raise AssertionError(f"status condition not met in {timeout} s; last {self.status()}\n{self.dump()}")

    def wait(self, tag: str, timeout: float, sample=None) -> int:
        end = time.monotonic() + timeout
        p = self.procs[tag]
        while time.monotonic() < end:
            if sample is not None:
                sample()
            if p.poll() is not None:
                return p.returncode
            time.sleep(0.1)
        raise AssertionError(f"{tag} did not exit in {timeout} s\n{self.dump()}")

    def kill(self, tag: str) -> None:
        p = self.procs[tag]
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(5)

    def reattach_times(self) -> list[float]:
        """Seconds from a node's first failed request to its first answer from the next server."""
        out = []
        for p in self.logs:
            if p.exists() and not p.stem.startswith(("root", "edge")):
                out += [float(m.group(2)) for m in REATTACHED.finditer(p.read_text())]
        return out

    def records(self) -> list[dict]:
        path = self.tmp / "run" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def edge_records(self, name: str) -> list[dict]:
        path = self.tmp / name / "edge_metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def dump(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in self.logs if p.exists())

    def stop(self) -> None:
        for p in self.procs.values():
            kill_group(p, 5)


@contextmanager
def hierarchy(
    tmp: Path,
    n: int = 4,
    edges: int = 2,
    rounds: int = 6,
    deadline: float = 6.0,
    extra: str = "",
    values: dict[str, str] | None = None,
    add: dict[str, str] | None = None,
):
    h = Hierarchy(tmp, n, edges, rounds, deadline, extra, values, add)
    try:
        yield h
    finally:
        h.stop()
