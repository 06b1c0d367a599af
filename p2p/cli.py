"""`shoal peer`: start one gossip peer from the command line, with the user's task.

The peer's model comes from the task (``--task`` / ``[task] app``, else the built-in task
of ``[model]`` + ``[data]``), initialised from ``simulation.seed`` through shoal.assembly,
so every peer of a network starts from the same model. Its data:

- ``--data PATH``: ``task.local_data(PATH)``, the peer's own training data and optional
  test data, in whatever format the task reads (for the built-in task: a shard file of
  ``shoal data split``);
- ``--data client:<i>`` (a simulation convenience): client ``i`` of
  ``task.simulation_data(simulation.num_clients, simulation.seed)``, its own test data
  if the split gives per-client test sets, and the split's central test set if any.

The deployed peer never imports shoal.simulations: the few lines that pick one client of
a split live here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import overload

import torch
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from shoal import assembly
from shoal.assembly import task_from_config
from shoal.client.device import select_device
from shoal.config import Config
from shoal.config.rules import check_gossip_settings
from shoal.errors import ConfigError, DataError, Malformed
from shoal.log_redaction import add_secret
from shoal.privacy_plan import plan_of
from shoal.signals import on_stop_signals
from shoal.task import (
    ClientData,
    LocalData,
    SimulationData,
    Task,
    TaskError,
    as_tensors,
    call_part,
    check_data,
    num_examples,
    task_name,
)
from shoal.tls import client_context, server_context

from .addresses import check_url
from .peer import Peer, PeerData, PeerSettings
from .robust import robust_mixing

log = logging.getLogger(__name__)


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9000")
    return host or "0.0.0.0", int(port)


@overload
def _on_device(data: ClientData, device: torch.device) -> ClientData: ...
@overload
def _on_device(data: None, device: torch.device) -> None: ...
@overload
def _on_device(data: ClientData | None, device: torch.device) -> ClientData | None: ...
def _on_device(data: ClientData | None, device: torch.device) -> ClientData | None:
    """Tensor data moved to the device once (the trainer slices it there); Datasets as they are."""
    pair = as_tensors(data) if data is not None else None
    return (pair[0].to(device), pair[1].to(device)) if pair is not None else data


def _local_data(task: Task, path: Path) -> PeerData:
    fix = (
        f"--data {str(path)!r} does not exist"
        if not path.exists()
        else f"check that --data {str(path)!r} holds the data local_data() reads"
    )
    local = call_part(task, f"local_data({str(path)!r})", task.local_data, path, fix=fix)
    if not isinstance(local, LocalData):
        raise TaskError(
            f"task {task_name(task)}: local_data() returned a {type(local).__name__}; "
            "return shoal.task.LocalData(train=..., test=None)"
        )
    train = check_data(task, local.train, "local_data().train")
    test = check_data(task, local.test, "local_data().test", allow_none=True)
    return PeerData(train, test)  # type: ignore[arg-type]


def _simulation_client(task: Task, spec: str, index: str, cfg: Config) -> PeerData:
    """Client ``index`` of the task's simulation split: every peer with the same config derives
    the same split and keeps only its own part."""
    if not index.isdigit():
        raise DataError(
            f"--data {spec!r}: expected client:<index> (a client of the task's simulation split) "
            "or a path the task's local_data() reads"
        )
    sim = cfg.simulation
    split = call_part(
        task,
        "simulation_data(num_clients, seed)",
        task.simulation_data,
        sim.num_clients,
        sim.seed,
        fix="--data client:<i> needs simulation_data(); give the peer its own data with --data PATH",
    )
    if not isinstance(split, SimulationData):
        raise TaskError(
            f"task {task_name(task)}: simulation_data() returned a {type(split).__name__}; "
            "return shoal.task.SimulationData(train=[one dataset per client], test=...)"
        )
    i, n = int(index), len(split.train)
    if i >= n:
        raise DataError(f"--data {spec!r}: the split has {n} clients (0..{n - 1})")
    train = check_data(task, split.train[i], f"simulation_data().train[{i}]")
    own = None
    if split.client_test is not None:
        if len(split.client_test) != n:
            raise TaskError(
                f"task {task_name(task)}: client_test has {len(split.client_test)} entries for "
                f"{n} clients; give one (or None) per client"
            )
        own = check_data(task, split.client_test[i], f"simulation_data().client_test[{i}]", allow_none=True)
    central = check_data(task, split.test, "simulation_data().test", allow_none=True)
    return PeerData(train, own, central)  # type: ignore[arg-type]


def load_peer_data(spec: str, cfg: Config, task: Task, device: torch.device) -> PeerData:
    """``--data`` -> the peer's training data, its own test data and (client:<i>) the central test set."""
    kind, sep, index = spec.partition(":")
    if kind == "client" and sep:
        data = _simulation_client(task, spec, index, cfg)
    else:
        data = _local_data(task, Path(spec).expanduser())
    if num_examples(data.train) == 0:
        raise DataError(f"--data {spec!r}: task {task_name(task)} gave no training examples")
    return PeerData(
        _on_device(data.train, device),
        _on_device(data.test, device),
        _on_device(data.central_test, device),
    )


def _peer_url(text: str, flag: str, insecure: bool) -> str:
    """A peer address from the command line in the canonical form the other peers will see
    (p2p/addresses.py), or a ConfigError naming the flag."""
    try:
        return check_url(text.strip(), insecure)
    except Malformed as e:
        raise ConfigError(f"{flag} {text.strip()[:100]!r}: {e}") from None


def is_peer_certificate(path: Path) -> bool:
    """Whether the PEM certificate at ``path`` is good for TLS clients too (``shoal pki peer-cert``):
    then the peer presents it when it calls others and binds every caller's messages to theirs."""
    try:
        cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return False
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tls-cert {str(path)!r} is not a PEM certificate: {e}") from None
    return ExtendedKeyUsageOID.CLIENT_AUTH in usage


def check_peer_algorithm(cfg: Config) -> None:
    """What a real peer runs: every algorithm, D-PSGD with plain mixing."""
    g = cfg.gossip
    if g.algorithm == "dpsgd" and robust_mixing(cfg):
        raise ConfigError(
            "[robust] mixing with gossip.algorithm = 'dpsgd' runs in the simulator only; a peer "
            "mixes its neighbours' models plainly: set robust.rule = 'mean' and robust.norm_bound = 0"
        )


def check_peer_privacy(cfg: Config) -> None:
    """A peer has no server to add central or distributed noise: only local DP (DP-SGD on the
    peer's own data, its own epsilon) runs; refuse the others rather than run without the claimed noise."""
    plan = plan_of(cfg)
    if plan.enabled and not plan.dp_sgd:
        raise ConfigError(
            f"privacy.mode = {cfg.privacy.mode!r}: a gossip peer has no server to add central or distributed "
            "noise; use privacy.mode = 'local' (DP-SGD on each peer's own data, per-peer epsilon) or 'none'"
        )


def run_peer(
    cfg: Config,
    listen: str,
    bootstrap: str,
    data: str,
    token: str | None,
    advertise: str | None,
    tls_cert: Path | None,
    tls_key: Path | None,
    ca_cert: Path | None,
    insecure: bool,
    out: Path | None,
) -> None:
    host, port = parse_listen(listen)
    check_gossip_settings(cfg)
    check_peer_algorithm(cfg)
    check_peer_privacy(cfg)
    token = token if token is not None else os.environ.get("SHOAL_TOKEN", "")
    add_secret(token)  # no log line shows it (shoal/log_redaction.py)
    certified = False
    if insecure:
        log.warning("--insecure: plain HTTP, models and the network token travel unencrypted")
        ssl_server = ssl_client = None
    else:
        if not (tls_cert and tls_key):
            raise ConfigError("HTTPS needs --tls-cert and --tls-key (or pass --insecure explicitly for plain HTTP)")
        certified = ca_cert is not None and is_peer_certificate(tls_cert)
        if certified:  # a peer certificate: presented as our client certificate, callers' bound to theirs
            ssl_server = server_context(tls_cert, tls_key, client_ca=ca_cert)
            ssl_client = client_context(ca_cert, tls_cert, tls_key)
        else:
            ssl_server, ssl_client = server_context(tls_cert, tls_key), client_context(ca_cert)
    if not token:
        log.warning("no network token (--token or SHOAL_TOKEN): any client can send this peer models")
    scheme = "http" if insecure else "https"
    me = _peer_url(
        advertise or f"{scheme}://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}", "--advertise", insecure
    )
    boot = tuple(
        dict.fromkeys(
            u for u in (_peer_url(b, "--bootstrap", insecure) for b in bootstrap.split(",") if b.strip()) if u != me
        )
    )
    device = select_device(cfg.train.device)
    task = task_from_config(cfg)
    peer_data = load_peer_data(data, cfg, task, device)
    # the model seeded by simulation.seed (the same start on every peer), its loss checked on this
    # peer's data; DP-SGD for privacy.mode = "local"
    trainer = assembly.build(cfg, task, "client", device=device, example=peer_data.train).trainer
    log.info(
        "task %s (spec hash %s): %d training examples, own test data %s, central test data %s",
        task_name(task),
        trainer.spec.hash,
        num_examples(peer_data.train),
        num_examples(peer_data.test) if peer_data.test is not None else "none",
        num_examples(peer_data.central_test) if peer_data.central_test is not None else "none",
    )
    peer = Peer(
        cfg, trainer, peer_data, PeerSettings(me, boot, token, insecure, ssl_server, ssl_client, out, certified)
    )

    async def main() -> None:
        stop = asyncio.Event()
        on_stop_signals(stop.set)
        await peer.run(host, port, stop)

    asyncio.run(main())
