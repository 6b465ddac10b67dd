"""Eviction policies: documented orders, scan resistance and exact bookkeeping."""

from __future__ import annotations

from typing import Any

import pytest
from dscache_sidecar.chain import ChainPolicy, ReuseModel
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


# -- the chain policy: structure, signals, learning


class FakeClock:
    """A settable clock for time-aware policies (fakes only time, nothing else)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def admit_chain(policy: Any, keys: list[str], parent: str | None = None) -> None:
    """Admits a chain deepest first, as the store's commit does."""
    for i in reversed(range(len(keys))):
        policy.admit(keys[i], 1, keys[i - 1] if i else parent)


def test_chain_policy_never_evicts_a_parent_before_its_children() -> None:
    clock = FakeClock()
    policy: ChainPolicy[str] = ChainPolicy(100, clock=clock)
    admit_chain(policy, ["r", "a1", "a2", "a3"])
    clock.now += 500
    admit_chain(policy, ["b1", "b2"], parent="r")  # newer branch under the old root
    clock.now += 500
    held = {"r", "a1", "a2", "a3", "b1", "b2"}
    children = {"r": {"a1", "b1"}, "a1": {"a2"}, "a2": {"a3"}, "b1": {"b2"}}
    order = []
    while (v := policy.victim()) is not None:
        assert not children.get(v, set()) & held, f"{v} left before its children"
        held.discard(v)
        order.append(v)
    assert order[-1] == "r" and len(order) == 6


def test_chain_policy_ended_conversation_goes_first_and_queued_stays() -> None:
    clock = FakeClock()
    policy: ChainPolicy[str] = ChainPolicy(100, clock=clock)
    admit_chain(policy, ["sys"])
    for conv in ("a", "b", "c"):
        admit_chain(policy, [f"{conv}{i}" for i in range(4)], parent="sys")
        clock.now += 1
    # Signals change the order: b ended (its own blocks, not the shared "sys"),
    # a's next request is queued.
    assert policy.signal(["sys", "b0", "b1", "b2", "b3"], "ended") == 4
    assert policy.signal(["sys", "a0", "a1", "a2", "a3"], "queued", ttl_s=30) == 5
    victims = [policy.victim() for _ in range(8)]
    assert victims[:4] == ["b3", "b2", "b1", "b0"]
    assert set(victims[4:]) == {"c3", "c2", "c1", "c0"}
    # Only the queued chain (and its shared root) is left; once its window ran out
    # it can go.
    clock.now += 31
    assert policy.victim() == "a3"


def test_chain_policy_queued_chain_is_released_by_its_use() -> None:
    clock = FakeClock()
    policy: ChainPolicy[str] = ChainPolicy(100, clock=clock)
    admit_chain(policy, ["x0", "x1"])
    admit_chain(policy, ["y0", "y1"])
    policy.signal(["x0", "x1"], "queued")
    assert policy.victim() == "y1"
    clock.now += 5
    policy.access("x1")  # the queued request was served
    policy.access("x0")
    assert [policy.victim(), policy.victim()] == ["y0", "x1"]


def test_chain_policy_rejects_unknown_signals() -> None:
    policy: ChainPolicy[str] = ChainPolicy(10)
    with pytest.raises(ValueError, match="unknown signal 'bye'"):
        policy.signal(["a"], "bye")
    with pytest.raises(ValueError, match="ttl_s"):
        policy.signal(["a"], "queued", ttl_s=-1)
    assert policy.signal(["not-held"], "ended") == 0


def test_reuse_model_ranks_a_class_that_comes_back_above_one_that_does_not() -> None:
    model = ReuseModel(classes=2)
    assert model.density(0, 1.0) > model.density(0, 100.0) > 0  # the prior: LRU-like
    for _ in range(200):
        model.observe(0, 90.0)  # class 0: back after about 90 s
        model.never(1)  # class 1: never back
    model.refresh()
    assert model.density(0, 30.0) > 10 * model.density(1, 30.0)


forest_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "access", "remove", "victim", "tick"]),
        st.integers(0, 20),
        st.integers(-1, 20),
    ),
    max_size=200,
)


@settings(max_examples=80, deadline=None)
@given(ops=forest_ops)
def test_chain_policy_victims_are_always_leaves(ops: list[tuple[str, int, int]]) -> None:
    """Any admit order, removals and time: a victim never has a held child."""
    clock = FakeClock()
    policy: ChainPolicy[int] = ChainPolicy(8, clock=clock, samples=4)
    parent_of: dict[int, int | None] = {}
    held: set[int] = set()
    for op, key, parent in ops:
        if op == "admit" and key not in held:
            p = parent if 0 <= parent != key else None
            parent_of[key] = p
            policy.admit(key, 1, p)
            held.add(key)
        elif op == "access":
            policy.access(key)
        elif op == "remove":
            policy.remove(key)
            held.discard(key)
        elif op == "tick":
            clock.now += key
        else:
            v = policy.victim()
            if not held:
                assert v is None
                continue
            assert v in held
            kids = {k for k in held if parent_of.get(k) == v and k != v}
            # a child admitted after its parent (or while it was held) is a leaf first
            assert not kids or all(parent_of.get(v) == k for k in kids), (v, kids)
            held.discard(v)
        assert len(policy) == len(held)


def test_chain_policy_history_is_bounded_for_a_big_store() -> None:
    """A 4 TB store of 1 MiB blocks: the ghost list and the shadow LRU stay bounded
    (the shadow follows a hashed sample of the keys), whatever the hint."""
    policy: ChainPolicy[int] = ChainPolicy(4 * 2**20)
    assert policy._ghost_max == 2**20
    assert policy._shadow_max * policy._sample == 4 * 2**20
    assert policy._shadow_max == 2**18
    policy.resize(1000)
    assert policy._sample == 1 and policy._shadow_max == 1000
