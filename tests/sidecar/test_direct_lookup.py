"""Lookups without a round trip: the client reads the daemon's LMDB index itself.

The daemon runs as its own process (as beside a model server); the client opens the
index read-only and answers ``find`` from it, equal to the daemon's own answer, and
falls back to gRPC whenever it cannot read the index."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dscache_sidecar import client as client_module
from dscache_sidecar.client import SidecarClient
from dscache_sidecar.client import lookup as client_lookup
from needs import missing, need_binary
from sidecar_helpers import DaemonProcess, Sidecar, blocks_for, chain, prompt, store_chain


def _rpc(d: DaemonProcess) -> SidecarClient:
    return SidecarClient(d.socket, timeout_s=5)  # no data_dir: always asks the daemon


def test_direct_lookup_answers_as_the_daemon_does(
    daemon_factory: Callable[..., DaemonProcess],
) -> None:
    d = daemon_factory()
    d.start()
    a, b = chain("tenant-a"), chain("tenant-b")
    keys = a.keys(prompt(6, 1))
    with SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5) as c, _rpc(d) as rpc:
        assert c.store(a.tenant, blocks_for(keys[:4])) == 4
        for probe in (keys, keys[:2], keys[4:], []):
            answer = c.find(a.tenant, probe)
            assert answer.direct
            assert answer.found == rpc.find(a.tenant, probe).found
        assert c.find(a.tenant, keys).found == 4
        # Another tenant's salt gives other keys, and the same keys are not its blocks.
        assert c.find(b.tenant, keys).found == 0
        assert rpc.find(b.tenant, keys).found == 0
        # A delete (the daemon writes the index) is seen at once.
        assert c.delete(a.tenant, [keys[2]]) >= 1
        assert c.find(a.tenant, keys) == client_module.LookupAnswer(2, direct=True)
        assert rpc.lookup(a.tenant, keys) == 2
    assert d.terminate() == 0


def test_lookup_is_direct_once_the_daemon_has_created_its_index(
    daemon_factory: Callable[..., DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_lookup, "DIRECT_RETRY_S", 0.2)
    d = daemon_factory()
    c = SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5)
    try:
        with pytest.raises(client_module.SidecarUnavailableError):
            c.find(chain().tenant, chain().keys(prompt(1, 1)))  # no index, no daemon yet
        d.start()
        ch = chain()
        keys = ch.keys(prompt(3, 2))
        assert c.store(ch.tenant, blocks_for(keys)) == 3
        time.sleep(0.3)
        assert c.find(ch.tenant, keys) == client_module.LookupAnswer(3, direct=True)
    finally:
        c.close()


def test_a_replaced_index_is_opened_anew(
    daemon_factory: Callable[..., DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_lookup, "DIRECT_RETRY_S", 0.2)
    d = daemon_factory()
    d.start()
    ch = chain()
    old, new = ch.keys(prompt(2, 3)), ch.keys(prompt(2, 4))
    with SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5) as c:
        assert c.store(ch.tenant, blocks_for(old)) == 2
        assert c.find(ch.tenant, old).found == 2
        assert d.terminate() == 0
        shutil.rmtree(d.data_dir)  # a new, empty store at the same path
        d.start()
        assert c.store(ch.tenant, blocks_for(new)) == 2
        time.sleep(1.5)  # the client checks the index file's identity every second
        assert c.find(ch.tenant, old) == client_module.LookupAnswer(0, direct=True)
        assert c.find(ch.tenant, new) == client_module.LookupAnswer(2, direct=True)


def test_a_daemon_in_this_process_is_asked_over_grpc(sidecar: Sidecar) -> None:
    # LMDB refuses a second handle on one environment in one process: the client
    # keeps asking the daemon, with the same answers.
    ch = chain()
    keys = ch.keys(prompt(3, 5))
    sidecar.c.store(ch.tenant, blocks_for(keys))
    answer = sidecar.c.find(ch.tenant, keys)
    assert answer == client_module.LookupAnswer(3, direct=False)


_CLIENT = textwrap.dedent(
    """
    import json, os, sys
    from dscache_sidecar.client import SidecarClient
    socket, data_dir, tenant, *keys = sys.argv[1:]
    with SidecarClient(socket, data_dir=data_dir, timeout_s=5) as c:
        answer = c.find(tenant, [bytes.fromhex(k) for k in keys])
    print(json.dumps({"pid": os.getpid(), "found": answer.found, "direct": answer.direct}))
    """
)


@pytest.mark.slow
def test_same_pid_in_another_pid_namespace_falls_back_to_grpc(tmp_path: Path) -> None:
    """What a pod without ``shareProcessNamespace`` looks like: the daemon and the
    server are both pid 1 in namespaces of their own. LMDB's reader lock of pid 1 is
    the daemon's, so the server's reader cannot register; lookups still work, over
    gRPC. (The operator shares the pod's PID namespace for this reason.)"""
    if os.geteuid() != 0:
        missing("needs root for PID namespaces (unshare)")
    need_binary("unshare", "util-linux")
    data = tmp_path / "store"
    daemon = DaemonProcess(data)
    cmd = ["unshare", "--pid", "--fork", "--kill-child", *daemon.command()]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        with SidecarClient(daemon.socket, timeout_s=5) as c:
            deadline = time.monotonic() + 30
            while not c.healthy():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
            ch = chain()
            keys = ch.keys(prompt(2, 9))
            c.store(ch.tenant, blocks_for(keys))
        script = [sys.executable, "-c", _CLIENT, daemon.socket, str(data), ch.tenant]
        script += [k.hex() for k in keys]
        in_ns = subprocess.run(
            ["unshare", "--pid", "--fork", *script], capture_output=True, text=True, check=True
        )
        assert json.loads(in_ns.stdout) == {"pid": 1, "found": 2, "direct": False}
        # The same client in this PID namespace (another pid) reads the index itself.
        here = subprocess.run(script, capture_output=True, text=True, check=True)
        assert json.loads(here.stdout)["direct"] is True
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # unshare and the daemon, pid 1 in its namespace
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


_HOLD_A_READ = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dscache_sidecar.index import IndexReader
    reader = IndexReader(Path(sys.argv[1]))
    txn = reader._env.begin()  # a lookup in flight
    print("reading", flush=True)
    time.sleep(600)
    """
)


def _reader(index: Path) -> subprocess.Popen[str]:
    """A process that opened the index and is inside a read transaction."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_A_READ, str(index)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
    return proc


def _killed_reader(index: Path) -> int:
    """A reader SIGKILLed inside its read transaction (a model server's OOM kill)."""
    proc = _reader(index)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    return proc.pid


def _slots(sidecar: Sidecar) -> str:
    return str(sidecar.store._index.reader_table())


@pytest.mark.slow
def test_reader_slots_of_killed_model_servers_are_freed(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    # A reader killed while the daemon runs: freed by the periodic check.
    s = make_sidecar(reader_check_s=0.5)
    dead = _killed_reader(s.data_dir / "index")
    assert f" {dead} " in _slots(s)  # LMDB kept the dead process's slot
    deadline = time.monotonic() + 20
    while f" {dead} " in _slots(s) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f" {dead} " not in _slots(s)
    assert s.metric("dscache_sidecar_stale_readers_cleared_total") == 1
    # The daemon restarts while a model server keeps the index open (so LMDB does not
    # reset its reader table) and another reader died meanwhile: freed at start.
    s.stop()
    live = _reader(s.data_dir / "index")
    try:
        dead = _killed_reader(s.data_dir / "index")
        s.kw["reader_check_s"] = 3600.0
        s.start()
        assert f" {dead} " not in _slots(s)
        assert f" {live.pid} " in _slots(s)  # a live reader keeps its slot
        assert s.metric("dscache_sidecar_stale_readers_cleared_total") == 1
    finally:
        live.kill()
        live.wait(timeout=10)
    tenant, keys = store_chain(s.c, 2, seed=31)  # and the index works on
    assert s.c.find(tenant, keys).found == 2
