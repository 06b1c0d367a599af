"""What a node does with the server's HTTP answers, shared by plain and secure rounds.

A transient failure (connection lost, 5xx, 408, 429) is :class:`Retry`: wait with
full-jitter exponential backoff (AWS architecture blog, "Exponential Backoff And
Jitter", 2015) and try again. A refusal of this request (any other 4xx) is
:class:`Refused`: do not send it again. A refusal of the node itself (401/403, another
model's spec hash, an untrusted certificate) is :class:`NodeError`: stop.
"""

from __future__ import annotations

import logging
import random
import re
import socket
from dataclasses import dataclass

import aiohttp

from shoal.errors import ShoalError


class NodeError(ShoalError):
    """The server refused this node for good (bad token, revoked) or cannot be trusted."""

    code = "node_error"


#: aiohttp quotes the connector's SSL context in its errors: the object's repr tells an operator nothing
_SSL_REPR = re.compile(r"ssl:<ssl\.SSLContext object at 0x[0-9a-fA-F]+>")


class Retry(Exception):
    """A transient failure: wait and try again."""

    def __init__(self, msg: str = ""):
        super().__init__(_SSL_REPR.sub("over TLS", msg))


class Refused(Exception):
    """The server refused this request (4xx): do not send it again. ``code``: the server's error code."""

    def __init__(self, msg: str, code: str = ""):
        super().__init__(msg)
        self.code = code


log = logging.getLogger(__name__)

REATTACH_AFTER = 2  # failed requests in a row before a node given several servers moves to the next


class ServerList:
    """The servers a node or a node daemon may use, in order of preference (edge aggregators, a
    root), and the one in use: after REATTACH_AFTER failed requests in a row it moves to the next,
    and when one answers again it logs how long the node was without a server (re-attach time),
    on ``logger`` (the caller's, so the lines name the node or the daemon)."""

    def __init__(self, urls: list[str], logger: logging.Logger = log):
        if not urls:
            raise ValueError("a server list needs at least one URL")
        self.log = logger
        self.urls = [u.rstrip("/") for u in urls]
        self.url = self.urls[0]
        self.failures = 0
        self.lost_since: float | None = None  # when the server in use first failed to answer

    @classmethod
    def parse(cls, servers: str, logger: logging.Logger = log) -> ServerList:
        """``URL1,URL2,...`` (one URL is a list of one)."""
        return cls([u.strip() for u in servers.split(",") if u.strip()] or [servers], logger)

    def lost(self, now: float, leave: bool = False) -> None:
        """The server in use did not answer (``leave``: and the caller gives it up at once, e.g. an
        upload whose round is gone with it); the next one is used after REATTACH_AFTER in a row."""
        self.lost_since = self.lost_since if self.lost_since is not None else now
        self.failures = max(self.failures + 1, REATTACH_AFTER if leave else 0)
        if len(self.urls) > 1 and self.failures >= REATTACH_AFTER:
            old = self.url
            self.url = self.urls[(self.urls.index(self.url) + 1) % len(self.urls)]
            self.failures = 0
            self.log.warning("server %s does not answer; re-attaching to %s", old, self.url)

    def answered(self, now: float) -> None:
        if self.lost_since is not None:
            took = now - self.lost_since
            self.log.info("attached to %s, %.3f s after the last server stopped answering", self.url, took)
        self.lost_since, self.failures = None, 0

    def in_turn(self) -> list[str]:
        """Every server, the one in use first, then the others in their order."""
        first = self.urls.index(self.url)
        return self.urls[first:] + self.urls[:first]


@dataclass
class Backoff:
    """Full-jitter exponential backoff: sleep U(0, min(cap, base * 2^attempt))."""

    base: float = 0.2
    cap: float = 5.0
    attempt: int = 0

    def next(self, rand: random.Random) -> float:
        delay = rand.uniform(0, min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1
        return delay

    def reset(self) -> None:
        self.attempt = 0


async def connection_problem(
    url: str, e: BaseException, who: str = "node", url_option: str = "--server", ca_option: str = "--ca-cert"
) -> NodeError | None:
    """A failed connection to ``url`` that retrying cannot fix, as one NodeError line with the
    fix (shoal/tls.py finds out what is wrong); None when it may be transient (retry). ``who``
    dials ``url`` (given in ``url_option``) and trusts the CA of ``ca_option``: a node's flags, or
    an edge's keys towards its root (``hierarchy.parent``, ``hierarchy.parent_ca_cert``)."""
    from shoal.tls import certificate_problem, speaks_tls

    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        return NodeError(await certificate_problem(url, e.certificate_error, who, url_option, ca_option))
    if isinstance(e, aiohttp.ClientSSLError):
        if "WRONG_VERSION_NUMBER" in str(e):  # the server answered in plain HTTP
            plain = url.replace("https://", "http://", 1)
            return NodeError(
                f"TLS handshake with {url} failed: it speaks plain HTTP (an --insecure server); use {plain}"
            )
        return NodeError(f"TLS handshake with {url} failed: {e}")
    hung_up = isinstance(e, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)) and not isinstance(
        e,
        aiohttp.ClientConnectorError,  # nobody listening: the server is down, not a TLS one
    )
    if hung_up and url.startswith("http://") and await speaks_tls(url):
        return NodeError(
            f"the server at {url} speaks HTTPS and hangs up on plain HTTP: use "
            f"{url.replace('http://', 'https://', 1)} in {url_option} (with {ca_option} for a private CA)"
        )
    return None


def unreachable(url: str, e: BaseException, url_option: str = "--server") -> str:
    """One line on why ``url`` did not answer (a failure that may pass: an unknown host, nobody
    listening, no answer in time), for a caller that stops retrying; ``url_option`` gave the URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    where = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
    if isinstance(getattr(e, "os_error", None), socket.gaierror):  # the name did not resolve
        return f"the host {parts.hostname!r} of {url} is not known (DNS): check the name in {url_option}"
    if isinstance(e, aiohttp.ClientConnectorError):
        return (
            f"nothing answers at {where} ({e.os_error}): is the server running there, and is the port in "
            f"{url_option} right?"
        )
    if isinstance(e, TimeoutError | aiohttp.ServerTimeoutError):
        return f"{where} did not answer in time: is a firewall dropping the connection?"
    return f"{url} does not answer: {type(e).__name__}: {e}"


async def check_response(resp: aiohttp.ClientResponse) -> None:
    """Return for 2xx/3xx; else raise NodeError, Retry or Refused with the server's JSON error."""
    if resp.status < 400:
        return
    try:
        info = await resp.json()
    except Exception:  # noqa: BLE001 - a non-JSON error page (a proxy's, say)
        info = {"error": "http_error", "detail": await resp.text()}
    msg = f"{resp.status} {info.get('error')}: {info.get('detail')}"
    if resp.status in (401, 403):
        raise NodeError(f"server refused this node: {msg}")
    if info.get("error") == "spec_mismatch":  # another model: asking again never helps
        raise NodeError(f"server refused this node ({resp.status}): {info.get('detail')}")
    if resp.status >= 500 or resp.status in (408, 429):  # busy, timed out, too many in flight: retry
        raise Retry(msg)
    raise Refused(msg, str(info.get("error") or ""))
