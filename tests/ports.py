"""Loopback ports for servers the tests start in other processes (which must be told a port).

A server the test runs in its own event loop binds port 0 and reads its port back; a subprocess
needs a number before it starts, and a number found by binding port 0 and closing the socket can
be handed to someone else before the subprocess binds it: another pytest-xdist worker's probe, or
the kernel's choice of a source port for an outgoing connection. So the ports here come from a
range of this worker's own below the kernel's ephemeral range (32768-60999 on Linux): a port is
probed (bound, all of a call's ports at once, then closed), and the worker walks its range in turn,
so a port comes back only after all the others of its range have been handed out.
"""

from __future__ import annotations

import os
import random
import socket

BASE, SPAN = 20_000, 1_500  # worker k owns [BASE + k * SPAN, BASE + (k + 1) * SPAN): 8 workers below 32768


def _worker_index() -> int:
    """0 outside xdist; k for worker ``gwk``."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = name[2:] if name.startswith("gw") else ""
    return int(digits) % 8 if digits.isdigit() else 0


class _Ports:
    def __init__(self) -> None:
        self.lo = BASE + _worker_index() * SPAN
        # a random start: two runs of the suite at once on one machine (two checkouts) rarely meet
        self.next = random.SystemRandom().randrange(SPAN)

    def take(self, n: int) -> list[int]:
        socks: list[socket.socket] = []
        ports: list[int] = []
        try:
            for _ in range(SPAN):
                if len(ports) == n:
                    break
                port = self.lo + self.next
                self.next = (self.next + 1) % SPAN
                s = socket.socket()
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:  # held by someone, or in TIME_WAIT from an earlier run
                    s.close()
                    continue
                socks.append(s)
                ports.append(port)
        finally:
            for s in socks:
                s.close()
        if len(ports) < n:
            raise RuntimeError(f"no {n} free loopback ports in {self.lo}-{self.lo + SPAN - 1}")
        return ports


_PORTS = _Ports()


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, free now and in no other worker's range."""
    return _PORTS.take(n)


def free_port() -> int:
    """One loopback port, as :func:`free_ports`."""
    return _PORTS.take(1)[0]
