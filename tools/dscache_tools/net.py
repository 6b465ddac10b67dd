"""Loopback helpers shared by the demos, the dev cluster and the tests."""

from __future__ import annotations

import random
import socket
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

_random = random.SystemRandom()  # not the seeded global: each process picks apart


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
    picks at random from ``PICK_RANGE`` less the ephemeral range and returns the
    first that binds; only if none does (a host whose ephemeral range covers it
    all) does it fall back to port 0. Another process could still take the port
    before the caller binds; that shows up as a failed start naming the port.
    """
    ephemeral = ephemeral_range()
    candidates = [p for p in PICK_RANGE if p not in ephemeral and p not in KUBERNETES_DEFAULTS]
    for port in _random.sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
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
