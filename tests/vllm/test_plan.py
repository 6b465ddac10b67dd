"""The scheduler side's bookkeeping: what is looked up, loaded and saved, and when."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from dscache_vllm.plan import Planner, Scheduled

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt

FP = ModelFingerprint(
    "m",
    "r",
    KVLayout(LayoutKind.GQA, 2, "float32", num_kv_heads=2, head_dim=64, v_head_dim=64),
    block_tokens=256,
)


class Store:
    """The store as the planner sees it: a set of (tenant, key)."""

    def __init__(self) -> None:
        self.held: set[tuple[str, bytes]] = set()
        self.fail = False
        self.lookups = 0

    def find(self, tenant: str, keys: Sequence[bytes]) -> int:
        self.lookups += 1
        if self.fail:
            raise ConnectionError("sidecar down")
        n = 0
        for k in keys:
            if (tenant, k) not in self.held:
                break
            n += 1
        return n


def chain(tenant: str) -> KeyChain:
    return KeyChain(FP, tenant_salt(tenant))


def planner(store: Store, page: int = 128) -> Planner:
    return Planner(chain, store.find, 256, page)


def tokens(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def hold(store: Store, tenant: str, toks: list[int], blocks: int) -> None:
    c = chain(tenant)
    for k in c.keys(toks)[:blocks]:
        store.held.add((c.tenant, k))


def test_block_must_be_a_multiple_of_the_page() -> None:
    with pytest.raises(ValueError, match="multiple"):
        Planner(chain, Store().find, 256, 96)


def test_hit_excludes_the_last_token_and_partial_blocks() -> None:
    store = Store()
    toks = tokens(768)  # exactly three blocks: the last token must be computed
    hold(store, "default", toks, 3)
    p = planner(store)
    assert p.matched("r1", toks, None, 0) == 512
    assert p.matched("r2", toks + [5], None, 0) == 768


def test_vllm_own_prefix_hit_is_not_loaded_again() -> None:
    store = Store()
    toks = tokens(1000)
    hold(store, "default", toks, 3)
    p = planner(store)
    assert p.matched("r", toks, None, 256) == 512
    assert p.matched("r", toks, None, 768) == 0


def test_a_failed_lookup_is_a_miss() -> None:
    store = Store()
    store.fail = True
    p = planner(store)
    assert p.matched("r", tokens(1000), None, 0) == 0
    assert p.lookup_failures == 1


def test_load_is_planned_once_after_allocation_with_the_right_pages() -> None:
    store = Store()
    toks = tokens(1000)
    hold(store, "default", toks, 3)
    p = planner(store)
    assert p.matched("r", toks, None, 128) == 640
    p.allocated("r", 640)
    pages = list(range(100, 108))
    plan = p.step([Scheduled("r", toks, 768, 232, pages, first=True)])
    (load,) = plan.loads
    assert load.first_page == 1 and load.page_ids == tuple(pages[1:6])
    assert load.first_block == 0 and len(load.keys) == 3
    # Found blocks are not saved again; the rest is not full yet.
    assert plan.saves == ()
    again = p.step([Scheduled("r", toks, 1000, 1, pages, first=False)])
    assert again.loads == ()


def test_no_load_when_vllm_allocates_nothing() -> None:
    store = Store()
    toks = tokens(1000)
    hold(store, "default", toks, 3)
    p = planner(store)
    p.matched("r", toks, None, 0)
    p.allocated("r", 0)
    assert p.step([Scheduled("r", toks, 0, 1000, list(range(8)), first=True)]).loads == ()


def test_each_block_is_saved_once_when_its_last_token_is_computed() -> None:
    store = Store()
    toks = tokens(700)
    p = planner(store)
    assert p.matched("r", toks, None, 0) == 0
    pages = list(range(10, 16))
    first = p.step([Scheduled("r", toks, 0, 300, pages, first=True)])
    (save,) = first.saves
    assert len(save.keys) == 1 and save.parents == (b"",) and save.page_ids == (10, 11)
    second = p.step([Scheduled("r", toks, 300, 400, pages, first=False)])
    (save2,) = second.saves
    assert save2.parents == (save.keys[0],) and save2.page_ids == (12, 13)
    assert save2.keys == tuple(chain("default").keys(toks)[1:2])
    assert p.step([Scheduled("r", toks, 700, 1, pages, first=False)]).saves == ()


def test_speculative_tokens_are_never_saved() -> None:
    p = planner(Store())
    toks = tokens(500)
    p.matched("r", toks, None, 0)
    # 500 known tokens; 20 scheduled drafts would reach 520 > 512.
    plan = p.step([Scheduled("r", toks, 499, 21, list(range(5)), first=False)])
    assert len(plan.saves[0].keys) == 1


def test_tenants_get_disjoint_keys() -> None:
    store = Store()
    toks = tokens(1000)
    hold(store, "alice", toks, 3)
    p = planner(store)
    assert p.matched("a", toks, "alice", 0) == 768
    assert p.matched("b", toks, "bob", 0) == 0
    p.matched("c", toks, None, 0)
    plan = p.step([Scheduled("b", toks, 0, 1000, list(range(8)), first=True)])
    assert not set(plan.saves[0].keys) & set(chain("alice").keys(toks))


def test_finished_requests_are_forgotten() -> None:
    p = planner(Store())
    p.matched("r", tokens(600), None, 0)
    p.finished("r")
    assert len(p) == 0
    assert p.step([Scheduled("r", tokens(600), 0, 600, list(range(5)), first=True)]).saves == ()


def shard_chains(tenant: str) -> tuple[KeyChain, ...]:
    """Two tensor-parallel ranks of a GQA model: one fingerprint each."""
    return tuple(
        KeyChain(dataclasses.replace(FP, tp_size=2, tp_rank=r), tenant_salt(tenant))
        for r in range(2)
    )


def test_each_shard_gets_its_own_keys_and_a_hit_needs_every_shard() -> None:
    store = Store()
    toks = tokens(1000)
    rank0, rank1 = shard_chains("default")
    for k in rank0.keys(toks):
        store.held.add((rank0.tenant, k))
    for k in rank1.keys(toks)[:1]:  # rank 1 holds only the first block
        store.held.add((rank1.tenant, k))
    p = Planner(shard_chains, store.find, 256, 128)
    assert p.matched("r", toks, None, 0) == 256  # what both ranks hold
    p.allocated("r", 256)
    plan = p.step([Scheduled("r", toks, 256, 1000 - 256, list(range(8)), True)])
    (load,) = plan.loads
    assert load.keys_for(0) == tuple(rank0.keys(toks)[:1])
    assert load.keys_for(1) == tuple(rank1.keys(toks)[:1])
    assert not set(rank0.keys(toks)) & set(rank1.keys(toks))
    (save,) = plan.saves
    assert save.keys_for(1) == (tuple(rank1.keys(toks)[1:3]), tuple(rank1.keys(toks)[0:2]))
    assert save.keys_for(0)[0] == tuple(rank0.keys(toks)[1:3])
