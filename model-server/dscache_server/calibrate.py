"""Start-up calibration of the store-vs-recompute cost model.

Measures, once per start: prefill tokens/s of this engine on this machine, and the
cost of restoring blocks through the real store (lookup + lease + map + first touch
of every byte), using a calibration tenant whose blocks never mix with real ones.
Each figure is the median of :data:`REPEATS` runs after a warm-up run, so one
slow first call (a gRPC channel connecting, a page-cache miss, a neighbour pod
starting on the same cores) cannot switch admission off for the pod's lifetime.
A store that is down gives conservative defaults, logged; calibration never stops
the server from starting.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from dscache.keys import KeyChain, tenant_salt
from dscache_server.admission import CostModel
from dscache_server.engine import Engine
from dscache_server.kv import LayoutAdapter
from dscache_server.kvstore import CacheError, KVBlockStore, NewBlock

log = logging.getLogger(__name__)

CALIBRATION_TENANT = "dscache/calibration"
DEFAULT_LOAD_BYTES_PER_S = 1e9
DEFAULT_LOOKUP_OVERHEAD_S = 0.002
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
#: Timed runs per figure (after one untimed warm-up run); the median is kept.
REPEATS = 5


def _median_seconds(run: Callable[[], object], repeats: int = REPEATS) -> float:
    """Median wall time of ``repeats`` calls of ``run``, after one untimed warm-up call."""
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def measure_prefill(engine: Engine, tokens: int = 256, seed: int = 0) -> float:
    """Prefill tokens per second on a random prompt of ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(2, 100_000, size=tokens)]
    return tokens / _median_seconds(lambda: engine.forward(engine.new_sequence(), ids))


def _touch(arr: np.ndarray) -> None:
    """Reads every byte of a loaded block once: its page faults are part of the cost.
    float32 as a float sum; other dtypes as bytes (numpy's float16 arithmetic is
    software, and would be taken for a slow cache)."""
    if arr.dtype == np.float32:
        float(arr.sum())
    else:  # as wide words: a bytewise sum runs at a tenth of the speed
        int(arr.view(np.uint64 if arr.nbytes % 8 == 0 else np.uint8).sum())


def _random_block(adapter: LayoutAdapter, rng: np.random.Generator) -> np.ndarray:
    """A block of normal values in the engine's KV dtype (bfloat16 as its uint16 bits)."""
    x = torch.from_numpy(rng.standard_normal(adapter.block_shape, dtype=np.float32))
    x = x.to(adapter.torch_dtype)
    if adapter.torch_dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def measure_load(engine: Engine, store: KVBlockStore, blocks: int = 2) -> tuple[float, float]:
    """(load bytes/s, lookup + lease overhead s) through ``store``.

    Raises:
        CacheError: the store is not usable.
    """
    adapter = engine.adapter
    chain = KeyChain(engine.fingerprint, tenant_salt(CALIBRATION_TENANT))
    rng = np.random.default_rng(1)
    ids = [int(t) for t in rng.integers(2, 100_000, size=blocks * adapter.block_tokens)]
    keys = chain.keys(ids)
    arrays = [_random_block(adapter, rng) for _ in range(blocks)]
    store.store(
        chain.tenant,
        [
            NewBlock(k, keys[i - 1] if i else b"", a, adapter.layout.dtype)
            for i, (k, a) in enumerate(zip(keys, arrays, strict=True))
        ],
    )

    # Overhead: a lookup and a lease of one block; throughput: all blocks, touched.
    def lease_one() -> None:
        store.lookup(chain.tenant, keys[:1])
        store.load(chain.tenant, keys[:1], ttl_s=5.0).release()

    nbytes = 0

    def load_all() -> None:
        nonlocal nbytes
        found = store.lookup(chain.tenant, keys)
        loaded = store.load(chain.tenant, keys[:found], ttl_s=5.0)
        try:
            nbytes = sum(int(a.nbytes) for a in loaded.arrays)
            for a in loaded.arrays:
                _touch(np.asarray(a))
        finally:
            loaded.release()

    overhead = _median_seconds(lease_one)
    elapsed = _median_seconds(load_all)
    if nbytes == 0:
        raise CacheError("error", "calibration blocks were not stored")
    # Loading n blocks costs the overhead once plus their bytes; what the whole load
    # took beyond one block's round trip is what the bytes cost (at least 10% of it,
    # so a noisy overhead can never make reading free).
    return nbytes / max(elapsed - overhead, elapsed / 10), overhead


def calibrate(
    engine: Engine,
    store: KVBlockStore | None,
    *,
    prefill_tokens_per_s: float | None = None,
    load_bytes_per_s: float | None = None,
    lookup_overhead_s: float | None = None,
    measure: bool = True,
) -> CostModel:
    """Builds the cost model: configured values win, then measurements, then defaults."""
    prefill = prefill_tokens_per_s
    if prefill is None:
        prefill = measure_prefill(engine) if measure else DEFAULT_PREFILL_TOKENS_PER_S
    load, overhead = load_bytes_per_s, lookup_overhead_s
    if (load is None or overhead is None) and measure and store is not None:
        try:
            measured_load, measured_overhead = measure_load(engine, store)
            load = load if load is not None else measured_load
            overhead = overhead if overhead is not None else measured_overhead
        except CacheError as exc:
            log.warning("cache calibration failed (%s); using defaults", exc)
    model = CostModel(
        prefill_tokens_per_s=prefill,
        load_bytes_per_s=load if load is not None else DEFAULT_LOAD_BYTES_PER_S,
        lookup_overhead_s=overhead if overhead is not None else DEFAULT_LOOKUP_OVERHEAD_S,
        bytes_per_token=engine.adapter.layout.bytes_per_token(),
    )
    log.info(
        "cost model: prefill %.0f tokens/s, load %.0f MB/s, overhead %.1f ms, crossover %s tokens",
        model.prefill_tokens_per_s,
        model.load_bytes_per_s / 1e6,
        model.lookup_overhead_s * 1e3,
        model.crossover_tokens(),
    )
    return model
