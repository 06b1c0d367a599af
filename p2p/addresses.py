"""Peer addresses: the one URL check every address a peer reads goes through, and the
policy that decides which addresses a peer may contact (sans-I/O: time is passed in).

A peer's identity is its URL, and peers tell each other URLs (shuffle entries, senders,
group member lists), so every URL from the network is hostile until :func:`check_url`
says otherwise: ``https`` only (``http`` only with ``--insecure``), no userinfo, no path
beyond ``/``, no query or fragment, a port in 1..65535, and a host that is an IP literal
or a DNS name of ASCII letters, digits and hyphens (IDNA names are taken in their ``xn--``
form), each label 1..63 characters, 253 at most in all. It raises Malformed, never
anything else, whatever the text.

:class:`AddressPolicy` is what a peer may contact, beyond what is well formed:

- only addresses of the kinds its bootstrap and advertised addresses are (loopback,
  private, global IPs, DNS names), unless ``gossip.allow_networks`` (CIDRs) lists them;
- never link-local or cloud metadata addresses, unspecified, multicast, documentation
  ranges or special-use names (``.invalid``, ``.test``, ``.example``, ``.local``), unless
  allowed by ``gossip.allow_networks``;
- addresses it has only heard of (second hand) are unverified until contacted
  successfully, and new ones are contacted at most ``burst`` at once, then one per
  ``interval`` seconds (a token bucket), so a flood of forged entries cannot turn the
  peer into a scanner.

A DNS name is checked as a name here; the transport checks what it resolves to with
:meth:`AddressPolicy.resolved_ok` (p2p/peer.py's resolver drops forbidden addresses, so a name
that points at a metadata or link-local address is never connected to).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from shoal.errors import Malformed

MAX_URL_CHARS = 256
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_SPECIAL_TLDS = frozenset({"invalid", "test", "example", "local", "onion"})
_METADATA = (ipaddress.ip_network("169.254.169.254/32"), ipaddress.ip_network("fd00:ec2::254/128"))
_DOCUMENTATION = tuple(
    ipaddress.ip_network(n)
    for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32", "100.64.0.0/10", "240.0.0.0/4")
)
KINDS = ("loopback", "private", "global", "name")


def _host(host: str) -> str:
    """A validated, lower-case host: an IP literal or an ASCII (IDNA ``xn--``) DNS name."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
        except ValueError:
            raise Malformed(f"host {host[:80]!r} is not an IPv6 address") from None
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    if not host.isascii():
        try:  # a name in Unicode: its IDNA form, each label checked below (the codec's limits raise UnicodeError)
            host = host.encode("idna").decode("ascii")
        except (UnicodeError, ValueError):
            raise Malformed(f"host {host[:80]!r} is not a valid internationalized name") from None
    name = host.lower().rstrip(".")
    if not name or len(name) > 253:
        raise Malformed(f"host name of {len(name)} characters: 1..253 allowed")
    labels = name.split(".")
    for label in labels:
        if not _LABEL.fullmatch(label):
            raise Malformed(
                f"host label {label[:80]!r} must be 1..63 letters, digits or inner hyphens "
                f"(got {len(label)} characters)"
            )
    if labels[-1].isdigit():
        raise Malformed(f"host {name[:80]!r} is neither an IPv4 address nor a name")
    return name


def check_url(text: object, insecure: bool = False) -> str:
    """The peer URL ``text`` in canonical form (``scheme://host[:port]``), or Malformed."""
    if not isinstance(text, str) or not 0 < len(text) <= MAX_URL_CHARS:
        raise Malformed(f"a peer address must be a URL of 1..{MAX_URL_CHARS} characters")
    if not text.isprintable() or any(c.isspace() for c in text):
        raise Malformed("a peer address must not hold spaces or control characters")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise Malformed(f"peer address {text[:80]!r}: {e}") from None
    schemes = ("https", "http") if insecure else ("https",)
    if parts.scheme not in schemes:
        raise Malformed(
            f"peer address {text[:80]!r}: scheme must be {' or '.join(schemes)}"
            + ("" if insecure else " (plain http only with --insecure)")
        )
    if "@" in parts.netloc:
        raise Malformed(f"peer address {text[:80]!r}: no user:password@ allowed")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise Malformed(f"peer address {text[:80]!r}: no path, query or fragment allowed")
    netloc = parts.netloc
    host = netloc[: netloc.rindex("]") + 1] if netloc.startswith("[") else netloc.rsplit(":", 1)[0]
    if port is not None and not 0 < port < 65536:
        raise Malformed(f"peer address {text[:80]!r}: port must be in 1..65535")
    if port is None and netloc.endswith(":"):
        raise Malformed(f"peer address {text[:80]!r}: empty port")
    canonical = _host(host)
    return f"{parts.scheme}://{canonical}" + (f":{port}" if port is not None else "")


def host_of(url: str) -> str:
    """The host of a canonical URL (IPv6 without brackets)."""
    rest = url.split("://", 1)[1]
    if rest.startswith("["):
        return rest[1 : rest.index("]")]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


def kind_of(url: str) -> str:
    """loopback | private | global | name | forbidden (link-local, metadata, documentation, ...)."""
    host = host_of(url)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if host == "localhost" or host.endswith(".localhost"):
            return "loopback"
        return "forbidden" if host.rsplit(".", 1)[-1] in _SPECIAL_TLDS else "name"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:  # first: ::1 is also in the IPv6 reserved block
        return "loopback"
    if any(ip in n for n in _METADATA) or any(ip in n for n in _DOCUMENTATION):
        return "forbidden"
    if ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return "forbidden"
    if ip.is_private:
        return "private"
    return "global"


@dataclass
class AddressPolicy:
    """Which well-formed addresses this peer contacts (see the module docstring)."""

    own: Iterable[str]  # our advertised URL and the bootstrap URLs: their kinds are allowed
    allow_networks: Iterable[str] = ()  # CIDRs contacted whatever their kind
    interval: float = 1.0  # one new unverified address per this many seconds ...
    burst: int = 8  # ... after a burst of this many
    kinds: set[str] = field(init=False)
    verified: set[str] = field(init=False)

    def __post_init__(self) -> None:
        own = list(self.own)
        self.kinds = {k for k in map(kind_of, own) if k != "forbidden"}
        try:
            self.networks = [ipaddress.ip_network(n, strict=False) for n in self.allow_networks]
        except ValueError as e:
            raise Malformed(f"gossip.allow_networks: {e}") from None
        self.verified = set(own)
        self._tokens = float(self.burst)
        self._last: float | None = None
        self.refused = 0  # addresses not contacted: a forbidden kind
        self.deferred = 0  # addresses not contacted yet: over the rate of new contacts

    def _allowed_network(self, url: str) -> bool:
        try:
            ip = ipaddress.ip_address(host_of(url))
        except ValueError:
            return False
        return any(ip in n for n in self.networks)

    def allowed(self, url: str) -> bool:
        """Whether ``url`` (canonical) is of a kind this peer contacts at all."""
        return self._allowed_network(url) or kind_of(url) in self.kinds

    def resolved_ok(self, ip: str) -> bool:
        """Whether a name may be connected at the address ``ip`` it resolved to: never a forbidden
        kind (link-local, metadata, documentation, unspecified, multicast) unless allowed."""
        host = f"[{ip}]" if ":" in ip else ip
        return self._allowed_network(f"https://{host}") or kind_of(f"https://{host}") != "forbidden"

    def may_contact(self, url: str, now: float) -> bool:
        """True to contact ``url`` now: an allowed kind, and verified or within the rate of new contacts."""
        if not self.allowed(url):
            self.refused += 1
            return False
        if url in self.verified:
            return True
        if self._last is not None:
            self._tokens = min(float(self.burst), self._tokens + max(0.0, now - self._last) / self.interval)
        self._last = now
        if self._tokens < 1.0:
            self.deferred += 1
            return False
        self._tokens -= 1.0
        return True

    def on_success(self, url: str) -> None:
        """We reached ``url`` and it answered as a peer: verified."""
        if len(self.verified) < 65536:
            self.verified.add(url)

    def forget(self, url: str) -> None:
        self.verified.discard(url)
