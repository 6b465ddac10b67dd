"""The eviction policies' cost per block access, for ``dscache bench store``.

Two measurements on the same request stream, each policy against LRU in the same run:

* ``store``: the store's own hot path in this process (``KVStore`` on real LMDB and
  segment files, no gRPC): every request leases the stored prefix of its
  conversation (an access per block), releases it, and puts its new blocks (an
  admit each, with evictions once the store is full). Seconds over block accesses
  and admits: what a block access costs the store with that policy.
* ``policy``: the policy alone, driven by the replayer's simulation of the same
  stream (no I/O): what the policy's own bookkeeping costs per call.

The stream: conversations of 4 KiB blocks (new ones start with probability 0.4,
else a recent one goes on with 1-6 new blocks), several times the store's
1,024 blocks, seeded. Each figure is the best of ``repeat`` runs (the noise of a
shared machine only ever adds time).
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from pathlib import Path
from typing import Any

import numpy as np

STORE_BLOCKS = 1024
BLOCK_SHAPE = (1024,)  # float32: 4 KiB
_TENANT = "bench-eviction"


def _stream(requests: int, seed: int = 0) -> list[list[bytes]]:
    """Each request's whole chain of keys (prefix order)."""
    rng = random.Random(seed)
    convs: list[list[bytes]] = []
    out: list[list[bytes]] = []
    for r in range(requests):
        if not convs or rng.random() < 0.4:
            convs.append([])
            conv = convs[-1]
        else:
            conv = convs[-rng.randint(1, min(len(convs), 60))]
        for i in range(rng.randint(1, 6)):
            conv.append(hashlib.sha256(f"{seed}/{r}/{i}".encode()).digest())
        out.append(list(conv))
    return out


def _store_seconds(policy: str, stream: list[list[bytes]], data_dir: Path) -> tuple[float, int]:
    from dscache_sidecar.blockstore import BlockSpec
    from dscache_sidecar.config import SidecarSettings
    from dscache_sidecar.segments import checksum
    from dscache_sidecar.store import KVStore

    data = np.random.default_rng(0).standard_normal(BLOCK_SHAPE, dtype=np.float32).tobytes()
    summed = checksum(data)
    settings = SidecarSettings(
        data_dir=data_dir,
        capacity_bytes=STORE_BLOCKS * 8192,
        segment_bytes=256 * 8192,
        policy=policy,
        durable=False,
        restart_quarantine_s=0,
        metrics_port=0,
    )
    store = KVStore(settings)
    quiet = logging.getLogger("dscache_sidecar.store")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # no "store open" line per run in the bench's output
    try:
        store.open(start_reaper=False)
    finally:
        quiet.setLevel(level)
    ops = 0
    try:
        start = time.perf_counter()
        for keys in stream:
            grant = store.lease(_TENANT, keys)
            if grant.lease_id:
                store.release(grant.lease_id)
            hit = len(grant.blocks)
            ops += hit
            for i in range(hit, len(keys)):
                spec = BlockSpec(
                    keys[i], keys[i - 1] if i else b"", 0, "float32", BLOCK_SHAPE, 4096, 4096
                )
                store.put(_TENANT, spec, data, summed)
                ops += 1
        return time.perf_counter() - start, ops
    finally:
        store.close()


def _policy_seconds(policy: str, stream: list[list[bytes]]) -> tuple[float, int]:
    from dscache_sidecar.eviction import CLOCKED, make_policy

    from dscache_tools.replay.simulate import TraceClock, simulate
    from dscache_tools.replay.trace import Request, build_trace

    intern: dict[bytes, int] = {}
    reqs = [
        Request([intern.setdefault(k, len(intern)) for k in keys], 16, 16, 16 * len(keys), t)
        for t, keys in enumerate(stream)
    ]
    trace = build_trace("bench", reqs)
    clock = TraceClock()
    p = make_policy(policy, STORE_BLOCKS, clock if policy in CLOCKED else None)
    start = time.perf_counter()
    simulate(trace, p, STORE_BLOCKS, clock=clock)
    return time.perf_counter() - start, trace.total_blocks


def measure(
    data_dir: Path, repeat: int, policies: tuple[str, ...] = ("lru", "chain")
) -> dict[str, Any]:
    """Per-access cost of each policy in the store and alone, and their ratios to LRU."""
    stream = _stream(1500)
    out: dict[str, Any] = {"store_blocks": STORE_BLOCKS, "requests": len(stream), "policies": {}}
    for name in policies:
        store_us = policy_ns = float("inf")
        for i in range(repeat):
            sec, ops = _store_seconds(name, stream, data_dir / f"evict-{name}-{i}")
            store_us = min(store_us, sec / ops * 1e6)
            sec, ops = _policy_seconds(name, stream)
            policy_ns = min(policy_ns, sec / ops * 1e9)
        out["policies"][name] = {"store_access_us": store_us, "policy_access_ns": policy_ns}
    base = out["policies"]["lru"]
    for v in out["policies"].values():
        v["store_access_vs_lru"] = v["store_access_us"] / base["store_access_us"]
        v["policy_access_vs_lru"] = v["policy_access_ns"] / base["policy_access_ns"]
    return out
