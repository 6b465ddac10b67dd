"""Corruption on disk: a flipped byte or a truncated segment is a miss plus cleanup,
counted in metrics, and never an error or a wrong byte for the reader."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from dscache_sidecar.client import SidecarClient
from dscache_sidecar.segments import HEADER_BYTES, SegmentFiles
from sidecar_helpers import Sidecar, block_array, blocks_for, chain, prompt

FAILURES = "dscache_sidecar_checksum_failures_total"


def segment_path(sc: Sidecar, key: bytes) -> tuple[Path, int]:
    """The segment file and extent offset of a stored block."""
    rec = sc.store.record(key)
    assert rec is not None
    return sc.data_dir / "segments" / SegmentFiles.name(rec.segment), rec.offset


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def flip_payload(sc: Sidecar, key: bytes, at: int = 1000) -> None:
    path, offset = segment_path(sc, key)
    flip(path, offset + HEADER_BYTES + at)


def assert_prefix(keys: list[bytes], got_keys: list[bytes], arrays: list[np.ndarray]) -> None:
    assert got_keys == keys[: len(got_keys)]
    for key, arr in zip(got_keys, arrays, strict=True):
        np.testing.assert_array_equal(arr, block_array(key))


def test_flipped_payload_byte_is_a_miss_from_there_and_the_block_is_dropped(
    sidecar: Sidecar,
) -> None:
    ch = chain()
    keys = ch.keys(prompt(5, 1))
    other = ch.keys(prompt(3, 2))
    sidecar.c.store(ch.tenant, blocks_for(keys) + blocks_for(other))
    flip_payload(sidecar, keys[2])
    with sidecar.c.load(ch.tenant, keys, verify=True) as got:
        assert len(got) == 2
        assert_prefix(keys, got.keys, got.arrays)
    # The daemon re-checked the report and dropped the block (and its descendants).
    assert sidecar.c.lookup(ch.tenant, keys) == 2
    assert sidecar.store.record(keys[3]) is None
    assert sidecar.metric(FAILURES, where="read") == 1
    assert sidecar.c.stats().checksum_failures == 1
    # Everything else is served as before, and the chain can be stored again.
    with sidecar.c.load(ch.tenant, other) as got:
        assert_prefix(other, got.keys, got.arrays)
        assert len(got) == 3
    assert sidecar.c.store(ch.tenant, blocks_for(keys)) == 3
    with sidecar.c.load(ch.tenant, keys) as got:
        assert len(got) == 5
        assert_prefix(keys, got.keys, got.arrays)


def test_background_check_catches_a_flipped_byte_after_the_views_are_handed_out(
    sidecar: Sidecar,
) -> None:
    """``verify="background"`` returns the views at once (the caller computes while the
    verifier thread checks them); ``verified()`` then says how many leading blocks
    are good, and the bad one is reported and dropped as with ``verify=True``."""
    ch = chain()
    keys = ch.keys(prompt(5, 7))
    sidecar.c.store(ch.tenant, blocks_for(keys))
    with sidecar.c.load(ch.tenant, keys, verify="background") as got:
        assert len(got) == 5
        assert got.verified(timeout_s=10) == 5
        assert_prefix(keys, got.keys, got.arrays)
    flip_payload(sidecar, keys[2])
    with sidecar.c.load(ch.tenant, keys, verify="background") as got:
        assert len(got) == 5  # handed out before any check ...
        assert got.verified(timeout_s=10) == 2  # ... and only the first two are good
        assert_prefix(keys[:2], got.keys[:2], got.arrays[:2])
    assert sidecar.c.lookup(ch.tenant, keys) == 2
    assert sidecar.store.record(keys[3]) is None
    assert sidecar.metric(FAILURES, where="read") == 1


def test_flipped_payload_byte_via_streaming_get(sidecar: Sidecar) -> None:
    ch = chain()
    keys = ch.keys(prompt(5, 1))
    sidecar.c.store(ch.tenant, blocks_for(keys))
    flip_payload(sidecar, keys[3], at=7)
    with SidecarClient(sidecar.running.socket_path) as streaming:  # no volume: Get
        got = streaming.load(ch.tenant, keys)
        assert len(got) == 3
        assert_prefix(keys, got.keys, got.arrays)
        assert streaming.get(ch.tenant, keys[3]) is None
    assert sidecar.c.lookup(ch.tenant, keys) == 3
    assert sidecar.metric(FAILURES, where="read") == 1


def test_reader_without_verify_is_still_protected_by_the_daemon_on_get(
    sidecar: Sidecar,
) -> None:
    """A streaming reader that skips its own check still never gets a corrupt block:
    the daemon verifies before it sends."""
    ch = chain()
    keys = ch.keys(prompt(2, 1))
    sidecar.c.store(ch.tenant, blocks_for(keys))
    flip_payload(sidecar, keys[0], at=0)
    with SidecarClient(sidecar.running.socket_path) as streaming:
        assert streaming.get(ch.tenant, keys[0], verify=False) is None
    assert sidecar.c.lookup(ch.tenant, keys) == 0


def test_truncated_segment_is_a_miss_plus_cleanup_and_the_daemon_keeps_serving(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(capacity_bytes=512 * 1024, segment_bytes=256 * 1024)
    ch = chain()
    keys = ch.keys(prompt(8, 1))
    sc.c.store(ch.tenant, blocks_for(keys))
    path, offset = segment_path(sc, keys[5])
    assert all(segment_path(sc, k)[0] == path for k in keys)
    os.truncate(path, offset + 300)  # block 5 loses its tail, 6 and 7 everything
    with sc.c.load(ch.tenant, keys) as got:
        assert len(got) == 5
        assert_prefix(keys, got.keys, got.arrays)
    assert sc.c.lookup(ch.tenant, keys) == 5
    assert sc.metric(FAILURES, where="read") >= 1
    with SidecarClient(sc.running.socket_path) as streaming:
        assert streaming.get(ch.tenant, keys[5]) is None
        np.testing.assert_array_equal(streaming.get(ch.tenant, keys[4]), block_array(keys[4]))
    assert sc.c.healthy()
    # New writes still land somewhere readable and read back exactly.
    more = ch.keys(prompt(30, 9))
    stored = sc.c.store(ch.tenant, blocks_for(more))
    assert stored > 0
    with sc.c.load(ch.tenant, more) as got:
        assert len(got) == sc.c.lookup(ch.tenant, more) > 0
        assert_prefix(more, got.keys, got.arrays)
    assert sc.c.healthy()


def flip_while_stopped(sc: Sidecar, key: bytes, at: int) -> None:
    """Stops the daemon and flips the byte ``at`` bytes into ``key``'s extent."""
    path, offset = segment_path(sc, key)
    sc.stop()
    flip(path, offset + at)


def assert_one_dropped_at_start(sc: Sidecar, tenant: str, keys: list[bytes], kept: int) -> None:
    """The start found one bad block: it is counted, and the chain hits up to it."""
    assert sc.metric(FAILURES, where="start") == 1
    assert sc.c.stats().checksum_failures == 1
    assert sc.c.lookup(tenant, keys) == kept
    with sc.c.load(tenant, keys) as got:
        assert len(got) == kept
        assert_prefix(keys, got.keys, got.arrays)


def test_flipped_header_byte_is_dropped_and_counted_at_restart(sidecar: Sidecar) -> None:
    sc, ch = sidecar, chain()
    keys = ch.keys(prompt(4, 1))
    other = ch.keys(prompt(4, 2))
    sc.c.store(ch.tenant, blocks_for(keys) + blocks_for(other))
    flip_while_stopped(sc, keys[1], 40)  # inside the header's shape/size fields
    sc.start()
    with sc.c.load(ch.tenant, other) as got:
        assert len(got) == 4
        assert_prefix(other, got.keys, got.arrays)
    assert_one_dropped_at_start(sc, ch.tenant, keys, kept=1)


@pytest.mark.slow
def test_verify_on_start_full_catches_a_flipped_payload_byte(sidecar: Sidecar) -> None:
    sc, ch = sidecar, chain()
    keys = ch.keys(prompt(4, 1))
    sc.c.store(ch.tenant, blocks_for(keys))
    flip_while_stopped(sc, keys[2], HEADER_BYTES + 5)
    sc.start()  # the header check alone cannot see a payload byte
    assert sc.metric(FAILURES, where="start") == 0
    assert sc.c.lookup(ch.tenant, keys) == 4
    sc.stop()
    sc.kw["verify_on_start"] = "full"
    sc.start()
    assert_one_dropped_at_start(sc, ch.tenant, keys, kept=2)
