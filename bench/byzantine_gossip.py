"""Insiders in gossip: N honest peers and f attackers on the simulator's virtual network, with the
peer code ``shoal peer`` runs (GossipNode, MergeBound, Membership, Freshness), one round = one
``gossip.period``. Each attack runs for ``--attack-rounds`` rounds, then the attackers leave
(go offline for good) and the honest peers train on for ``--after`` rounds.

Attacks (each against the run without attackers, same seed, same honest peers):

- ``alone``: no attack, but the attackers' peers are offline throughout: the honest peers on their
  own. This, not ``none`` (where the attackers' peers train honestly and bring their data), is
  what a defence can at best reach: a peer that sends forged models withholds its data, and
  with peers whose data differ (the default task gives each its own distribution) that costs
  accuracy on the common test set whatever the honest peers do;

- ``scale``: every model an attacker sends is ``x0 + 10 (x - x0)`` (attack.kind = "scale");
- ``sign_flip``: ``x0 - 10 (x - x0)``;
- ``replay``: the attacker re-sends models pushed to it (sender, counter and all) at least
  REPLAY_AGE rounds old to every honest peer, four a round each;
- ``eclipse``: the attacker sends each honest peer two shuffles naming 50 made-up addresses and
  two pushes from made-up senders per round (4 messages per round per peer); none is served.

Recovery runs (no attacker: every peer honest, against ``none``): ``partition`` splits the
network in two halves for the ``--attack-rounds`` rounds (``gossip.partition_end``), each half
training apart, then heals it; ``restart`` restarts peer 0 from scratch (the initial model, an
empty merge window) when the attack rounds end. The notes give the spread (the largest distance
between two peers' models, over the norm of the no-attack run's mean model) at both times, and
the far models clipped toward rather than refused (``followed``). ``--no-follow`` never follows (MergeBound quorum
unreachable: far models from a lone sender or a whole neighbourhood alike are refused).

For each algorithm (push-pull ``gossip``, ``dpsgd``, ``group_average``; replay and eclipse
act on push-pull's messages and views only: D-PSGD's and group averaging's simulated
neighbourhoods are fixed) it prints: the honest peers' mean accuracy at the end of the attack
and ``--after`` rounds after it, the norm of their mean model over the no-attack run's, and the
distance of their mean model from the no-attack run's (over that run's mean norm); with the
defences off (``gossip.merge_bound = 0``, ``max_drift = 0``, ``max_abs = 0``) too. For replay:
replays sent and taken; for eclipse: the longest stretch of rounds without a merge on any
honest peer, made-up entries in views, directories and history samples at most and at the end,
the mean made-up share of honest views and history samples over the attack rounds, and the
honest peers' merges (against the no-attack run's).

    .venv/bin/python bench/byzantine_gossip.py [--honest 5] [--attackers 1] [--attack-rounds 60]
        [--after 30] [--algorithms gossip,dpsgd,group_average] [--attacks alone,scale,sign_flip,replay,eclipse]
        [--defences-only] [--scale 10] [--no-follow] [--set gossip.KEY=VALUE ...]
    .venv/bin/python bench/byzantine_gossip.py --lockout 512 [--old-cap]   # connections, not merges

``--lockout SLOTS``: 12 source addresses x 64 connections (silent, or a request head and no body)
against the peer's connection guard on loopback; prints how ``GET /status`` from a 13th address
and a push with a client certificate fare (512 slots: a peer whose open-file limit is 1,024).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shoal.config import load_config
from shoal.p2p.gossip import ModelMessage
from shoal.p2p.membership import Membership, ShuffleRequest
from shoal.simulations.gossip import GossipSimulation

torch.set_num_threads(1)
SYBILS = 50
REPLAY_AGE = 5.0  # rounds: a replayed model is at least this old
FORGED = ("scale", "sign_flip")
RECOVERY = ("partition", "restart")


def build(args: argparse.Namespace, algorithm: str, attack: str, defences: bool) -> GossipSimulation:
    n = args.honest + args.attackers
    over = [
        'simulation.mode="gossip"',
        f"simulation.num_clients={n}",
        f"simulation.seed={args.seed}",
        f"simulation.rounds={args.attack_rounds + args.after}",
        "train.batch_size=20",
        f'gossip.algorithm="{algorithm}"',
        "gossip.view_size=4",
        "gossip.shuffle_length=2",
        'gossip.topology="complete"',
        "gossip.group_size=3",
        *args.set,
    ]
    if attack in FORGED or attack == "alone":
        over += [
            f'attack.kind="{"sign_flip" if attack == "alone" else attack}"',
            f"attack.fraction={args.attackers / n}",
            f"attack.scale={args.scale}",
        ]
    if attack == "partition":
        over += [f"gossip.partition_end={args.attack_rounds}"]
    if not defences:
        over += ["gossip.merge_bound=0", "gossip.max_drift=0", "gossip.max_abs=0"]
    sim = GossipSimulation.from_config(load_config(None, over))
    if args.no_follow:
        for node in sim.nodes:
            node.merge_bound.quorum = 10**9
    if attack not in (*FORGED, *RECOVERY, "none", "alone"):  # protocol attackers: the last peers, measured apart
        sim.attackers[:] = False
        sim.attackers[args.honest :] = True
        sim.honest = np.flatnonzero(~sim.attackers)
        sim.eval_idx = sim.honest
    return sim


def history(m: Membership) -> list[str]:
    """The peers an honest peer's history sample holds: its min-wise samplers' IDs."""
    return m.history.sample()


class Insider:
    """What a replaying or eclipsing attacker sends each round, on the network's own queue."""

    def __init__(self, sim: GossipSimulation, kind: str):
        self.sim, self.kind = sim, kind
        self.bad = [int(i) for i in np.flatnonzero(sim.attackers)]
        self.sybils = [f"sybil-{k:03d}" for k in range(SYBILS)]
        self.captured: list[ModelMessage] = []
        self.sent = 0
        deliver = sim._deliver

        def spy(msg: Any, now: float) -> None:  # the attacker keeps every model pushed to it
            if isinstance(msg, ModelMessage) and sim.index[msg.target] in self.bad and not msg.reply:
                self.captured = [*self.captured[-63:], msg]
            deliver(msg, now)

        sim._deliver = spy  # type: ignore[method-assign]

    def round(self, start: float) -> None:
        sim, rng = self.sim, self.sim.rng
        for a in self.bad:
            for h in sim.honest.tolist():
                target = sim.ids[h]
                for k in range(4):
                    t = start + float(rng.random())
                    old_enough = [m for m in self.captured if m.seq / 1e6 <= start - REPLAY_AGE]
                    if self.kind == "replay" and old_enough:
                        old = old_enough[int(rng.integers(len(old_enough)))]
                        if old.sender != target:
                            sim.send(dataclasses.replace(old, target=target), t)
                            self.sent += 1
                    elif self.kind == "eclipse":
                        if k < 2:
                            names = rng.choice(SYBILS, size=sim.g.view_size, replace=False)
                            entries = tuple((self.sybils[int(j)], 0) for j in names)
                            sim.send(ShuffleRequest(sim.ids[a], target, entries), t)
                        else:
                            fake = self.sybils[int(rng.integers(SYBILS))]
                            node = sim.nodes[a]
                            msg = ModelMessage(
                                fake, target, node.params.clone(), node.age, node.version, 1, False, int(t * 1e6) + 1
                            )
                            sim.send(msg, t)
                        self.sent += 1


def run(args: argparse.Namespace, algorithm: str, attack: str, defences: bool, ref: dict | None) -> dict:
    sim = build(args, algorithm, attack, defences)
    insider = Insider(sim, attack) if attack in ("replay", "eclipse") else None
    spy = insider
    honest = torch.as_tensor(sim.honest)
    out: dict[str, Any] = {"gap": 0, "fake_view": 0, "fake_dir": 0, "fake_hist": 0}
    shares: dict[str, list[float]] = {"view": [], "hist": []}  # per honest peer and attack round
    last_merge = {int(h): 0 for h in sim.honest}
    merges = {int(h): 0 for h in sim.honest}
    means: dict[int, torch.Tensor] = {}
    if attack == "alone":  # the honest peers without the attacker's peer: the attacker is offline throughout
        sim.online[sim.attackers] = False
    for r in range(1, args.attack_rounds + args.after + 1):
        if r == args.attack_rounds + 1:
            sim.online[sim.attackers] = False  # the attackers leave
            insider = None
            if attack == "restart":
                sim.nodes[0].restart(sim.init)
        if insider is not None:
            insider.round(float(r - 1))
        sim.run_round()
        for h in sim.honest.tolist():
            m = sim.nodes[h].merges
            if m > merges[h]:
                merges[h], last_merge[h] = m, r
            out["gap"] = max(out["gap"], r - last_merge[h])
        if attack == "eclipse":
            fake_v = max(sum(p.startswith("sybil") for p in sim.nodes[h].membership.view) for h in sim.honest)
            fake_d = max(sum(p.startswith("sybil") for p in sim.nodes[h].membership.known) for h in sim.honest)
            out["fake_view"], out["fake_dir"] = max(out["fake_view"], fake_v), max(out["fake_dir"], fake_d)
            out["fake_dir_end"] = fake_d
            if insider is not None:
                for h in sim.honest.tolist():
                    m = sim.nodes[h].membership
                    view, hist = list(m.view), history(m)
                    shares["view"].append(sum(p.startswith("sybil") for p in view) / max(len(view), 1))
                    shares["hist"].append(sum(p.startswith("sybil") for p in hist) / max(len(hist), 1))
                    out["fake_hist"] = max(out["fake_hist"], sum(p.startswith("sybil") for p in hist))
            out["fake_hist_end"] = max(
                sum(p.startswith("sybil") for p in history(sim.nodes[h].membership)) for h in sim.honest
            )
        if r in (args.attack_rounds, args.attack_rounds + args.after):
            ev = sim.evaluate()
            means[r] = sim.models[honest].mean(0)
            out[f"acc{r}"] = ev.get("peer_accuracy_mean", float("nan"))
            out[f"norm{r}"] = float(means[r].norm())
            out[f"max_abs{r}"] = float(sim.models[honest].abs().max())
            out[f"spread{r}"] = float(torch.cdist(sim.models[honest].double(), sim.models[honest].double()).max())
            if ref is not None:
                out[f"dist{r}"] = float((means[r] - ref["means"][r]).norm()) / float(ref["means"][r].norm())
    out["means"] = means
    out["view_share"] = float(np.mean(shares["view"])) if shares["view"] else 0.0
    out["hist_share"] = float(np.mean(shares["hist"])) if shares["hist"] else 0.0
    out["merges"] = sum(merges.values())
    out["rejected"] = sim.rejected
    out["sent"] = spy.sent if spy else 0
    if attack == "replay":
        out["replays_refused"] = sum(sim.nodes[h].freshness.refused for h in sim.honest.tolist())
    out["bounded"] = int(sum(sim.nodes[h].bounded for h in sim.honest.tolist()))
    out["followed"] = int(sum(sim.nodes[h].merge_bound.followed for h in sim.honest.tolist()))
    return out


async def _open(port: int, ctx: Any, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host = "127.0.0.1" if ctx else None
    return await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname=host, local_addr=(source, 0)), 10
    )


async def _ask(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], request: bytes) -> tuple[float, str]:
    t0 = time.perf_counter()
    reader, writer = conn
    writer.write(request)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return time.perf_counter() - t0, head.split(b"\r\n", 1)[0].decode()[9:12]


async def lockout(total: int, old_cap: bool) -> None:
    """12 source addresses x 64 connections (16 silent, 48 TLS callers without a certificate that
    send a request head and no body) against a listener with the peer's connection guard
    (p2p/connections.py, ``total`` slots); then 10 x ``GET /status`` from a 13th address and a
    push with a client certificate from a crowded one, each on a new TLS connection."""
    from aiohttp import web

    from shoal.p2p.connections import MAX_CONNECTIONS_PER_ADDRESS, Connections, GuardedRunner, guarded_site
    from shoal.pki import issue_server_cert, make_ca
    from shoal.tls import client_context, server_context

    tmp = Path(tempfile.mkdtemp())
    make_ca(tmp / "pki", "bench CA", 1)
    ca = tmp / "pki" / "ca.pem"
    cert, key = issue_server_cert(tmp / "pki", ["127.0.0.1"], tmp / "p", 1, client_auth=True)
    guard = Connections(MAX_CONNECTIONS_PER_ADDRESS, 60.0, 60.0, total=total)
    if old_cap:
        guard.per_address = MAX_CONNECTIONS_PER_ADDRESS  # the cap before 1/16 of the open slots
    print(f"slots {guard.total}, reserved for certificates {guard.reserved}, per address {guard.per_address}")

    async def gossip(request: web.Request) -> web.Response:
        return web.json_response({"bytes": len(await request.read())})

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_post("/gossip", gossip)
    runner = GuardedRunner(app, guard, access_log=None)
    await runner.setup()
    site = guarded_site(runner, "127.0.0.1", 0, server_context(cert, key, client_ca=ca), guard)
    await site.start()
    assert site.guard is not None
    port = site.guard.sockets[0].getsockname()[1]
    held = []
    without, with_cert = client_context(ca), client_context(ca, cert, key)
    for a in range(2, 14):
        held += await asyncio.gather(*[_open(port, None, f"127.0.0.{a}") for _ in range(16)])
        for _ in range(48):
            conn = await _open(port, without, f"127.0.0.{a}")
            conn[1].write(b"POST /gossip HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            held.append(conn)
    await asyncio.sleep(1.0)
    g = site.guard
    print(f"crowd: served {g.served}, answered 503 {g.refused}, silent ones evicted {g.evicted}")
    answers = []
    for _ in range(10):
        t0 = time.perf_counter()
        conn = await _open(port, without, "127.0.0.1")
        held.append(conn)
        _, code = await _ask(conn, b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n")
        answers.append(f"{code} in {time.perf_counter() - t0:.3f} s")
    print("GET /status from a 13th address:", ", ".join(answers))
    t0 = time.perf_counter()
    conn = await _open(port, with_cert, "127.0.0.2")
    held.append(conn)
    _, code = await _ask(conn, b"POST /gossip HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
    print(f"a push with a client certificate from a crowded address: {code} in {time.perf_counter() - t0:.3f} s")
    for _, w in held:
        w.close()
    await site.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--honest", type=int, default=5)
    ap.add_argument("--attackers", type=int, default=1)
    ap.add_argument("--attack-rounds", type=int, default=60)
    ap.add_argument("--after", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scale", type=float, default=10.0, help="the forged attacks' factor (x0 +- scale (x - x0))")
    ap.add_argument("--algorithms", default="gossip,dpsgd,group_average")
    ap.add_argument("--attacks", default="alone,scale,sign_flip,replay,eclipse")
    ap.add_argument("--defences-only", action="store_true", help="skip the runs with the defences off")
    ap.add_argument("--no-follow", action="store_true", help="refuse far models even from most live senders")
    ap.add_argument(
        "--set", action="append", default=[], help="a config override for every run, e.g. gossip.merge_bound=1"
    )
    ap.add_argument("--lockout", type=int, metavar="SLOTS", help="only the connection lock-out, with SLOTS slots")
    ap.add_argument("--old-cap", action="store_true", help="--lockout with 64 per address, as before")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    if args.lockout:
        asyncio.run(lockout(args.lockout, args.old_cap))
        return
    a, b = args.attack_rounds, args.attack_rounds + args.after
    print(
        f"{args.honest} honest peers + {args.attackers} attacker(s), attack for {a} rounds, then {args.after} "
        "without; acc = honest peers' mean accuracy, norm = norm of the honest mean model / the no-attack run's, "
        "dist = ||honest mean - no-attack honest mean|| / ||no-attack honest mean||\n"
    )
    head = (
        f"| algorithm | attack | defences | acc @{a} | acc @{b} | norm @{a} | norm @{b} | dist @{a} | dist @{b} "
        "| max abs @{a} | notes |"
    )
    print(head.replace("@{a}", f"@{a}"))
    print("|" + "---|" * 11)
    for alg in args.algorithms.split(","):
        t0 = time.perf_counter()
        ref = run(args, alg, "none", True, None)
        n0 = {r: float(ref["means"][r].norm()) for r in (a, b)}
        print(
            f"| {alg} | none | on | {ref[f'acc{a}']:.3f} | {ref[f'acc{b}']:.3f} | 1.00 | 1.00 | 0 | 0 "
            f"| {ref[f'max_abs{a}']:.3g} | {time.perf_counter() - t0:.0f} s |",
            flush=True,
        )
        for attack in args.attacks.split(","):
            if attack in ("replay", "eclipse") and alg != "gossip":
                continue
            for defences in (True, False) if attack in FORGED and not args.defences_only else (True,):
                res = run(args, alg, attack, defences, ref)
                notes = f"bounded {res['bounded']}"
                if attack == "replay":
                    notes = f"replays sent {res['sent']}, refused {res['replays_refused']}"
                if attack in RECOVERY:
                    notes += (
                        f"; spread {res[f'spread{a}'] / n0[a]:.3f}, {res[f'spread{b}'] / n0[b]:.3f} "
                        f"(none: {ref[f'spread{a}'] / n0[a]:.3f}, {ref[f'spread{b}'] / n0[b]:.3f}); "
                        f"followed {res['followed']}"
                    )
                if attack == "eclipse":
                    notes = (
                        f"longest run without a merge {res['gap']} rounds; made-up entries at most "
                        f"{res['fake_view']} in a view, {res['fake_dir']} in a directory, {res['fake_dir_end']} at the end; "
                        f"{res['fake_hist']} in a history sample, {res['fake_hist_end']} at the end; mean made-up share during the attack: views "
                        f"{res['view_share']:.3f}, history samples {res['hist_share']:.3f}; merges {res['merges']} "
                        f"(none: {ref['merges']})"
                    )
                print(
                    f"| {alg} | {attack} | {'on' if defences else 'off'} | {res[f'acc{a}']:.3f} | {res[f'acc{b}']:.3f} "
                    f"| {res[f'norm{a}'] / n0[a]:.2f} | {res[f'norm{b}'] / n0[b]:.2f} | {res[f'dist{a}']:.2f} "
                    f"| {res[f'dist{b}']:.2f} | {res[f'max_abs{a}']:.3g} | {notes} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
