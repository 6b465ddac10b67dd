"""Loopback helpers shared by the demos, the dev cluster and the tests."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host``.

    Port 0 lets the kernel pick; between this call and the caller's bind another
    process could take the port, which for local tooling shows up as a failed
    start naming the port, never as a silent clash.
    """
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
