"""free_port: the ports the demos, the dev cluster and the tests listen on."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from dscache_tools import net
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


def _narrow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ports: range) -> None:
    monkeypatch.setattr(net, "PICK_RANGE", ports)
    monkeypatch.setattr(net, "_picked", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_a_port_handed_out_is_not_handed_out_again_before_its_caller_binds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Seen in CI: two of a Redis Cluster's nodes given one port, the first node
    # not yet bound when the second was picked.
    _narrow(monkeypatch, tmp_path, range(15000, 15004))
    picks = [free_port() for _ in range(4)]  # none bound by its caller
    assert sorted(picks) == [15000, 15001, 15002, 15003]
    assert free_port() not in picks  # the range is spent: port 0's pick instead
    assert (tmp_path / "dscache-ports").exists()


def test_another_process_sharing_the_temporary_directory_skips_the_ports_picked_here(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _narrow(monkeypatch, tmp_path, range(15000, 15003))
    mine = {free_port() for _ in range(3)}  # the whole range, none bound
    theirs = subprocess.run(
        [
            sys.executable,
            "-c",
            "import dscache_tools.net as n; n.PICK_RANGE = range(15000, 15003); print(n.free_port())",
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert mine == {15000, 15001, 15002}
    assert int(theirs.stdout) not in mine  # it fell back to port 0's pick


def test_a_pick_older_than_the_hold_is_free_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _narrow(monkeypatch, tmp_path, range(15000, 15001))
    registry = tmp_path / "dscache-ports"
    registry.write_text(f"15000 {time.time() - 1:.0f}\nnot a line\n")
    assert free_port() == 15000
    assert registry.read_text().split()[0] == "15000"  # the stale entry replaced
    assert len(registry.read_text().splitlines()) == 1  # and the garbage dropped
