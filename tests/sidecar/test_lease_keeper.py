"""Leases that outlive the work: blocks in use stay leased past the lease's TTL.

The real daemon (in-process) and its real client: a reader holds mapped blocks far
longer than the lease it asked for while other writers fill the store several times
over. What a user would notice: the bytes under the reader's views never change
until it lets go, and when the daemon cannot extend a lease the reader is told,
instead of reading reused space.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from dscache_sidecar.faults import Faults
from sidecar_helpers import Sidecar, block_array, blocks_for, chain, prompt

pytestmark = pytest.mark.slow

TTL_S = 0.3


def _churn(s: Sidecar, nbytes: int, seconds: float) -> int:
    """Stores fresh blocks of another tenant until at least ``nbytes`` were written and
    at least ``seconds`` went by (the store is small: the space of whatever was freed
    is written over at once); returns how many. Bounded by volume and time, never by
    a rate, so a loaded machine only makes it take longer."""
    other = chain("churn")
    stored, seed = 0, 1000
    start = time.monotonic()
    while stored * 4096 < nbytes or time.monotonic() < start + seconds:
        if time.monotonic() > start + 120:  # a store that refuses everything
            break
        keys = other.keys(prompt(16, seed=seed))
        stored += s.c.store(other.tenant, blocks_for(keys))
        seed += 1
    return stored


def test_blocks_in_use_stay_leased_and_unchanged_past_the_ttl(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    s = make_sidecar(capacity_bytes=1024 * 1024, segment_bytes=128 * 1024)
    ch = chain()
    keys = ch.keys(prompt(6, seed=1))
    assert s.c.store(ch.tenant, blocks_for(keys)) == 6
    loaded = s.c.load(ch.tenant, keys, ttl_s=TTL_S)
    assert loaded.keys == keys
    time.sleep(3 * TTL_S)  # the work on the blocks outlasts the lease's TTL ...
    assert s.c.stats().active_leases == 1  # before: the lease had run out
    # ... and meanwhile the blocks are deleted and 4x the store is written anew.
    assert s.c.delete(ch.tenant, keys) == 6
    assert _churn(s, 4 * 1024 * 1024, 4 * TTL_S) * 4096 >= 4 * 1024 * 1024
    # Their space was not reused under the reader's views (before: every block read
    # another block's bytes).
    for key, arr in zip(keys, loaded.arrays, strict=True):
        np.testing.assert_array_equal(arr, block_array(key))
    assert not loaded.lapsed()
    assert loaded.held_until() > time.monotonic()
    loaded.release()
    assert s.c.stats().active_leases == 0


def test_a_lease_the_daemon_cannot_extend_is_reported_lapsed(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    s = make_sidecar(fault_injection=True)
    ch = chain()
    keys = ch.keys(prompt(2, seed=2))
    s.c.store(ch.tenant, blocks_for(keys))
    loaded = s.c.load(ch.tenant, keys, ttl_s=TTL_S)
    assert not loaded.lapsed()
    assert s.running is not None and s.running.faults is not None
    s.running.faults.set(Faults(delay_s=5.0))  # every call now outlasts its deadline
    try:
        lapsed = threading.Event()
        deadline = time.monotonic() + 10
        while not loaded.lapsed() and time.monotonic() < deadline:
            time.sleep(0.05)
        if loaded.lapsed():
            lapsed.set()
        assert lapsed.is_set(), "the reader was never told its lease ran out"
        assert loaded.held_until() <= time.monotonic()
    finally:
        s.running.faults.set(Faults())
        loaded.release()
