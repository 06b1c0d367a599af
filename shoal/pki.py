"""A federation's private PKI, without openssl: `shoal pki` (docs/deploy.md, "Provisioning").

Three things, each made where its private key stays:

* the **CA** (on the operator's machine): ``ca.pem`` (give it to every node) and ``ca.key``;
* the **server's certificate** for the host names and IP addresses nodes dial, with every one
  of them in its subjectAltName (what TLS clients check; a certificate naming its host only
  in the common name is refused by Python, browsers and curl alike);
* a **node's key** (on the node): ``NAME.key`` never leaves the node; ``NAME.csr`` (public)
  goes to the operator, who registers its public key on the server and signs it with the CA
  (`shoal server nodes add NAME --csr NAME.csr --ca-dir DIR`). The node then authenticates
  with TLS client certificates: nothing secret travels, and the server maps the certificate's
  public key (its SHA-256 fingerprint, in the node registry) to the node, so revoking a node
  in the registry locks it out at once, without certificate revocation lists.

Keys are ECDSA P-256 (what every TLS stack speaks). Private keys are written with mode 0600
and never overwritten: making a new CA or node key is a deliberate act (remove the old file).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import ConfigError
from .log_redaction import add_secret

log = logging.getLogger(__name__)

CA_CERT, CA_KEY = "ca.pem", "ca.key"
SERVER_CERT, SERVER_KEY = "server.pem", "server.key"
MAX_DAYS = 3650
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
_NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True)
class NodeKey:
    """What `shoal pki node-key` wrote: the private key (stays), the request (goes to the operator)."""

    key: Path
    csr: Path
    fingerprint: str


def fingerprint(of: CertificatePublicKeyTypes | x509.Certificate | x509.CertificateSigningRequest) -> str:
    """``sha256:<hex>`` of the DER SubjectPublicKeyInfo: a node's identity in the registry."""
    key = of.public_key() if isinstance(of, (x509.Certificate, x509.CertificateSigningRequest)) else of
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return "sha256:" + hashlib.sha256(der).hexdigest()


def write_secret(path: Path, data: bytes) -> None:
    """Write a private file with mode 0600 from its first byte; refuse to replace one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path} exists: a private key is made once; remove it to make a new one") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def warn_if_shared(path: str | Path, what: str) -> None:
    """One warning when a file holding a secret (a private key, a token) can be read by other
    users of this machine: whoever reads it is that node, that server or that admin."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return  # a missing file is its reader's error to report
    if mode & 0o077:
        log.warning("%s %s is readable by other users (mode %o): chmod 600 %s", what, path, mode, path)


def read_secret(path: str | Path, what: str) -> str:
    """The stripped text of a token file (ConfigError naming ``what`` if it cannot be read),
    after :func:`warn_if_shared`."""
    warn_if_shared(path, what)
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {e}") from None
    for word in text.split():  # a token file, or "name token" lines: no log line shows the tokens
        if len(word) >= 20:
            add_secret(word)
    return text


def _write_public(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _check_days(days: int) -> None:
    if not 1 <= days <= MAX_DAYS:
        raise ConfigError(f"--days {days}: a certificate's validity must be 1 to {MAX_DAYS} days")


def check_node_name(name: str) -> str:
    """A node name as the registry takes it (1-128 letters, digits, '-', '_' or '.')."""
    if not _NODE_NAME.fullmatch(name):
        raise ConfigError(f"node name {name!r}: use 1-128 letters, digits, '-', '_' or '.'")
    return name


def subject_alt_name(host: str) -> x509.GeneralName:
    """The subjectAltName entry for a host nodes dial: an IP address or a DNS name
    (``*.example.org`` allowed); anything else is a ConfigError naming the fix."""
    h = host.strip()
    if not h:
        raise ConfigError("--host '': give the host name or IP address that nodes put in --server")
    if "://" in h or "/" in h:
        raise ConfigError(f"--host {host!r}: give the bare host (e.g. example.org or 10.0.0.5), not a URL")
    try:
        return x509.IPAddress(ipaddress.ip_address(h.strip("[]")))
    except ValueError:
        pass
    if ":" in h:
        raise ConfigError(f"--host {host!r}: give the host without a port (the certificate holds any port)")
    labels = h.rstrip(".").split(".")
    if labels[0] == "*":
        labels = labels[1:]
        if len(labels) < 2:
            raise ConfigError(f"--host {host!r}: a wildcard needs at least two labels after '*.'")
    if not labels or len(h) > 253 or not all(_DNS_LABEL.fullmatch(x) for x in labels):
        raise ConfigError(
            f"--host {host!r} is neither an IP address nor a DNS name (letters, digits and '-' in dot-separated labels)"
        )
    return x509.DNSName(h.rstrip(".").lower())


def make_ca(out_dir: str | Path, name: str = "shoal private CA", days: int = MAX_DAYS) -> tuple[Path, Path]:
    """Write ``ca.pem`` and ``ca.key`` (0600) in ``out_dir``; refuses to replace an existing CA key."""
    _check_days(days)
    if not name.strip():
        raise ConfigError("--name '': give the CA a name (it appears as the issuer of every certificate)")
    out = Path(out_dir)
    cert_path, key_path = out / CA_CERT, out / CA_KEY
    if key_path.exists():
        raise ConfigError(
            f"{key_path} exists: this folder already holds a CA (every certificate it signed trusts it); "
            "remove it first to make a new one"
        )
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
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
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_secret(key_path, _key_pem(key))
    _write_public(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def load_ca(ca_dir: str | Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA of ``ca_dir`` (ca.pem + ca.key), checked to be a CA whose key matches its certificate."""
    d = Path(ca_dir)
    cert_path, key_path = d / CA_CERT, d / CA_KEY
    for p in (cert_path, key_path):
        if not p.is_file():
            raise ConfigError(f"--ca-dir {str(d)!r}: {p.name} not found (make a CA with `shoal pki ca --out {d}`)")
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--ca-dir {str(d)!r}: ca.pem / ca.key cannot be read as PEM ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or fingerprint(key.public_key()) != fingerprint(cert):
        raise ConfigError(f"--ca-dir {str(d)!r}: ca.key is not the key of ca.pem")
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise ConfigError(f"--ca-dir {str(d)!r}: ca.pem is not a CA certificate")
    return cert, key


def _issue(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    subject: str,
    public_key: ec.EllipticCurvePublicKey,
    days: int,
    usage: x509.ObjectIdentifier | list[x509.ObjectIdentifier],
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    ca_cert, ca_key = ca
    now = dt.datetime.now(dt.UTC)
    end = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)  # never outlive the CA
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage if isinstance(usage, list) else [usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def issue_server_cert(
    ca_dir: str | Path,
    hosts: list[str] | tuple[str, ...],
    out_dir: str | Path,
    days: int = 825,
    name: str = "server",
    client_auth: bool = False,
) -> tuple[Path, Path]:
    """Write ``NAME.pem`` (the certificate, then the CA's: a full chain) and ``NAME.key`` (0600)
    for ``hosts``, every one in the subjectAltName. ``client_auth``: good as a TLS client
    certificate too (a gossip peer's, which serves and calls with one certificate)."""
    _check_days(days)
    if not hosts:
        raise ConfigError("--host is needed: every host name and IP address nodes dial (repeat --host)")
    sans = [subject_alt_name(h) for h in hosts]
    ca = load_ca(ca_dir)
    out = Path(out_dir)
    cert_path, key_path = (
        (out / SERVER_CERT, out / SERVER_KEY) if name == "server" else (out / f"{name}.pem", out / f"{name}.key")
    )
    key = ec.generate_private_key(ec.SECP256R1())
    write_secret(key_path, _key_pem(key))
    usage = [ExtendedKeyUsageOID.SERVER_AUTH] + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client_auth else [])
    cert = _issue(ca, hosts[0].strip(), key.public_key(), days, usage, sans)
    _write_public(
        cert_path, cert.public_bytes(serialization.Encoding.PEM) + ca[0].public_bytes(serialization.Encoding.PEM)
    )
    return cert_path, key_path


def make_node_key(out_dir: str | Path, name: str) -> NodeKey:
    """On the node: ``NAME.key`` (0600, stays here) and ``NAME.csr`` (for the operator)."""
    check_node_name(name)
    out = Path(out_dir)
    key_path, csr_path = out / f"{name}.key", out / f"{name}.csr"
    key = ec.generate_private_key(ec.SECP256R1())
    write_secret(key_path, _key_pem(key))
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .sign(key, hashes.SHA256())
    )
    _write_public(csr_path, csr.public_bytes(serialization.Encoding.PEM))
    return NodeKey(key_path, csr_path, fingerprint(key.public_key()))


def read_node_csr(path: str | Path, name: str) -> x509.CertificateSigningRequest:
    """A node's certificate request, checked: PEM, self-signed by its key, an EC P-256 key,
    and made for ``name`` (its common name)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--csr {str(p)!r} not found (the node makes it with `shoal pki node-key`)")
    try:
        csr = x509.load_pem_x509_csr(p.read_bytes())
    except ValueError as e:
        raise ConfigError(f"--csr {str(p)!r} is not a PEM certificate request: {e}") from None
    try:
        valid = csr.is_signature_valid
    except (InvalidSignature, ValueError):
        valid = False
    if not valid:
        raise ConfigError(f"--csr {str(p)!r}: its signature does not verify (damaged, or not made by its key)")
    key = csr.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp256r1":
        raise ConfigError(f"--csr {str(p)!r}: the key must be ECDSA P-256 (make it with `shoal pki node-key`)")
    names = [a.value for a in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names != [name]:
        raise ConfigError(
            f"--csr {str(p)!r} was made for node {names[0] if names else None!r}, not {name!r}: "
            "register it under the name it was made for, or make a new key with that name"
        )
    return csr


def sign_node(
    ca_dir: str | Path, csr: x509.CertificateSigningRequest, name: str, out: str | Path, days: int = 825
) -> Path:
    """The node's client certificate (public: it is useless without the node's key)."""
    _check_days(days)
    public = csr.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)  # read_node_csr checked it
    cert = _issue(load_ca(ca_dir), name, public, days, ExtendedKeyUsageOID.CLIENT_AUTH)
    path = Path(out)
    _write_public(path, cert.public_bytes(serialization.Encoding.PEM))
    return path


@dataclass(frozen=True)
class Renewed:
    """What `shoal pki renew` wrote: the certificate, and the new key when it was rotated."""

    cert: Path
    key: Path | None
    kind: str  # "server" or "node"
    sans: list[str]
    not_after: dt.datetime


def replace_atomically(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` through a new file of ``mode`` (0600 for a key) and a rename:
    a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _san_text(name: x509.GeneralName) -> str:
    return str(name.value)


def renew_cert(
    ca_dir: str | Path,
    cert: str | Path,
    out: str | Path | None = None,
    days: int = 825,
    hosts: list[str] | None = None,
    rotate_key: Path | None = None,
) -> Renewed:
    """Re-issue the server's or a node's certificate ``cert`` from the CA that issued it: the same
    subject, usage and subjectAltName (``hosts`` replaces the server's), valid ``days`` from now
    (never past the CA). The public key is kept (a node's registry entry still matches), unless
    ``rotate_key`` names the server's key file: a new key replaces it (0600). Written atomically
    to ``out`` (default: over ``cert``); a server certificate is followed by the CA's, as
    :func:`issue_server_cert` writes it."""
    _check_days(days)
    path = Path(cert)
    try:
        old = x509.load_pem_x509_certificates(path.read_bytes())[0]
    except (OSError, ValueError, IndexError) as e:
        raise ConfigError(f"--cert {str(path)!r} cannot be read as a PEM certificate: {e}") from None
    ca = load_ca(ca_dir)
    try:
        old.verify_directly_issued_by(ca[0])
    except (ValueError, TypeError, InvalidSignature):
        raise ConfigError(
            f"--cert {str(path)!r} was not issued by the CA of --ca-dir {str(ca_dir)!r}: renew it with the CA that "
            "signed it (or issue a new one: `shoal pki server-cert`, `shoal server nodes add --csr`)"
        ) from None
    try:
        usage = old.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usage = x509.ExtendedKeyUsage([])
    oid: x509.ObjectIdentifier | list[x509.ObjectIdentifier]
    if ExtendedKeyUsageOID.SERVER_AUTH in usage and ExtendedKeyUsageOID.CLIENT_AUTH in usage:  # a peer's
        kind, oid = "server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    elif ExtendedKeyUsageOID.SERVER_AUTH in usage:
        kind, oid = "server", ExtendedKeyUsageOID.SERVER_AUTH
    elif ExtendedKeyUsageOID.CLIENT_AUTH in usage:
        kind, oid = "node", ExtendedKeyUsageOID.CLIENT_AUTH
    else:
        raise ConfigError(f"--cert {str(path)!r} is neither a server nor a node certificate (extended key usage)")
    try:
        sans = list(old.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        sans = []
    if hosts:
        if kind == "node":
            raise ConfigError("--host is for a server certificate; a node's certificate names the node, not hosts")
        sans = [subject_alt_name(h) for h in hosts]
    names = [a.value for a in old.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    subject = str(names[0]) if names else (_san_text(sans[0]) if sans else "")
    if not subject:
        raise ConfigError(f"--cert {str(path)!r} has no common name to renew")
    public = old.public_key()
    new_key: ec.EllipticCurvePrivateKey | None = None
    if rotate_key is not None:
        if kind == "node":
            raise ConfigError(
                "--rotate-key: a node's private key never leaves the node; it makes a new one with "
                "`shoal pki node-key` and the operator enrolls it again (`shoal server nodes add --csr`)"
            )
        new_key = ec.generate_private_key(ec.SECP256R1())
        public = new_key.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise ConfigError(f"--cert {str(path)!r}: its key is not an EC key (shoal pki issues ECDSA P-256)")
    issued = _issue(ca, subject, public, days, oid, sans or None)
    pem = issued.public_bytes(serialization.Encoding.PEM)
    if kind == "server":
        pem += ca[0].public_bytes(serialization.Encoding.PEM)
    target = Path(out) if out is not None else path
    if new_key is not None and rotate_key is not None:  # the key first: a new certificate never names a missing key
        replace_atomically(rotate_key, _key_pem(new_key), 0o600)
    replace_atomically(target, pem, 0o644)
    return Renewed(target, rotate_key, kind, [_san_text(n) for n in sans], issued.not_valid_after_utc)


def peer_fingerprint(der: bytes | None) -> str | None:
    """The registry fingerprint of a TLS peer's certificate (DER), None without one."""
    if not der:
        return None
    try:
        return fingerprint(x509.load_der_x509_certificate(der))
    except ValueError:
        return None
