"""TLS for the server, client nodes and gossip peers.

Services speak HTTPS by default; plain HTTP needs an explicit ``--insecure``. For a
private deployment (or a test) :func:`make_private_ca` writes a small CA and a server
certificate for the given host names and IP addresses (shoal/pki.py, `shoal pki`); clients
then trust that CA with ``--ca-cert``.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError
from .pki import issue_server_cert, make_ca


def _need(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file {str(p)!r} not found")
    return str(p)


def server_context(cert: str | Path, key: str | Path, client_ca: str | Path | None = None) -> ssl.SSLContext:
    """A TLS >= 1.2 server context from a PEM certificate chain and its key. With
    ``client_ca`` it asks clients for a certificate of that CA (optional: token nodes send
    none); a certificate of another CA fails the handshake."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(_need(cert, "tls.cert"), _need(key, "tls.key"))
    except ssl.SSLError as e:
        raise ConfigError(f"tls.cert / tls.key could not be loaded: {e}") from None
    if client_ca:
        try:
            ctx.load_verify_locations(cafile=_need(client_ca, "server.tls_client_ca"))
        except ssl.SSLError as e:
            raise ConfigError(f"server.tls_client_ca {str(client_ca)!r} is not a PEM CA certificate: {e}") from None
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def client_context(
    ca_cert: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None
) -> ssl.SSLContext:
    """Verifying client context: the system's trust store, or only ``ca_cert`` if given;
    with ``cert`` and ``key`` (`shoal pki`) it proves the node's identity to the server."""
    cafile = _need(ca_cert, "--ca-cert") if ca_cert else None
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if bool(cert) != bool(key):
        raise ConfigError("--cert and --key go together: the node's certificate and its private key")
    if cert and key:
        try:
            ctx.load_cert_chain(_need(cert, "--cert"), _need(key, "--key"))
        except ssl.SSLError as e:
            raise ConfigError(f"--cert / --key could not be loaded (is --key the key of --cert?): {e}") from None
    return ctx


@dataclass(frozen=True)
class PrivatePKI:
    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path


def make_private_ca(
    out_dir: str | Path,
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    days: int = 365,
    name: str = "shoal private CA",
) -> PrivatePKI:
    """Write ca.pem/ca.key and server.pem/server.key (ECDSA P-256) valid for ``hosts``
    (what `shoal pki ca` and `shoal pki server-cert` make, in one call for tests)."""
    ca_cert, ca_key = make_ca(out_dir, name, days)
    cert, key = issue_server_cert(out_dir, list(hosts), out_dir, days)
    return PrivatePKI(ca_cert, ca_key, cert, key)
