"""`shoal peer`: start one gossip peer from the command line.

``--data client:<i>`` selects client ``i`` of the federated split that the config's
``[data]`` and ``[simulation]`` sections describe (``num_clients``, ``seed``): every
peer started with the same config derives the same split, and peer ``i`` trains only on
its own part. The peer reports accuracy on the split's global test set. (Shard files
written by the server engineer's tooling are not read yet.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import torch

from shoal.client.device import select_device
from shoal.client.training import LocalTrainer
from shoal.config import Config
from shoal.datasets import load_federated
from shoal.errors import ConfigError, DataError
from shoal.models import build_model
from shoal.tls import client_context, server_context

from .peer import Peer, PeerData, PeerSettings
from .robust import check_gossip_settings

log = logging.getLogger(__name__)


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9000")
    return host or "0.0.0.0", int(port)


def load_peer_data(spec: str, cfg: Config, device: torch.device) -> tuple[PeerData, tuple[int, ...], int]:
    """``client:<i>`` -> (that client's shard and the test set, input shape, classes)."""
    kind, _, index = spec.partition(":")
    if kind != "client" or not index.isdigit():
        raise DataError(f"--data {spec!r}: expected client:<index>, a client of the config's [data] split")
    data = load_federated(cfg.data, cfg.simulation.num_clients, cfg.simulation.seed)
    i = int(index)
    if i >= data.num_clients:
        raise DataError(f"--data {spec!r}: the split has {data.num_clients} clients (0..{data.num_clients - 1})")
    shard = data.client(i)
    pd = PeerData(shard.x.to(device), shard.y.to(device), data.test.x.to(device), data.test.y.to(device))
    return pd, data.input_shape, data.num_classes


def run_peer(cfg: Config, listen: str, bootstrap: str, data: str, token: str | None, advertise: str | None,
             tls_cert: Path | None, tls_key: Path | None, ca_cert: Path | None, insecure: bool,
             out: Path | None) -> None:
    host, port = parse_listen(listen)
    check_gossip_settings(cfg)
    token = token if token is not None else os.environ.get("SHOAL_TOKEN", "")
    if insecure:
        log.warning("--insecure: plain HTTP, models and the network token travel unencrypted")
        ssl_server = ssl_client = None
    else:
        if not (tls_cert and tls_key):
            raise ConfigError("HTTPS needs --tls-cert and --tls-key (or pass --insecure explicitly for plain HTTP)")
        ssl_server, ssl_client = server_context(tls_cert, tls_key), client_context(ca_cert)
    if not token:
        log.warning("no network token (--token or SHOAL_TOKEN): any client can send this peer models")
    scheme = "http" if insecure else "https"
    me = advertise or f"{scheme}://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    boot = tuple(b.strip().rstrip("/") for b in bootstrap.split(",") if b.strip() and b.strip().rstrip("/") != me)
    device = select_device(cfg.train.device)
    peer_data, shape, classes = load_peer_data(data, cfg, device)
    torch.manual_seed(cfg.simulation.seed)  # every peer starts from the same initial model
    trainer = LocalTrainer(build_model(cfg.model.name, shape, classes), cfg.train, device)
    peer = Peer(cfg, trainer, peer_data, PeerSettings(me, boot, token, insecure, ssl_server, ssl_client, out))

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await peer.run(host, port, stop)

    asyncio.run(main())
