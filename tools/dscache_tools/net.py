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
