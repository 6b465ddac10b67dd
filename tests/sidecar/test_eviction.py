"""Eviction policies: documented orders, scan resistance and exact bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest
from dscache_sidecar.eviction import (
    DEFAULT_POLICY,
    POLICIES,
    EvictionPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

SCAN_RESISTANT = ["clock", "slru", "s3fifo", "arc"]


def run_cache(policy: EvictionPolicy[Any], capacity: int, keys: list[str]) -> list[str]:
    """A plain cache of ``capacity`` keys driven by ``policy``; returns the evictions."""
    evicted: list[str] = []
    for key in keys:
        if key in policy:
            policy.access(key)
            continue
        while len(policy) >= capacity:
            v = policy.victim()
            assert v is not None
            evicted.append(v)
        policy.admit(key)
    return evicted


def test_lru_evicts_least_recently_used() -> None:
    p: LRUPolicy[str] = LRUPolicy(3)
    for k in "abc":
        p.admit(k)
    p.access("a")
    assert [p.victim(), p.victim(), p.victim(), p.victim()] == ["b", "c", "a", None]
    assert len(p) == 0


def test_make_policy_names_known_policies_on_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"known policies: .*lru.*s3fifo"):
        make_policy("nope", 10)
    assert DEFAULT_POLICY in POLICIES
    for name in POLICIES:
        assert make_policy(name, 10).name == name


def test_negative_capacity_hint_is_rejected() -> None:
    with pytest.raises(ValueError, match="capacity_hint"):
        make_policy("lru", -1)


@pytest.mark.parametrize("name", SCAN_RESISTANT)
def test_frequently_hit_blocks_survive_a_scan(name: str) -> None:
    capacity = 20
    hot = [f"hot{i}" for i in range(4)]
    scan = [f"cold{i}" for i in range(2 * capacity)]
    policy = make_policy(name, capacity)
    run_cache(policy, capacity, hot * 4 + scan)
    assert all(k in policy for k in hot), f"{name} lost hot blocks to a one-pass scan"
    # LRU, for contrast, loses them all.
    lru = make_policy("lru", capacity)
    run_cache(lru, capacity, hot * 4 + scan)
    assert not any(k in lru for k in hot)


def test_s3fifo_one_hit_wonders_leave_first() -> None:
    capacity = 10
    p: S3FIFOPolicy[str] = S3FIFOPolicy(capacity)
    # "reused" is hit while in the small queue, the others never are.
    evicted = run_cache(
        p, capacity, ["reused", "w0", "w1", "reused", *[f"w{i}" for i in range(2, 12)]]
    )
    assert "reused" in p
    assert evicted[:2] == ["w0", "w1"]


def test_s3fifo_ghost_readmission_goes_to_main() -> None:
    capacity = 10
    fillers = [f"f{i}" for i in range(12)]
    later = [f"g{i}" for i in range(12)]
    p: S3FIFOPolicy[str] = S3FIFOPolicy(capacity)
    evicted = run_cache(p, capacity, ["x", *fillers])
    assert evicted[0] == "x"  # never hit: leaves the small queue first, into the ghost
    run_cache(p, capacity, ["x", *later])
    assert "x" in p  # re-admitted from the ghost into main, outlives the newcomers
    # A key the ghost does not remember enters the small queue and is gone by now.
    q: S3FIFOPolicy[str] = S3FIFOPolicy(capacity)
    run_cache(q, capacity, [*fillers, "x", *later])
    assert "x" not in q


def test_slru_hit_block_outlives_older_never_hit_blocks() -> None:
    p = make_policy("slru", 10)
    p.admit("old-hit")
    for i in range(5):
        p.admit(f"n{i}")
    p.access("old-hit")
    victims = [p.victim() for _ in range(5)]
    assert victims == [f"n{i}" for i in range(5)]
    assert p.victim() == "old-hit"


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_chain_touched_deepest_first_leaves_deepest_first(name: str) -> None:
    """The prefix rule under the callers' protocol: children go before parents."""
    policy = make_policy(name, 100)
    chain = [f"b{i}" for i in range(6)]
    for i in reversed(range(len(chain))):  # admitted deepest first, with their parents
        policy.admit(chain[i], 1, chain[i - 1] if i else None)
    for key in reversed(chain):  # then a hit on the whole chain, deepest first
        policy.access(key)
    victims = [policy.victim() for _ in chain]
    assert victims == list(reversed(chain))


ops = st.lists(
    st.tuples(st.sampled_from(["admit", "access", "remove", "victim"]), st.integers(0, 15)),
    max_size=200,
)


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=80, deadline=None)
@given(ops=ops, hint=st.integers(0, 12))
def test_bookkeeping_matches_a_reference_set(
    name: str, ops: list[tuple[str, int]], hint: int
) -> None:
    policy = make_policy(name, hint)
    model: set[int] = set()
    for op, key in ops:
        if op == "admit":
            policy.admit(key)
            model.add(key)
        elif op == "access":
            policy.access(key)
        elif op == "remove":
            policy.remove(key)
            model.discard(key)
        else:
            v = policy.victim()
            if model:
                assert v in model, f"victim {v!r} not held (held: {sorted(model)})"
                model.remove(v)
            else:
                assert v is None
        assert len(policy) == len(model)
        for k in range(16):
            assert (k in policy) == (k in model)
    drained = []
    while (v := policy.victim()) is not None:
        drained.append(v)
    assert sorted(drained) == sorted(model)


@settings(max_examples=80, deadline=None)
@given(ops=ops)
def test_lru_victim_is_exactly_the_least_recent(ops: list[tuple[str, int]]) -> None:
    policy: LRUPolicy[int] = LRUPolicy(8)
    order: list[int] = []  # oldest first
    for op, key in ops:
        if op in ("admit", "access") and (op == "admit" or key in order):
            if key in order:
                order.remove(key)
            order.append(key)
            getattr(policy, op)(key)
        elif op == "access":
            policy.access(key)
        elif op == "remove":
            policy.remove(key)
            if key in order:
                order.remove(key)
        else:
            assert policy.victim() == (order.pop(0) if order else None)


def test_s3fifo_resizes_its_queues_to_the_capacity_estimate() -> None:
    from dscache_sidecar.eviction import Resizable, S3FIFOPolicy

    def first_victim(resize_to: int | None) -> int | None:
        policy: S3FIFOPolicy[int] = S3FIFOPolicy(capacity_hint=1000)
        assert isinstance(policy, Resizable)
        for k in range(10):
            policy.admit(k)
        policy.access(0)
        if resize_to is not None:
            policy.resize(resize_to)
        return policy.victim()

    # Under its size (600 of a 1000 hint) the small queue hands hit block 0 to main,
    # which then gives it up; resized to 10 blocks the small queue (6) is over its
    # size and its oldest never-hit block (1) leaves while 0 is protected.
    assert first_victim(None) == 0
    assert first_victim(10) == 1
