"""A full disk: the daemon starts with what fits, writers get RESOURCE_EXHAUSTED,
reads go on, and writes resume once there is room again.

The small filesystems are real tmpfs mounts (these tests run as root). A mount that
fails is a test failure, never a skip: disk-full behaviour must be checked.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from dscache_sidecar.client import SidecarClient, SidecarFullError
from sidecar_helpers import DaemonProcess, Sidecar, block_array, blocks_for, chain, prompt

KiB = 1024
MiB = 1024 * KiB


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.fail(
                f"cannot mount a {size}-byte tmpfs at {where} (needs root and mount(8)): "
                f"{done.stderr.strip()}"
            )
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill_disk(path: Path) -> int:
    """Writes zeros to ``path`` until the filesystem is full; returns bytes written."""
    chunk = b"\0" * (4 * KiB)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                n = os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return written
            written += n
    finally:
        os.close(fd)


#: Starts a daemon (2 MiB of 256 KiB segments) on a tmpfs of the given size.
OnTmpfs = Callable[[int], tuple[Path, DaemonProcess]]


@pytest.fixture
def daemon_on_tmpfs(
    tmpfs: Callable[[int], Path], daemon_factory: Callable[..., DaemonProcess]
) -> OnTmpfs:
    def start(fs_bytes: int) -> tuple[Path, DaemonProcess]:
        fs = tmpfs(fs_bytes)
        # Zero-filled segments: these tests are about space reserved at start.
        d = daemon_factory(
            fs, "--capacity", "2MiB", "--segment-size", "256KiB", "--segment-init", "zero"
        )
        d.start()
        return fs, d

    return start


def client_for(d: DaemonProcess) -> SidecarClient:
    return SidecarClient(d.socket, data_dir=str(d.data_dir), timeout_s=5)


def assert_reads_back(c: SidecarClient, tenant: str, keys: list[bytes], n: int) -> None:
    assert c.lookup(tenant, keys) == n
    with c.load(tenant, keys) as got:
        assert got.keys == keys[:n]
        for key, arr in zip(got.keys, got.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))


def test_filesystem_smaller_than_capacity_starts_with_the_segments_that_fit(
    daemon_on_tmpfs: OnTmpfs,
) -> None:
    _, d = daemon_on_tmpfs(1 * MiB)
    assert "running with" in d.log.read_text()
    with client_for(d) as c:
        st = c.stats()
        assert 0 < st.capacity_bytes < 2 * MiB
        assert st.capacity_bytes == st.segments * 256 * KiB
        # Writes work, with eviction, well past the reduced capacity.
        ch = chain()
        chains = [ch.keys(prompt(8, seed)) for seed in range(20)]  # 160 blocks x 8 KiB
        for keys in chains:
            assert c.store(ch.tenant, blocks_for(keys)) == 8
        assert c.stats().evicted_blocks > 0
        assert_reads_back(c, ch.tenant, chains[-1], 8)
        assert c.healthy()
    assert d.terminate() == 0


def test_full_disk_refuses_writes_keeps_reads_and_recovers(daemon_on_tmpfs: OnTmpfs) -> None:
    fs, d = daemon_on_tmpfs(4 * MiB)
    ch = chain()
    kept = ch.keys(prompt(8, 1))
    with client_for(d) as c:
        assert c.stats().capacity_bytes == 2 * MiB  # everything fit
        assert c.store(ch.tenant, blocks_for(kept)) == 8
        filler = fs / "filler"
        assert fill_disk(filler) > 0
        # New blocks need index pages the disk cannot give: RESOURCE_EXHAUSTED.
        refused = 0
        for seed in range(100, 160):
            keys = ch.keys(prompt(4, seed))
            try:
                c.store(ch.tenant, blocks_for(keys))
            except SidecarFullError:
                refused += 1
            # Reads go on between every write.
            assert_reads_back(c, ch.tenant, kept, 8)
        assert refused > 0, "the index grew on a full disk?"
        assert c.healthy()
        # Room again: writes succeed and read back.
        filler.unlink()
        fresh = ch.keys(prompt(4, 999))
        assert c.store(ch.tenant, blocks_for(fresh)) == 4
        assert_reads_back(c, ch.tenant, fresh, 4)
        assert_reads_back(c, ch.tenant, kept, 8)
        assert c.stats().checksum_failures == 0
    assert d.terminate() == 0
    # And the index it kept is intact after a restart.
    d.start()
    with client_for(d) as c:
        assert_reads_back(c, ch.tenant, fresh, 4)
        assert_reads_back(c, ch.tenant, kept, 8)


def test_everything_leased_refuses_allocate_keeps_reads_and_recovers_on_release(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(capacity_bytes=256 * KiB, segment_bytes=128 * KiB)  # 32 extents
    ch = chain()
    chains = [ch.keys(prompt(4, seed)) for seed in range(8)]
    for keys in chains:
        sc.c.store(ch.tenant, blocks_for(keys))
    present = [keys for keys in chains if sc.c.lookup(ch.tenant, keys) == 4]
    leases = [sc.c.load(ch.tenant, keys) for keys in present]
    # Fill whatever is still free, then one more block cannot get space.
    refused = None
    for seed in range(100, 140):
        try:
            sc.c.store(ch.tenant, blocks_for(ch.keys(prompt(1, seed))))
        except SidecarFullError as exc:
            refused = exc
            break
        leases.append(sc.c.load(ch.tenant, ch.keys(prompt(1, seed))))
    assert refused is not None and "RESOURCE_EXHAUSTED" in str(refused)
    # Nothing leased was given up for the failed write; reads go on.
    for keys in present:
        assert_reads_back(sc.c, ch.tenant, keys, 4)
    for lease in leases:
        for key, arr in zip(lease.keys, lease.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))
    assert sc.c.healthy()
    for lease in leases:
        lease.release()
    fresh = ch.keys(prompt(4, 999))
    assert sc.c.store(ch.tenant, blocks_for(fresh)) == 4
    assert_reads_back(sc.c, ch.tenant, fresh, 4)


def _allocated(data_dir: Path) -> int:
    """Bytes of disk the segment files really take (not their apparent size)."""
    return sum(p.stat().st_blocks * 512 for p in (data_dir / "segments").glob("*.dat"))


@pytest.mark.parametrize("mode", ["zero", "sparse"])
def test_zero_filled_segments_reserve_their_space_sparse_ones_take_it_as_written(
    make_sidecar: Callable[..., Sidecar], mode: str
) -> None:
    sc = make_sidecar(capacity_bytes=4 * MiB, segment_bytes=1 * MiB, segment_init=mode)
    before = _allocated(sc.data_dir)
    if mode == "zero":
        assert before >= 4 * MiB
    else:
        assert before < 64 * KiB
    ch = chain()
    keys = ch.keys(prompt(8, 3))
    assert sc.client.store(ch.tenant, blocks_for(keys)) == 8
    assert_reads_back(sc.client, ch.tenant, keys, 8)
    if mode == "sparse":
        assert 8 * 4 * KiB <= _allocated(sc.data_dir) < 1 * MiB
