"""Who a message is from: a gossip message's claimed sender against the caller's TLS client
certificate (sans-I/O; the transport hands in what the TLS layer verified).

A message names its sender by its advertised URL. A peer that runs with a peer certificate and
a CA (``shoal pki peer-cert``, docs/peer.md) asks callers for a client certificate of that CA;
the host of the sender's URL must then be one of the certificate's subjectAltName entries (a
DNS name or an IP address), or the message is refused before anything looks at it. Without
certificates the sender is what the message says: its identity is only the network token's.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit


def _normal(host: str) -> str:
    host = host.strip().strip("[]").rstrip(".").lower()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def cert_hosts(peercert: Any) -> frozenset[str] | None:
    """The DNS names and IP addresses of a verified client certificate (``ssl.SSLSocket.getpeercert()``'s
    dict); None when the caller presented none (an empty dict or None)."""
    if not isinstance(peercert, dict) or not peercert:
        return None
    names = set()
    for entry in peercert.get("subjectAltName", ()):
        if isinstance(entry, tuple) and len(entry) == 2 and entry[0] in ("DNS", "IP Address"):
            names.add(_normal(str(entry[1])))
    return frozenset(names)


def sender_host(url: str) -> str:
    """The host a sender's URL names, in the form :func:`cert_hosts` gives."""
    return _normal(urlsplit(url).hostname or "")


def sender_matches(sender: str, hosts: frozenset[str]) -> bool:
    """True when the certificate's ``hosts`` cover ``sender``'s host (by host, not by port)."""
    return sender_host(sender) in hosts
