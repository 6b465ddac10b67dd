"""KV events: a router subscribed to a sidecar learns exactly what its disk holds.

A real daemon publishes on loopback ZeroMQ sockets; the subscriber is the one a
router runs (``kvevents_helpers.Subscriber``). What it learns from the events
(holdings first, then each store, eviction, delete and cleared tenant) must equal
the store's own index, with each block's token ids; replays fill gaps, a gap older
than the buffer brings the whole holdings again, a restarted sidecar announces what
survived on disk, and with an internal token only a subscriber that logs in with it
hears anything.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import pytest
from dscache_sidecar import kvevents
from dscache_sidecar.client import BlockData
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.kvevents import (
    MAX_EVENT_BLOCKS,
    KVEventPublisher,
    _Change,
    removed_events,
    stored_events,
)
from kvevents import Subscriber
from sidecar_helpers import BLOCK_TOKENS, Sidecar, block_array, chain, prompt

EVENTS = {
    "kv_events_endpoint": "tcp://127.0.0.1:*",
    "kv_events_replay_endpoint": "tcp://127.0.0.1:*",
    "kv_events_batch_s": 0.01,
}


def _subscribe(sc: Sidecar, password: str | None = None) -> Subscriber:
    pub = sc.running.kv_events if sc.running is not None else None
    assert pub is not None
    return Subscriber(pub.endpoint, pub.replay_endpoint, password)


def _store(sc: Sidecar, seed: int, n_blocks: int = 3, tenant: str = "tenant-a") -> list[bytes]:
    """Stores a chain with its token ids; returns its keys."""
    ch = chain(tenant)
    ids = prompt(n_blocks, seed)
    keys = ch.keys(ids)
    blocks = [
        BlockData(
            k,
            keys[i - 1] if i else b"",
            block_array(k),
            token_ids=ids[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS],
        )
        for i, k in enumerate(keys)
    ]
    assert sc.c.store(ch.tenant, blocks) == n_blocks
    return keys


def _index(sc: Sidecar) -> set[bytes]:
    with sc.store.scan_keys() as (_n, keys):
        return set(keys)


def _eventually(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _agrees(sub: Subscriber, sc: Sidecar) -> Callable[[], bool]:
    return lambda: set(sub.holdings.blocks) == _index(sc)


def test_a_subscriber_learns_the_holdings_and_every_change(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(**EVENTS)
    early = _store(sc, seed=1)
    sub = _subscribe(sc)
    try:
        # Stored before it subscribed: the replay from 0 brings the start-up holdings
        # (empty) and the first chain.
        assert sub.replay(0) is not None
        assert sub.poll(_agrees(sub, sc)) and set(sub.holdings.blocks) == set(early)
        assert sub.events()[0] == {"type": "AllBlocksCleared"}

        later = _store(sc, seed=2, n_blocks=4)
        assert sub.poll(lambda: set(later) <= set(sub.holdings.blocks))
        ids = prompt(4, 2)
        for i, key in enumerate(later):
            parent, tokens = sub.holdings.blocks[key]
            assert parent == (later[i - 1] if i else None)
            assert tokens == ids[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        stored = [e for e in sub.events() if e["type"] == "BlockStored"]
        assert stored[-1]["block_hashes"] == later  # one event for the whole chain
        assert stored[-1]["medium"] == "STORAGE" and stored[-1]["block_size"] == BLOCK_TOKENS

        # A delete takes the block's descendants too: the events say so.
        assert sc.c.delete(chain().tenant, [later[1]]) == 3
        assert sub.poll(lambda: later[1] not in sub.holdings.blocks)
        assert sub.poll(_agrees(sub, sc)) and later[0] in sub.holdings.blocks

        assert sc.c.clear_tenant(chain().tenant) == len(early) + 1
        assert sub.poll(lambda: not sub.holdings.blocks)
        assert _eventually(
            lambda: sc.metric("dscache_sidecar_kv_events_total", type="BlockRemoved") >= 2
        )
    finally:
        sub.close()


def test_evictions_reach_the_subscriber(make_sidecar: Callable[..., Sidecar]) -> None:
    # 1 MiB of 4 KiB blocks: 40 chains of 8 blocks are far more than it holds.
    sc = make_sidecar(**EVENTS)
    sub = _subscribe(sc)
    try:
        assert sub.replay(0) is not None
        for seed in range(40):
            _store(sc, seed=100 + seed, n_blocks=8)
        assert sc.metric("dscache_sidecar_evictions_total", reason="capacity") > 0
        assert sub.poll(_agrees(sub, sc)), "the subscriber's picture differs from the index"
        assert len(sub.holdings.blocks) < 320
    finally:
        sub.close()


def test_a_restarted_sidecar_announces_what_survived_with_its_tokens(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(**EVENTS)
    keys = _store(sc, seed=7, n_blocks=5)
    untokened = chain().keys(prompt(2, 8))
    sc.c.store(
        chain().tenant,
        [BlockData(k, untokened[0] if i else b"", block_array(k)) for i, k in enumerate(untokened)],
    )
    sc.restart()
    sub = _subscribe(sc)
    try:
        assert sub.replay(0) is not None
        assert sub.poll(_agrees(sub, sc)) and set(keys + untokened) == set(sub.holdings.blocks)
        ids = prompt(5, 7)
        assert sub.holdings.blocks[keys[4]] == (keys[3], ids[4 * BLOCK_TOKENS :])
        # Blocks stored without tokens are named by key, with no tokens.
        assert sub.holdings.blocks[untokened[1]] == (untokened[0], [])
        assert sc.metric("dscache_sidecar_kv_event_resyncs_total", reason="start") == 1
    finally:
        sub.close()


def test_a_gap_older_than_the_buffer_brings_the_whole_holdings(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(**EVENTS, kv_events_buffer_batches=2)
    held: list[bytes] = []
    for seed in range(4):  # a batch each: the start's batch leaves the buffer
        sent = sc.metric("dscache_sidecar_kv_event_batches_total", how="publish")
        held += _store(sc, seed=20 + seed)
        assert _eventually(
            lambda sent=sent: (
                sc.metric("dscache_sidecar_kv_event_batches_total", how="publish") > sent
            )
        )
    pub = sc.running.kv_events if sc.running is not None else None
    assert pub is not None
    sub, bystander = _subscribe(sc), _subscribe(sc)
    try:
        # The last batch (numbers count the batches published from 0), still buffered.
        last = int(sc.metric("dscache_sidecar_kv_event_batches_total", how="publish")) - 1
        assert bystander.replay(last) == [last]
        # Batch 0 (the start) left the buffer long ago: the whole holdings answer,
        # numbered with the last batch published, to this subscriber alone.
        got = sub.replay(0)
        assert got is not None and len(set(got)) == 1
        assert sub.events()[0] == {"type": "AllBlocksCleared"}
        assert set(sub.holdings.blocks) == set(held)
        assert sub.next_seq == bystander.next_seq
        assert sc.metric("dscache_sidecar_kv_event_resyncs_total", reason="replay_gap") == 1
        assert not bystander.poll(lambda: False, timeout_s=0.3)
        assert all(e["type"] != "AllBlocksCleared" for e in bystander.events())
        # A replay within the buffer is served from it, no resync.
        assert sub.replay(sub.next_seq - 1) == [sub.next_seq - 1]
        assert sc.metric("dscache_sidecar_kv_event_resyncs_total", reason="replay_gap") == 1
        # The stream goes on where the holdings left off.
        more = _store(sc, seed=29)
        assert sub.poll(lambda: set(more) <= set(sub.holdings.blocks))
        assert sub.poll(_agrees(sub, sc))
    finally:
        sub.close()
        bystander.close()


def test_holdings_in_many_batches_reach_a_late_subscriber_whole(
    make_sidecar: Callable[..., Sidecar], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvevents, "MAX_BATCH_EVENTS", 2)  # a chain per event, two a batch
    sc = make_sidecar(**EVENTS, kv_events_buffer_batches=2)
    held = [k for seed in range(7) for k in _store(sc, seed=50 + seed, n_blocks=2)]
    assert _eventually(
        lambda: sc.metric("dscache_sidecar_kv_event_batches_total", how="publish") >= 4
    )
    sub = _subscribe(sc)
    try:
        got = sub.replay(0)  # older than the buffer: the holdings, in 4 batches of one number
        assert got is not None and len(got) == 4 and len(set(got)) == 1
        assert set(sub.holdings.blocks) == set(held)
    finally:
        sub.close()


@pytest.mark.slow  # waits out the strangers' silence
def test_with_a_token_only_a_subscriber_that_logs_in_hears_anything(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar(**EVENTS, internal_token="s3cret-token")
    strangers = [_subscribe(sc), _subscribe(sc, password="wrong")]
    member = _subscribe(sc, password="s3cret-token")
    try:
        assert member.replay(0) is not None
        keys = _store(sc, seed=30)
        assert member.poll(lambda: set(keys) <= set(member.holdings.blocks))
        for stranger in strangers:
            assert stranger.replay(0, timeout_s=1.0) is None
            assert not stranger.poll(lambda: False, timeout_s=0.5) and not stranger.seen
    finally:
        for s in [*strangers, member]:
            s.close()


def test_changes_past_a_full_queue_are_replaced_by_a_resync(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sc = make_sidecar()
    keys = _store(sc, seed=40)
    pub = KVEventPublisher(
        sc.store, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", sc.running.metrics, max_queue=1
    )
    try:
        # Two changes before the thread runs: the second finds the queue full.
        ghost = hashlib.sha256(b"never stored").digest()
        pub.offer(_Change(0, stored_events([(_rec(ghost, b""), b"")])))
        pub.offer(_Change(0, removed_events(keys)))
        assert sc.metric("dscache_sidecar_kv_event_drops_total") == 1
        pub.start()
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        try:
            assert sub.replay(0) is not None
            assert sub.poll(_agrees(sub, sc))
            # What was queued before the resync is not told after it: the resync is
            # the truth (the ghost block would have been a lie).
            assert sub.poll(lambda: False, timeout_s=0.3) is False
            assert set(sub.holdings.blocks) == set(keys)
        finally:
            sub.close()
    finally:
        pub.stop()


def _rec(key: bytes, parent: bytes) -> BlockRecord:
    return BlockRecord(key, 0, 0, 4096, 4096, 4096, 0, 0, 0, (1,), b"t" * 16, parent, 0)


def test_a_chain_is_one_event_and_a_branch_starts_another() -> None:
    k = [hashlib.sha256(bytes([i])).digest() for i in range(5)]
    tok = [bytes(range(8 * i, 8 * i + 8)) for i in range(4)] + [b""]
    blocks = [(_rec(k[0], b""), tok[0]), (_rec(k[1], k[0]), tok[1]), (_rec(k[2], k[1]), tok[2])]
    blocks += [(_rec(k[3], k[0]), tok[3]), (_rec(k[4], k[3]), tok[4])]
    events = stored_events(blocks)
    assert [e["block_hashes"] for e in events] == [k[:3], [k[3]], [k[4]]]
    assert [e["parent_block_hash"] for e in events] == [None, k[0], k[3]]
    assert events[0]["token_ids"] == [
        int.from_bytes(t[i : i + 4], "little") for t in tok[:3] for i in (0, 4)
    ]
    assert [e["block_size"] for e in events] == [2, 2, 0]
    # A long chain is cut into events of at most MAX_EVENT_BLOCKS blocks, each
    # naming the last block of the one before as its parent.
    chain_keys = [hashlib.sha256(b"%d" % i).digest() for i in range(MAX_EVENT_BLOCKS + 1)]
    long_chain = [
        (_rec(key, chain_keys[i - 1] if i else b""), b"") for i, key in enumerate(chain_keys)
    ]
    cut = stored_events(long_chain)
    assert [len(e["block_hashes"]) for e in cut] == [MAX_EVENT_BLOCKS, 1]
    assert cut[1]["parent_block_hash"] == chain_keys[MAX_EVENT_BLOCKS - 1]
