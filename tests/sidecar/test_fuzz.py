"""Fuzzed requests never kill the daemon or get INTERNAL; random operation
sequences never return bytes that differ from what was stored for a key."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from dscache_sidecar.client import BlockData, SidecarFullError
from hypothesis import given, settings
from hypothesis import strategies as st
from sidecar_helpers import BLOCK_SHAPE, Sidecar, block_array, chain, prompt

from dscache.v1 import kvcache_pb2 as pb
from dscache.v1 import kvcache_pb2_grpc as pb_grpc

NORMAL = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
}
TENANT = chain().tenant
SMALL = {"capacity_bytes": 256 * 1024, "segment_bytes": 128 * 1024}

u32 = st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.integers(0, 1 << 20), st.integers(0, 2**64 - 1))
keys_st = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40))
tenant_st = st.one_of(st.just(TENANT), st.just(""), st.text(max_size=300))
dtype_st = st.one_of(
    st.sampled_from(["float32", "float16", "bfloat16", "int8", "uint8", "float8_e4m3fn"]),
    st.text(max_size=12),
)
codec_st = st.one_of(st.sampled_from([0, 1]), st.integers(2, 2**31 - 1))


@st.composite
def info_st(draw: st.DrawFn) -> pb.BlockInfo:
    """Mostly consistent block descriptions, then perturbed field by field."""
    shape = draw(st.lists(st.integers(1, 64), min_size=1, max_size=4))
    n = int(np.prod(shape))
    info = pb.BlockInfo(dtype="float32", shape=shape, raw_bytes=4 * n, stored_bytes=4 * n)
    info.codec = draw(codec_st)
    if draw(st.booleans()):
        info.dtype = draw(dtype_st)
    if draw(st.booleans()):
        del info.shape[:]
        info.shape.extend(draw(st.lists(u32, max_size=8)))  # huge, zero, too many dims
    if draw(st.booleans()):
        info.raw_bytes = draw(u64)
    if draw(st.booleans()):
        info.stored_bytes = draw(u64)
    info.checksum = draw(u64)
    return info


new_block_st = st.builds(
    lambda key, parent, info: pb.NewBlock(key=key, parent=parent, info=info),
    keys_st,
    st.one_of(st.just(b""), keys_st),
    info_st(),
)
write_id_st = st.one_of(st.text(max_size=30), st.just(""))
chunk_st = st.builds(
    lambda header, data: (
        pb.PutChunk(header=header, data=data) if header else pb.PutChunk(data=data)
    ),
    st.one_of(
        st.none(),
        st.builds(lambda t, b: pb.PutHeader(tenant=t, block=b), tenant_st, new_block_st),
    ),
    st.binary(max_size=9000),
)

# (method, request) pairs for every RPC, unary requests as messages, Put as chunk lists.
calls_st = st.one_of(
    st.builds(
        lambda t, k, b: ("Lookup", pb.LookupRequest(tenant=t, keys=k, block_tokens=b)),
        tenant_st,
        st.lists(keys_st, max_size=5),
        u32,
    ),
    st.builds(
        lambda t, k, ttl, lid: (
            "Lease",
            pb.LeaseRequest(tenant=t, keys=k, ttl_ms=ttl, lease_id=lid),
        ),
        tenant_st,
        st.lists(keys_st, max_size=5),
        u32,
        write_id_st,
    ),
    st.builds(
        lambda lid, k: ("Release", pb.ReleaseRequest(lease_id=lid, corrupt_keys=k)),
        write_id_st,
        st.lists(keys_st, max_size=3),
    ),
    st.builds(
        lambda t, blocks, ttl: (
            "Allocate",
            pb.AllocateRequest(tenant=t, blocks=blocks, ttl_ms=ttl),
        ),
        tenant_st,
        st.lists(new_block_st, max_size=4),
        u32,
    ),
    st.builds(
        lambda ids, sums: (
            "Commit",
            pb.CommitRequest(
                writes=[
                    pb.Written(write_id=i, checksum=s) if s is not None else pb.Written(write_id=i)
                    for i, s in zip(ids, sums, strict=False)
                ]
            ),
        ),
        st.lists(write_id_st, max_size=4),
        st.lists(st.one_of(st.none(), u64), min_size=4, max_size=4),
    ),
    st.builds(lambda ids: ("Abort", pb.AbortRequest(write_ids=ids)), st.lists(write_id_st)),
    st.builds(lambda chunks: ("Put", chunks), st.lists(chunk_st, max_size=4)),
    st.builds(lambda t, k: ("Get", pb.GetRequest(tenant=t, key=k)), tenant_st, keys_st),
    st.builds(
        lambda t, k: ("Delete", pb.DeleteRequest(tenant=t, keys=k)),
        tenant_st,
        st.lists(keys_st, max_size=4),
    ),
    st.builds(lambda t: ("ClearTenant", pb.ClearTenantRequest(tenant=t)), tenant_st),
    st.just(("Stats", pb.StatsRequest())),
    st.builds(
        lambda t, k, n, firsts: (
            "Descendants",
            pb.DescendantsRequest(tenant=t, key=k, max_blocks=n, first_tokens=firsts),
        ),
        tenant_st,
        keys_st,
        u32,
        st.lists(u32, max_size=2000),  # over the daemon's bound too
    ),
)


def code_of(fn: Callable[[], Any]) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def call(stub: pb_grpc.KVCacheStub, method: str, request: Any) -> grpc.StatusCode:
    rpc = getattr(stub, method)
    if method == "Put":
        return code_of(lambda: rpc(iter(request), timeout=10))
    if method == "Get":
        return code_of(lambda: list(rpc(request, timeout=10)))
    return code_of(lambda: rpc(request, timeout=10))


def internal_errors(sc: Sidecar) -> float:
    total = 0.0
    for family in sc.running.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "dscache_sidecar_rpc_errors_total":
                total += sample.value if sample.labels.get("code") == "INTERNAL" else 0
    return total


@pytest.fixture
def sc(make_sidecar: Callable[..., Sidecar]) -> Sidecar:
    return make_sidecar(**SMALL)


@pytest.fixture
def channel(sc: Sidecar) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"unix:{sc.running.socket_path}") as ch:
        yield ch


def assert_still_serving(sc: Sidecar, seed: int) -> None:
    """No call got INTERNAL, and a chain still stores and loads back whole."""
    assert sc.c.healthy()
    assert internal_errors(sc) == 0
    ch = chain()
    keys = ch.keys(prompt(3, seed))
    blocks = [BlockData(k, keys[i - 1] if i else b"", block_array(k)) for i, k in enumerate(keys)]
    sc.c.store(ch.tenant, blocks)
    with sc.c.load(ch.tenant, keys) as got:
        assert got.keys == keys
        for key, arr in zip(keys, got.arrays, strict=True):
            np.testing.assert_array_equal(arr, block_array(key))


@pytest.mark.slow
def test_fuzzed_requests_get_normal_answers_and_never_kill_the_daemon(
    sc: Sidecar, channel: grpc.Channel
) -> None:
    stub = pb_grpc.KVCacheStub(channel)

    @settings(max_examples=150, deadline=None, database=None)
    @given(st.lists(calls_st, min_size=1, max_size=4))
    def run(calls: list[tuple[str, Any]]) -> None:
        for method, request in calls:
            code = call(stub, method, request)
            assert code in NORMAL, f"{method} -> {code}"
        assert sc.c.healthy()

    run()
    assert_still_serving(sc, 1)


def test_allocate_commit_with_wrong_ids_and_sums_is_never_internal(
    sc: Sidecar, channel: grpc.Channel
) -> None:
    """Real reservations committed with repeated, unknown and wrong-checksum ids."""
    stub = pb_grpc.KVCacheStub(channel)
    nbytes = int(np.prod(BLOCK_SHAPE)) * 4
    info = pb.BlockInfo(
        dtype="float32", shape=list(BLOCK_SHAPE), raw_bytes=nbytes, stored_bytes=nbytes
    )

    @settings(max_examples=60, deadline=None, database=None)
    @given(
        st.lists(st.binary(min_size=32, max_size=32), min_size=1, max_size=3, unique=True),
        st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), u64)), max_size=6),
        st.booleans(),
    )
    def run(keys: list[bytes], picks: list[tuple[int, int | None]], abort_first: bool) -> None:
        req = pb.AllocateRequest(
            tenant="fuzz", blocks=[pb.NewBlock(key=k, info=info) for k in keys]
        )
        slots = stub.Allocate(req, timeout=10).slots
        ids = [s.write_id for s in slots] + ["nope", ""]
        if abort_first:
            stub.Abort(pb.AbortRequest(write_ids=ids[:1]), timeout=10)
        writes = [
            pb.Written(write_id=ids[i % len(ids)], checksum=s)
            if s is not None
            else pb.Written(write_id=ids[i % len(ids)])
            for i, s in picks
        ]
        results = stub.Commit(pb.CommitRequest(writes=writes), timeout=10).results
        assert len(results) == len(writes)
        stub.Abort(pb.AbortRequest(write_ids=ids), timeout=10)
        stub.ClearTenant(pb.ClearTenantRequest(tenant="fuzz"), timeout=10)
        assert sc.c.stats().pending_writes == 0

    run()
    st_ = sc.c.stats()
    assert (st_.blocks, st_.used_bytes) == (0, 0), "reservations leaked space"
    assert_still_serving(sc, 2)


def test_malformed_wire_messages_are_invalid_argument(sc: Sidecar, channel: grpc.Channel) -> None:
    """Bytes that are not the request message (or carry bad UTF-8 in a string)."""
    methods = [
        "Lookup",
        "Lease",
        "Release",
        "Allocate",
        "Commit",
        "Abort",
        "Get",
        "Delete",
        "Descendants",
    ]
    unary = {
        m: channel.unary_unary(
            f"/dscache.v1.KVCache/{m}",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for m in methods
    }
    get = channel.unary_stream(
        "/dscache.v1.KVCache/Get", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    put = channel.stream_unary(
        "/dscache.v1.KVCache/Put", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    bad_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (tenant / lease_id / key), 2 bytes, not UTF-8
    for m, fn in unary.items():
        if m == "Get":
            code = code_of(lambda: list(get(b"\xff\xff\xff", timeout=10)))
        else:
            code = code_of(lambda fn=fn: fn(b"\xff\xff\xff", timeout=10))
        assert code is grpc.StatusCode.INVALID_ARGUMENT, m
    assert (
        code_of(lambda: unary["Lookup"](bad_utf8, timeout=10)) is grpc.StatusCode.INVALID_ARGUMENT
    )
    assert code_of(lambda: put(iter([b"\xff\xff"]), timeout=10)) is grpc.StatusCode.INVALID_ARGUMENT

    @settings(max_examples=100, deadline=None, database=None)
    @given(st.sampled_from(methods), st.binary(max_size=200))
    def run(method: str, raw: bytes) -> None:
        if method == "Get":
            code = code_of(lambda: list(get(raw, timeout=10)))
        else:
            code = code_of(lambda: unary[method](raw, timeout=10))
        assert code in NORMAL, f"{method} -> {code}"

    run()
    assert_still_serving(sc, 3)


# ---------------------------------------------------------------- model-based

TENANTS = [chain("tenant-a"), chain("tenant-b")]
CHAINS = [[tc.keys(prompt(4, 10 * t + s)) for s in range(6)] for t, tc in enumerate(TENANTS)]

op_st = st.one_of(
    st.tuples(
        st.just("store"), st.integers(0, 1), st.integers(0, 5), st.integers(1, 4), st.integers(0, 3)
    ),
    st.tuples(st.just("load"), st.integers(0, 1), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("get"), st.integers(0, 1), st.integers(0, 5), st.integers(0, 3)),
    st.tuples(st.just("delete"), st.integers(0, 1), st.integers(0, 5), st.integers(0, 3)),
    st.tuples(st.just("clear"), st.integers(0, 1)),
)


def versioned(key: bytes, v: int) -> np.ndarray:
    return block_array(key) + np.float32(v)


@pytest.mark.slow
def test_random_operations_never_return_other_bytes_than_stored(sc: Sidecar) -> None:
    """Against a model: for each key, the versions it may hold (stores add one,
    delete/clear empty it; eviction may drop any). Reads must match one of them,
    and a key with none must not be found, by its tenant or any other."""
    c = sc.c

    def check(t: int, key: bytes, arr: np.ndarray, may: dict[bytes, set[int]]) -> None:
        assert may.get(key), "a deleted or never-stored key was returned"
        assert any(np.array_equal(arr, versioned(key, v)) for v in may[key]), "wrong bytes"

    @settings(max_examples=40, deadline=None, database=None)
    @given(st.lists(op_st, max_size=25))
    def run(ops: list[tuple[Any, ...]]) -> None:
        for tc in TENANTS:
            c.clear_tenant(tc.tenant)
        may: dict[bytes, set[int]] = {}
        for op in ops:
            t, keys = op[1], CHAINS[op[1]][op[2]] if len(op) > 2 else []
            tenant = TENANTS[t].tenant
            if op[0] == "store":
                n, v = op[3], op[4]
                blocks = [
                    BlockData(k, keys[i - 1] if i else b"", versioned(k, v))
                    for i, k in enumerate(keys[:n])
                ]
                for k in keys[:n]:
                    may.setdefault(k, set()).add(v)
                with contextlib.suppress(SidecarFullError):
                    c.store(tenant, blocks)
            elif op[0] == "load":
                with c.load(tenant, keys, verify=op[3]) as got:
                    assert got.keys == keys[: len(got)]
                    for k, arr in zip(got.keys, got.arrays, strict=True):
                        check(t, k, arr, may)
                other = TENANTS[1 - t].tenant
                assert c.lookup(other, keys) == 0, "another tenant's blocks were visible"
            elif op[0] == "get":
                arr = c.get(tenant, keys[op[3]])
                if arr is not None:
                    check(t, keys[op[3]], arr, may)
            elif op[0] == "delete":
                c.delete(tenant, [keys[op[3]]])
                for k in keys[op[3] :]:  # the block and its descendants
                    may.pop(k, None)
            else:
                c.clear_tenant(tenant)
                for chain_keys in CHAINS[t]:
                    for k in chain_keys:
                        may.pop(k, None)
            for chain_keys in CHAINS[0] + CHAINS[1]:
                hits = c.lookup(TENANTS[0 if chain_keys in CHAINS[0] else 1].tenant, chain_keys)
                assert all(may.get(k) for k in chain_keys[:hits]), "lookup found a deleted key"

    run()
    assert sc.c.stats().checksum_failures == 0
    assert internal_errors(sc) == 0
