"""free_port: the ports the demos, the dev cluster and the tests listen on."""

from __future__ import annotations

import socket
from pathlib import Path

from dscache_tools.net import KUBERNETES_DEFAULTS, ephemeral_range, free_port


def test_a_picked_port_is_outside_the_kernels_ephemeral_range_and_binds() -> None:
    # An outgoing connection's source port comes from the ephemeral range; a port
    # picked there can be taken before the caller binds (NGINX failed so in CI).
    ephemeral = ephemeral_range()
    ports = {free_port() for _ in range(50)}
    assert len(ports) > 40  # picked at random, not one port over and over
    for port in ports:
        assert port not in ephemeral
        assert port not in KUBERNETES_DEFAULTS
        assert port < 30000  # below the NodePort range
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_a_port_in_use_is_never_handed_out() -> None:
    held = []
    try:
        for _ in range(200):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", free_port()))
            sock.listen(1)
            held.append(sock)  # every bind succeeded: no port was handed out twice
        assert len({s.getsockname()[1] for s in held}) == 200
    finally:
        for sock in held:
            sock.close()


def test_the_ephemeral_range_is_read_from_the_kernel(tmp_path: Path) -> None:
    conf = tmp_path / "ip_local_port_range"
    conf.write_text("20000\t25000\n")
    assert ephemeral_range(conf) == range(20000, 25001)
    conf.write_text("garbage")
    assert ephemeral_range(conf) == range(32768, 61000)  # the kernel's default
