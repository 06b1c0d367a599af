"""A fuzzer of insiders: researcher, node and edge credentials against a live federation server,
shared by bench/fuzz_server.py ``--insiders`` (thousands of requests) and
tests/server/test_insider_fuzz.py (a few hundred).

The federation hosts researcher ``rb``'s run (run-1, the built-in logistic regression) with an open
round selecting the nodes n0 and n1; ``f0`` is an enrolled node that holds no task, ``e0`` the
operator's edge (``hierarchy.edge_names``), ``ra`` the hostile researcher. Every request drawn is
one an insider's role does not allow, by category:

- ``task_ref`` (ra): runs naming a task by a reference the operator did not register: stdlib
  callables whose call would leave a marker file (``subprocess:getoutput`` with ``touch``), a
  Python file that leaves a marker when imported, device and system files, look-alike names,
  URLs, junk; also through the config's ``[task] app``. No device that blocks or grows memory
  is named (``/dev/null`` stands for them).
- ``floors`` (ra, the built-in task): configs below a floor or outside a run's keys:
  ``secure_aggregation.min_inputs`` < 3, one client per secure round, NaN/Inf/1e999 numbers, the
  server's own keys (port, database, admin token, TLS files), edges named by the run.
- ``other_run`` (ra): reading, following, stopping and pulling files of rb's run.
- ``chunks`` (f0 and e0, which hold no task; n0 and f0 for a run that never exists): well-formed
  openings of chunked uploads.
- ``edge`` (e0): claims of names that are no node (strangers, researchers, ``admin``, itself,
  look-alikes), partials for nodes it does not hold; the same routes from f0, which is no edge.
- ``roles``: each credential on the routes of another role.

After every request: no 5xx; nothing accepted (a 2xx, except an edge poll that took no node
and gave every refusal the one reason ``not_claimable``); the state unchanged (the runs table,
the nodes' answers, run-1's model, version, round and counters, the open chunked uploads, the
edge roster, the registry, and no marker file).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from shoal.config import config_from_dict
from shoal.pki import write_secret
from shoal.server.federation.routes import make_federation_app
from shoal.server.federation.runs import Federation
from shoal.server.federation.runs_db import RunsDB
from shoal.server.http_common import CHUNKS
from shoal.server.registry import Registry

RUN = "run-1"
NODES = ["n0", "n1", "f0"]
EDGE = "e0"
CATEGORIES = ("task_ref", "floors", "other_run", "chunks", "edge", "roles")
RUN_CONFIG = {
    "simulation": {"seed": 1, "num_clients": 5},
    "data": {"dataset": "synthetic"},
    "model": {"name": "logreg"},
    "train": {"batch_size": 10, "lr": 0.05},
    "server": {"rounds": 5, "eval": False, "deadline_s": 600.0, "clients_per_round": 2, "min_nodes": 2},
}


@dataclass
class Insiders:
    url: str
    fed: Federation
    registry: Registry
    app: web.Application
    tokens: dict[str, str]  # name -> token: nodes, the edge, researchers ra and rb, "admin"
    marker: Path  # exists once hostile code ran
    canary: Path  # a Python file that creates ``marker`` when imported


@asynccontextmanager
async def insider_federation(tmp: Path):
    """The federation the fuzzer hits (see the module doc), on 127.0.0.1, no clock of its own."""
    admin = secrets.token_urlsafe(32)
    write_secret(tmp / "admin.token", admin.encode())
    researchers = {"ra": secrets.token_urlsafe(32), "rb": secrets.token_urlsafe(32)}
    write_secret(tmp / "researchers", "".join(f"{n} {t}\n" for n, t in researchers.items()).encode())
    cfg = config_from_dict(
        {
            "server": {"db": str(tmp / "nodes.sqlite"), "admin_token_file": str(tmp / "admin.token")},
            "federation": {
                "enabled": True,
                "dir": str(tmp / "fed"),
                "researcher_tokens_file": str(tmp / "researchers"),
            },
            "hierarchy": {"edge_names": [EDGE]},
        }
    ).validate()
    registry = Registry(cfg.server.db)
    tokens = {n: registry.add(n) for n in [*NODES, EDGE]}
    tokens.update(researchers, admin=admin)
    db = RunsDB(tmp / "fed" / "runs.sqlite")
    fed = Federation(cfg, db, registered=lambda: len(NODES))
    fed.submit("builtin", RUN_CONFIG, "rb", time.monotonic())
    fed.tick(time.monotonic())
    svc = fed.active[RUN]
    now = time.monotonic()
    for n in ("n0", "n1"):
        svc.seen(n, now)
    assert svc.tick(now) and set(svc.rounds.selected) == {"n0", "n1"}
    marker = tmp / "hostile-code-ran"
    canary = tmp / "canary.py"
    canary.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n\n\ndef task(**kw):\n    return None\n")
    app = make_federation_app(fed, registry)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield Insiders(f"http://127.0.0.1:{runner.addresses[0][1]}", fed, registry, app, tokens, marker, canary)
    finally:
        await runner.cleanup()
        registry.close()
        db.close()


@dataclass
class Probe:
    category: str
    who: str
    method: str
    path: str
    body: bytes | None = None


def _json(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()


def _task_refs(ins: Insiders) -> list:
    c = str(ins.canary)
    return [
        "subprocess:getoutput",
        "os:system",
        "builtins:exec",
        "builtins:eval",
        "importlib:import_module",
        "pickle:loads",
        f"{c}:task",
        c,
        f"{ins.canary.parent}/../{ins.canary.parent.name}/canary.py:task",
        "/dev/null:x",
        "/etc/hostname:x",
        "../../../etc/passwd:task",
        "http://evil.example/t.py:task",
        "shoal.tasks:nonexistent",
        "shoal.tasks:__builtins__",
        "\u0455hoal.tasks:logreg",  # a Cyrillic s
        "shoal.tasks\x00:x",
        "",
        "x" * 2000,
        42,
        None,
        ["builtin"],
        {"ref": "builtin"},
    ]


def _args(ins: Insiders) -> dict:
    cmd = f"touch {ins.marker}"
    return {"cmd": cmd, "command": cmd, "source": f"open({str(ins.marker)!r}, 'w')"}


def _floors(ins: Insiders) -> list[dict]:
    sa = {"enabled": True}
    return [
        {"secure_aggregation": {**sa, "min_inputs": 1}},
        {"secure_aggregation": {**sa, "min_inputs": 2}},
        {"secure_aggregation": {**sa, "min_inputs": 0}},
        {"secure_aggregation": sa, "server": {"clients_per_round": 1, "min_nodes": 1}},
        {"train": {"lr": float("nan")}},
        {"train": {"lr": float("inf")}},
        {"train": {"lr": -float("inf"), "batch_size": 10}},
        {"train": {"epochs": float("nan")}},
        {"server": {"deadline_s": float("nan")}},
        {"server": {"port": 1}},
        {"server": {"db": str(ins.canary.parent / "other.sqlite")}},
        {"server": {"admin_token_file": "/etc/hostname"}},
        {"server": {"tls_cert": "/etc/hostname", "tls_key": "/etc/hostname"}},
        {"federation": {"enabled": False}},
        {"hierarchy": {"edge_names": ["f0"]}},
        {"hierarchy": {"edge_names": ["f0", EDGE]}},
        {"task": {"app": "subprocess:getoutput", "args": _args(ins)}},
        {"task": {"app": f"{ins.canary}:task"}},
        {"privacy": {"mode": "local", "noise_multiplier": float("nan")}},
    ]


def draw(rng: random.Random, ins: Insiders, category: str) -> Probe:
    """One hostile request of ``category`` (see the module doc)."""
    if category == "task_ref":
        ref = rng.choice(_task_refs(ins))
        config = {**RUN_CONFIG, "task": {"args": _args(ins)}} if rng.random() < 0.7 else RUN_CONFIG
        return Probe(category, "ra", "POST", "/v1/runs", _json({"task": ref, "config": config}))
    if category == "floors":
        bad = rng.choice(_floors(ins))
        config = json.loads(json.dumps(RUN_CONFIG))
        for section, keys in bad.items():
            config[section] = {**config.get(section, {}), **keys}
        body = _json({"task": "builtin", "config": config})
        if rng.random() < 0.2:  # a number JSON allows and Python reads as inf
            body = body.replace(b'"lr": 0.05', b'"lr": 1e999')
        return Probe(category, "ra", "POST", "/v1/runs", body)
    if category == "other_run":
        path = rng.choice(
            [
                f"/v1/runs/{RUN}",
                f"/v1/runs/{RUN}/metrics?after=0",
                f"/v1/runs/{RUN}/files/metrics.jsonl",
                f"/v1/runs/{RUN}/files/model.safetensors",
                f"/v1/runs/{RUN}/files/summary.json",
            ]
        )
        if rng.random() < 0.3:
            return Probe(category, "ra", "POST", f"/v1/runs/{RUN}/stop")
        return Probe(category, "ra", "GET", path)
    if category == "chunks":
        who, run = rng.choice([("f0", RUN), (EDGE, RUN), ("n0", "run-999"), ("f0", "run-999")])  # no run-999
        size = rng.choice([1, 100, 2900, 10**6])
        body = _json({"size": size, "sha256": hashlib.sha256(secrets.token_bytes(8)).hexdigest()})
        return Probe(category, who, "POST", f"/runs/{run}/v1/uploads", body)
    if category == "edge":
        names = rng.sample(
            ["ghost", "ra", "rb", "admin", EDGE, "n9", "\u0578" + "0", "f0 ", "N0", "n0\x00", "x" * 256],
            k=rng.randint(1, 4),
        )
        if rng.random() < 0.2:
            return Probe(
                category, rng.choice(["f0", "n0"]), "POST", f"/runs/{RUN}/v1/edge/poll?wait=0", _json({"nodes": names})
            )
        if rng.random() < 0.2:
            return Probe(category, EDGE, "POST", f"/runs/{RUN}/v1/partial", secrets.token_bytes(rng.randint(0, 200)))
        return Probe(category, EDGE, "POST", f"/runs/{RUN}/v1/edge/poll?wait=0", _json({"nodes": names}))
    # roles: each credential on another role's route
    who, method, path, body = rng.choice(
        [
            ("f0", "POST", "/v1/runs", _json({"task": "builtin", "config": RUN_CONFIG})),
            (EDGE, "POST", "/v1/runs", _json({"task": "builtin", "config": RUN_CONFIG})),
            ("f0", "GET", f"/v1/runs/{RUN}", None),
            ("f0", "POST", f"/v1/runs/{RUN}/stop", None),
            ("ra", "GET", f"/runs/{RUN}/v1/model", None),
            ("ra", "GET", f"/runs/{RUN}/v1/task?wait=0", None),
            ("rb", "POST", f"/runs/{RUN}/v1/update", b"\x00" * 16),
            ("ra", "GET", "/v1/status", None),
            ("ra", "GET", "/metrics", None),
            ("f0", "GET", "/v1/status", None),
            (EDGE, "GET", "/metrics", None),
            ("ra", "POST", f"/runs/{RUN}/v1/edge/poll?wait=0", _json({"nodes": ["n0"]})),
            ("ra", "GET", "/v1/offers", None),
        ]
    )
    return Probe("roles", who, method, path, body)


def snapshot(ins: Insiders) -> tuple:
    """What no hostile request may change."""
    fed = ins.fed
    svc = fed.active.get(RUN)
    run_state: tuple = ()
    if svc is not None:
        r, c = svc.rounds, svc.counters
        run_state = (
            hashlib.sha256(r.global_params.numpy().tobytes()).hexdigest(),
            r.version,
            r.round,
            r.open,
            tuple(sorted(r.selected)),
            tuple(sorted(r.received)),
            c.accepted,
            c.rounds_completed,
        )
        intake = svc.tier
        run_state += (tuple(sorted((n, h[0]) for n, h in intake.roster.held.items())) if intake else (),)
    return (
        json.dumps([(r.id, r.status, r.reason) for r in fed.db.runs()]),
        json.dumps(fed.db.answers(RUN), sort_keys=True),
        run_state,
        len(ins.app[CHUNKS].sessions),
        tuple((n.name, n.enabled) for n in ins.registry.list()),
        ins.marker.exists(),
    )


@dataclass
class Figures:
    requests: int = 0
    five_xx: int = 0
    accepted: int = 0
    state_changed: int = 0
    status: dict[int, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def note(self, what: str) -> None:
        if len(self.examples) < 8:
            self.examples.append(what)


def _accepted(probe: Probe, status: int, body: bytes) -> bool:
    if status >= 300:
        return False
    if probe.path.split("?")[0].endswith("/v1/edge/poll"):  # 200 with its refusals: it must take no node
        try:
            answer = json.loads(body)
        except ValueError:
            return True
        return answer.get("nodes") != 0 or set(answer.get("refused", {}).values()) - {"not_claimable"} != set()
    return True


async def fuzz(
    ins: Insiders, batches: int, batch: int = 50, seed: int = 0, categories: tuple[str, ...] = CATEGORIES
) -> dict[str, Figures]:
    """``batches`` x ``batch`` hostile requests (``categories`` in turn); the figures per category,
    checked after every request (see the module doc)."""
    rng = random.Random(seed)
    out = {c: Figures() for c in categories}
    before = snapshot(ins)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for i in range(batches * batch):
            probe = draw(rng, ins, categories[i % len(categories)])
            fig = out[probe.category]
            headers = {"Authorization": f"Bearer {ins.tokens[probe.who]}"}
            if probe.body is not None:
                headers["Content-Type"] = "application/json"
            try:
                async with http.request(probe.method, ins.url + probe.path, data=probe.body, headers=headers) as r:
                    status, body = r.status, await r.read()
            except aiohttp.ClientError as e:
                status, body = 0, repr(e).encode()
            fig.requests += 1
            fig.status[status] = fig.status.get(status, 0) + 1
            what = f"{probe.method} {probe.path[:60]} as {probe.who} ({(probe.body or b'')[:100]!r}): {status}"
            if status >= 500 or status == 0:
                fig.five_xx += 1
                fig.note(f"5xx: {what} {body[:150]!r}")
            elif _accepted(probe, status, body):
                fig.accepted += 1
                fig.note(f"accepted: {what} {body[:150]!r}")
            await asyncio.sleep(0)
            after = snapshot(ins)
            if after != before:
                fig.state_changed += 1
                fig.note(f"state changed: {what}")
                before = after
    return out
