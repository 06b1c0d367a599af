"""TLS for the server, client nodes and gossip peers.

Services speak HTTPS by default; plain HTTP needs an explicit ``--insecure``. For a
private deployment (or a test) :func:`make_private_ca` writes a small CA and a server
certificate for the given host names and IP addresses (shoal/pki.py, `shoal pki`); clients
then trust that CA with ``--ca-cert``.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509

from .errors import ConfigError
from .pki import issue_server_cert, make_ca, warn_if_shared


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
    warn_if_shared(key, "the server's TLS key")
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
        warn_if_shared(key, "this node's private key")
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


# --- one-line hints for a node that cannot talk to its server ----------------------------

_UNTRUSTED = {18, 19, 20, 21, 2}  # self-signed, unknown issuer, chain cannot be built
_MISMATCH = {62, 64}  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
_EXPIRED, _NOT_YET = 10, 9


def _unverified() -> ssl.SSLContext:
    """For looking only (what does the peer speak, which names does its certificate hold):
    nothing is sent over a connection made with it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


async def peer_certificate(url: str, timeout: float = 3.0) -> bytes | None:
    """The DER certificate the TLS server at ``url`` presents (unverified), None if none answers."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 443
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port, ssl=_unverified(), server_hostname=host or None)
    except (OSError, ssl.SSLError, TimeoutError):
        return None
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        return ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    finally:
        writer.close()


async def speaks_tls(url: str, timeout: float = 3.0) -> bool:
    """Whether the server at ``url``'s host and port completes a TLS handshake (an https server
    that a node was told to reach with http://)."""
    return await peer_certificate(url.replace("http://", "https://", 1), timeout) is not None


async def certificate_problem(
    url: str, error: BaseException, who: str = "node", url_option: str = "--server", ca_option: str = "--ca-cert"
) -> str:
    """One line on why the server's certificate was refused, and the fix; ``who`` dials ``url`` (given
    in ``url_option``) and trusts the CA given in ``ca_option`` (an edge: hierarchy.parent_ca_cert)."""
    code = getattr(error, "verify_code", None)
    what = getattr(error, "verify_message", None) or str(error)
    host = urlsplit(url).hostname or url
    if code in _MISMATCH:
        der = await peer_certificate(url)
        names: list[str] = []
        common = ""
        if der is not None:
            cert = x509.load_der_x509_certificate(der)
            try:
                san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
                names = [*san.get_values_for_type(x509.DNSName), *map(str, san.get_values_for_type(x509.IPAddress))]
            except x509.ExtensionNotFound:
                pass
            cns = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
            common = str(cns[0].value) if cns else ""
        if der is not None and not names:
            return (
                f"the server's certificate has no subjectAltName (it names {common!r} only as its common name, "
                f"which TLS clients ignore), so it is valid for no host: make one with "
                f"`shoal pki server-cert --ca-dir CA_DIR --host {host}`"
            )
        valid = f"is for {', '.join(names)}" if names else "does not name it"
        return (
            f"the server's certificate {valid}, not {host!r} (the host in {url_option}): dial one of its names, "
            f"or give the server a certificate for it (`shoal pki server-cert --host {host}`)"
        )
    if code in _UNTRUSTED:
        return (
            f"the server's certificate is not signed by a CA this {who} trusts ({what}): give the federation's "
            f"ca.pem with {ca_option} (a private CA is not in the system's trust store)"
        )
    if code == _EXPIRED:
        return f"the server's certificate has expired ({what}): the operator makes a new one (`shoal pki server-cert`)"
    if code == _NOT_YET:
        return f"the server's certificate is not valid yet ({what}): check this machine's clock"
    return f"the server's TLS certificate is refused: {what}"
