"""One secure aggregation moved entirely in memory: the transport the simulator, the
gossip-group helper, the tests and bench/secagg.py share.

It only moves messages between :class:`SecAggClient` objects and a
:class:`SecAggServer` (the protocol lives in :mod:`secagg`), drops the clients it is
told to drop at the stage it is told, and measures each party's seconds and bytes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from . import crypto as C
from . import identity as ID
from .protocol import SecAggClient, SecAggParams
from .server import SecAggResult, SecAggServer

STAGES = ("advertise", "share", "masked", "unmask")


def injected_dropouts(ids: list[str], rates: list[float], draws: np.ndarray) -> dict[str, str]:
    """Which party drops at which stage, for simulations: at each stage it is still in,
    a party drops with that stage's rate (``rates`` and the columns of ``draws``, uniform
    [0, 1) numbers of shape (len(ids), len(STAGES)), follow STAGES)."""
    out = {}
    for pid, row in zip(ids, draws):
        for stage, rate, u in zip(STAGES, rates, row):
            if u < rate:
                out[pid] = stage
                break
    return out


@dataclass
class SecAggCost:
    """Measured cost of one aggregation: CPU seconds of each party's protocol work
    (process time, so other load on a shared machine does not inflate it) and
    payload bytes."""

    server_s: float = 0.0
    client_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # client -> server
    received: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # server -> client


def client_randomness(seed: int | None, client_id: str) -> C.Randomness:
    """Per-client randomness: reproducible from (seed, id) in simulation, else the OS's."""
    return C.Randomness() if seed is None else C.Randomness(f"{seed}/{client_id}".encode())


def run_in_memory(
    params: SecAggParams,
    inputs: dict[str, np.ndarray],
    drop_at: dict[str, str] | None = None,
    seed: int | None = None,
    identities: dict[str, bytes] | None = None,
) -> tuple[SecAggResult, SecAggCost]:
    """Run all four stages over ``inputs`` (client id -> encoded uint32 vector).

    ``drop_at`` maps a client to the stage (one of STAGES) whose message it never
    sends; it sends nothing afterwards either. Raises SecAggAborted like the server.
    With ``params.malicious`` the clients sign with ``identities`` (client id -> Ed25519
    private key; made from ``seed`` when None) and the consistency round runs before the
    unmasking (a client dropping at "unmask" does not sign either).
    """
    drop_at = drop_at or {}
    for cid, stage in drop_at.items():
        if stage not in STAGES:
            raise ValueError(f"drop stage {stage!r} of {cid!r} is not one of {STAGES}")
    cost = SecAggCost()
    ids = sorted(inputs)
    server = SecAggServer(params, ids)

    def alive(cid: str, stage: str) -> bool:
        return cid not in drop_at or STAGES.index(drop_at[cid]) > STAGES.index(stage)

    def on_client(cid, fn, *args):
        t = time.process_time()
        out = fn(*args)
        cost.client_s[cid] += time.process_time() - t
        cost.sent[cid] += out.nbytes
        return out

    def on_server(fn, *args):
        t = time.process_time()
        out = fn(*args)
        cost.server_s += time.process_time() - t
        return out

    def deliver(messages: dict) -> dict:
        for cid, m in messages.items():
            cost.received[cid] += m.nbytes
        return messages

    t = time.process_time()
    if params.malicious and identities is None:
        identities = {cid: ID.new_identity(client_randomness(seed, f"{cid}/identity").bytes(32)) for cid in ids}
    keys = identities or {}
    roster = {cid: ID.identity_public(k) for cid, k in keys.items()}
    clients = {
        cid: SecAggClient(cid, params, client_randomness(seed, cid), *((keys[cid], roster) if params.malicious else ()))
        for cid in ids
    }
    keygen_s = (time.process_time() - t) / max(len(ids), 1)
    for cid in ids:
        cost.client_s[cid] += keygen_s
        if alive(cid, "advertise"):
            on_server(server.receive_keys, on_client(cid, clients[cid].advertise_keys))
    directories = deliver(on_server(server.close_advertise))
    for cid, d in directories.items():
        if alive(cid, "share"):
            on_server(server.receive_shares, on_client(cid, clients[cid].share_keys, d))
    deliveries = deliver(on_server(server.close_share))
    for cid, d in deliveries.items():
        if alive(cid, "masked"):
            on_server(server.receive_masked, on_client(cid, clients[cid].masked_input, d, inputs[cid]))
    requests = deliver(on_server(server.close_masked))
    if params.malicious:
        for cid, r in requests.items():
            if alive(cid, "unmask"):
                on_server(server.receive_consistency, on_client(cid, clients[cid].consistency_check, r))
        requests = deliver(on_server(server.close_consistency))
    for cid, r in requests.items():
        if alive(cid, "unmask"):
            on_server(server.receive_unmask, on_client(cid, clients[cid].unmask, r))
    result = on_server(server.finish)
    return result, cost
