"""Two daemons never share a store: the data directory's lock.

Real daemons as subprocesses (the lock must die with a kill -9), real files.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from dscache_sidecar.client import SidecarClient
from dscache_sidecar.daemon import EXIT_DATA_DIR_LOCKED
from dscache_sidecar.errors import DataDirLockedError
from dscache_sidecar.store import KVStore
from sidecar_helpers import DaemonProcess, block_array, blocks_for, chain, prompt, settings


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``directory``: (size, mtime ns), to show nothing changed."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def _assert_serves(d: DaemonProcess, tenant: str, keys: list[bytes]) -> None:
    with SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5) as c:
        assert c.lookup(tenant, keys) == len(keys)
        with c.load(tenant, keys) as got:
            for key, arr in zip(got.keys, got.arrays, strict=True):
                np.testing.assert_array_equal(arr, block_array(key))


def test_a_second_daemon_on_a_locked_dir_exits_naming_the_holder_and_changes_nothing(
    daemon_factory: Callable[..., DaemonProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POD_NAME", "dscache-blue-0")
    first = daemon_factory()
    first.start()
    assert first.proc is not None
    ch = chain()
    keys = ch.keys(prompt(6, 1))
    with SidecarClient(first.socket, data_dir=str(first.data_dir), timeout_s=5) as c:
        assert c.store(ch.tenant, blocks_for(keys)) == 6
    before = _snapshot(first.data_dir)
    second = DaemonProcess(first.data_dir)  # same dir, same socket path
    try:
        done = subprocess.run(
            second.command(), check=False, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a second daemon started on a data dir another daemon holds")
    assert done.returncode == EXIT_DATA_DIR_LOCKED, done.stderr
    errors = [line for line in done.stderr.splitlines() if "locked" in line]
    assert len(errors) == 1, done.stderr
    assert f"data dir {first.data_dir} is locked by another dscache sidecar" in errors[0]
    assert f"pid {first.proc.pid} on host " in errors[0]
    assert "pod dscache-blue-0" in errors[0]
    assert "two daemons must never share a store" in errors[0]
    assert "Traceback" not in done.stderr
    # It opened and changed nothing: the files, the socket, the data are the first's.
    assert _snapshot(first.data_dir) == before
    assert first.running()
    _assert_serves(first, ch.tenant, keys)
    # The kernel frees the lock with its holder, however it dies.
    first.kill()
    third = daemon_factory(first.data_dir)
    third.start()
    _assert_serves(third, ch.tenant, keys)
    assert third.terminate() == 0


def test_two_stores_in_one_process_conflict_until_the_first_closes(tmp_path: Path) -> None:
    with KVStore(settings(tmp_path)) as first:
        first.open(start_reaper=False)
        second = KVStore(settings(tmp_path))
        with pytest.raises(DataDirLockedError, match=r"pid \d+ on host .*since \d{4}-"):
            second.open(start_reaper=False)
    # Closed: the lock is free again, and the failed open left nothing to close.
    with KVStore(settings(tmp_path)) as again:
        again.open(start_reaper=False)
        assert again.gauges().capacity_bytes > 0
