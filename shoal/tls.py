"""TLS for the server, client nodes and gossip peers.

Services speak HTTPS by default; plain HTTP needs an explicit ``--insecure``. For a
private deployment (or a test) :func:`make_private_ca` writes a small CA and a server
certificate for the given host names and IP addresses; clients then trust that CA with
``--ca-cert``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import ConfigError


def _need(path: str | Path, what: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} file {str(p)!r} not found")
    return str(p)


def server_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A TLS >= 1.2 server context from a PEM certificate chain and its key."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(_need(cert, "tls.cert"), _need(key, "tls.key"))
    except ssl.SSLError as e:
        raise ConfigError(f"tls.cert / tls.key could not be loaded: {e}") from None
    return ctx


def client_context(ca_cert: str | Path | None = None) -> ssl.SSLContext:
    """Verifying client context: the system's trust store, or only ``ca_cert`` if given."""
    cafile = _need(ca_cert, "--ca-cert") if ca_cert else None
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@dataclass(frozen=True)
class PrivatePKI:
    ca_cert: Path
    ca_key: Path
    cert: Path
    key: Path


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def make_private_ca(
    out_dir: str | Path,
    hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
    days: int = 365,
    name: str = "shoal private CA",
) -> PrivatePKI:
    """Write ca.pem/ca.key and server.pem/server.key (ECDSA P-256) valid for ``hosts``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki = PrivatePKI(out / "ca.pem", out / "ca.key", out / "server.pem", out / "server.key")
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(ca_key, pki.ca_key)
    pki.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, pki.key)
    return pki
