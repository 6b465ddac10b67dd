"""SIGTERM while a model server is still connected: the sidecar serves on until it leaves.

In a deleted pod both containers get SIGTERM at once; the model server finishes
its last requests and queued stores, and they must still reach the store. A
real daemon (a subprocess, as a pod runs it) and a real client process: its
stores after the SIGTERM are served and are in the index after a restart; the
sidecar stops once the client has gone, at once with nobody connected, and
never later than ``--drain-max``; a second SIGTERM or a SIGINT stops it at once.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from dscache_sidecar.client import SidecarClient
from dscache_sidecar.drain import connected_clients
from sidecar_helpers import REPO, DaemonProcess, chain, prompt

#: A client process: connects, says so, then stores one chain per line it reads.
CLIENT = """
import sys
sys.path.insert(0, {helpers!r})
from sidecar_helpers import blocks_for, chain, prompt
from dscache_sidecar.client import SidecarClient

ch = chain()
with SidecarClient(sys.argv[1], data_dir=sys.argv[2], timeout_s=5) as c:
    c.stats()
    print("connected", flush=True)
    for line in sys.stdin:
        seed = int(line)
        print("stored", c.store(ch.tenant, blocks_for(ch.keys(prompt(4, seed)))), flush=True)
"""


class ClientProcess:
    """A model server, as far as the daemon can tell: its own process and connection."""

    def __init__(self, d: DaemonProcess, script: Path) -> None:
        script.write_text(CLIENT.format(helpers=str(Path(__file__).parent)))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), d.socket, str(d.data_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert self._line() == "connected"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def store(self, seed: int) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()
        return self._line()

    def leave(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0


@pytest.fixture
def client_factory(tmp_path: Path) -> Iterator[Callable[[DaemonProcess], ClientProcess]]:
    made: list[ClientProcess] = []

    def make(d: DaemonProcess) -> ClientProcess:
        made.append(ClientProcess(d, tmp_path / f"client{len(made)}.py"))
        return made[-1]

    yield make
    for c in made:
        c.proc.kill()
        c.proc.wait(10)


def _readyz(d: DaemonProcess) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{d.http_port}/readyz", timeout=10) as r:
            return r.status, r.read().decode().strip()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode().strip()


def _exits_within(d: DaemonProcess, bound_s: float) -> tuple[int, float]:
    assert d.proc is not None
    t0 = time.monotonic()
    code = d.proc.wait(bound_s)
    return code, time.monotonic() - t0


def test_accepted_connections_are_counted_until_they_close(tmp_path: Path) -> None:
    path = str(tmp_path / "a socket with spaces.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(tmp_path / "other.sock"))
    other.listen()
    try:
        assert connected_clients(path) == 0  # a listening socket is not a client
        clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        for c in clients:
            c.connect(path)
        accepted = [listener.accept()[0] for _ in clients]
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(str(tmp_path / "other.sock"))
        far = other.accept()[0]
        assert connected_clients(path) == 2
        clients[0].close()
        accepted[0].close()  # what grpc does when its peer hangs up
        assert connected_clients(path) == 1
        for s in (clients[1], accepted[1], stranger, far):
            s.close()
        assert connected_clients(path) == 0
        assert connected_clients(path, table=tmp_path / "no such table") == 0
    finally:
        listener.close()
        other.close()


def test_stores_after_sigterm_are_served_and_kept_until_the_client_leaves(
    daemon_factory: Callable[..., DaemonProcess],
    client_factory: Callable[[DaemonProcess], ClientProcess],
) -> None:
    d = daemon_factory(None, "--drain-max", "60")
    d.start()
    client = client_factory(d)
    assert client.store(1) == "stored 4"
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # the server is still finishing its requests
    assert d.proc.poll() is None, "the sidecar stopped with its client still connected"
    assert _readyz(d) == (503, "draining")  # no new traffic: not ready
    assert client.store(2) == "stored 4", "a store after SIGTERM was refused"
    client.leave()
    code, took = _exits_within(d, 30)
    assert code == 0
    assert took < 30  # it went once the client had gone, long before --drain-max
    log = d.log.read_text()
    assert "drained (no clients)" in log
    assert re.search(r"calls served meanwhile: .*Commit 1", log), log[-2000:]
    d.start()
    ch = chain()
    with SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5) as c:
        assert c.lookup(ch.tenant, ch.keys(prompt(4, 1))) == 4
        assert c.lookup(ch.tenant, ch.keys(prompt(4, 2))) == 4, "the last store was lost"
    assert d.terminate() == 0


def test_with_nobody_connected_sigterm_stops_at_once(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory(None, "--drain-max", "60")
    d.start()
    assert d.terminate(timeout=30) == 0
    assert "drained (no clients)" in d.log.read_text()


def test_a_client_that_never_leaves_holds_it_no_longer_than_drain_max(
    daemon_factory: Callable[..., DaemonProcess],
    client_factory: Callable[[DaemonProcess], ClientProcess],
) -> None:
    d = daemon_factory(None, "--drain-max", "1")
    d.start()
    client = client_factory(d)
    assert d.proc is not None
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert time.monotonic() - t0 >= 1.0
    assert "drained (max)" in d.log.read_text()
    assert client.proc.poll() is None  # the client is not harmed; its calls now fail


@pytest.mark.parametrize("how", ["second SIGTERM", "SIGINT"])
def test_a_second_sigterm_or_a_sigint_stops_at_once(
    how: str,
    daemon_factory: Callable[..., DaemonProcess],
    client_factory: Callable[[DaemonProcess], ClientProcess],
) -> None:
    d = daemon_factory(None, "--drain-max", "300")
    d.start()
    client_factory(d)
    assert d.proc is not None
    if how == "SIGINT":
        d.proc.send_signal(signal.SIGINT)
    else:
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert d.proc.poll() is None
        d.proc.send_signal(signal.SIGTERM)
    code, took = _exits_within(d, 60)
    assert code == 0 and took < 60  # not the 300 s of --drain-max
