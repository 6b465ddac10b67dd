"""Loopback helpers shared by the demos, the dev cluster and the tests.

:func:`free_port` never hands out a port twice within ``HOLD_S``, across every
process that shares one temporary directory (a CI run's lanes do): a port is
free when nothing is bound to it *and* no picker handed it out recently, so two
callers picking before either binds (three Redis nodes started in a row, a demo
stack that picks all its ports and then starts its processes) get different
ports. The picks are recorded in ``$TMPDIR/dscache-ports``, under ``flock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# Ports handed out by free_port: below the NodePort range (30000-32767) and the
# kernel's usual ephemeral range (32768-60999), so neither an outgoing
# connection's source port nor another process's bind to port 0 can take one
# between the pick and the caller's bind. Redis Cluster's bus port (+10000)
# stays below 30000 too.
PICK_RANGE = range(10000, 20000)
# The Kubernetes components' default ports (kubelet, kube-proxy, scheduler,
# controller manager): a cluster started later on its defaults must find them free.
KUBERNETES_DEFAULTS = range(10248, 10260)

# How long a handed-out port stays reserved for its caller's bind: longer than a
# stack takes from picking its ports to starting the last of its processes.
HOLD_S = 300.0

_random = random.SystemRandom()  # not the seeded global: each process picks apart
# This process's picks, for when the shared registry cannot be written.
_picked: dict[int, float] = {}


def registry_path() -> Path:
    """Where the pickers sharing this temporary directory record their picks."""
    return Path(tempfile.gettempdir()) / "dscache-ports"


@contextlib.contextmanager
def _held_ports(path: Path, now: float) -> Iterator[dict[int, float]]:
    """The ports handed out (port -> expiry), locked for this caller; written back
    on exit with the caller's additions and without the expired ones. Falls back
    to this process's own picks when the file cannot be opened."""
    for port in [p for p, expiry in _picked.items() if expiry <= now]:
        del _picked[port]
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield _picked
        return
    with os.fdopen(fd, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        held: dict[int, float] = {}
        for line in f.read().split("\n"):
            number, _, expiry = line.partition(" ")
            with contextlib.suppress(ValueError):
                if float(expiry) > now:
                    held[int(number)] = float(expiry)
        held.update(_picked)
        yield held
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {e:.0f}\n" for p, e in held.items()))


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The ports the kernel hands out for port 0 and outgoing connections."""
    try:
        low, high = (int(p) for p in path.read_text().split())
    except (OSError, ValueError):
        return range(32768, 61000)
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host``, outside the kernel's ephemeral range.

    A port the kernel picks for port 0 comes from the ephemeral range, where the
    next outgoing connection may take it as its source port before the caller
    binds (seen: NGINX failing with EADDRINUSE while a parallel lane ran). This
    picks at random from ``PICK_RANGE`` less the ephemeral range and the ports
    handed out in the last ``HOLD_S`` (seen: two of a Redis Cluster's three
    nodes given one port, the first not yet bound when the second was picked),
    and returns the first that binds; only if none does (a host whose ephemeral
    range covers it all) does it fall back to port 0. A process that does not
    use this function could still take the port before the caller binds; that
    shows up as a failed start naming the port.
    """
    ephemeral = ephemeral_range()
    candidates = [p for p in PICK_RANGE if p not in ephemeral and p not in KUBERNETES_DEFAULTS]
    now = time.time()
    with _held_ports(registry_path(), now) as held:
        for port in _random.sample(candidates, min(256, len(candidates))):
            if port in held:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            held[port] = _picked[port] = now + HOLD_S
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
