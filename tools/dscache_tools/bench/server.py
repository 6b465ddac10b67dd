"""``dscache bench ttft``: time to first token, full prefill vs cache hit vs floor.

For each context length ``C`` the prompt is ``C`` tokens of history plus
``--new-tokens`` new ones (``C`` is rounded down to whole blocks). Three figures,
each a median (``--repeat`` full prefills, ``--hit-repeat`` hit/floor pairs), measured
in one process and one run:

* ``full_prefill_s``: prefill of the whole prompt, then the first token;
* ``hit_s``: the model server's cache-hit path on its engine thread (``Batcher``),
  through the real sidecar daemon (started here as a subprocess on a temp dir):
  block keys, the index lookup, Lease + mmap (zero copy), prefill of the new
  tokens over the mapped blocks while their checksums are checked, first token;
* ``in_memory_s``: the same new-token prefill with the same blocks already in
  process memory (the floor the cache can approach).

Every figure is a ratio to a baseline of the same run: ``full_prefill_s / hit_s``
(speed-up) and ``hit_s / in_memory_s`` (cost of the cache over the floor).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dscache_server.admission import CostModel
from dscache_server.batcher import Batcher
from dscache_server.cache import PrefixCache
from dscache_server.engine import TransformersEngine
from dscache_server.generate import GenerationRequest, SamplingParams
from dscache_server.kvstore import SidecarBlockStore
from dscache_server.loading import load_engine
from dscache_server.metrics import ServerMetrics
from dscache_server.tokenizer import DeepSeekTokenizer

from dscache.keys import KeyChain, tenant_salt
from dscache_tools.bench import report
from dscache_tools.sidecarproc import SidecarProcess

log = logging.getLogger(__name__)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_context(
    engine: TransformersEngine,
    cache: PrefixCache,
    batcher: Batcher,
    *,
    context: int,
    new_tokens: int,
    repeat: int,
    hit_repeat: int = 9,
    seed: int,
) -> dict[str, Any]:
    """The three figures for one context length."""
    bt = engine.adapter.block_tokens
    context = max(bt, context // bt * bt)
    rng = np.random.default_rng(seed)
    ids = [int(t) for t in rng.integers(2, 120_000, size=context + new_tokens)]
    chain = KeyChain(engine.fingerprint, tenant_salt(f"bench-{seed}"))
    assert cache.store is not None

    def full() -> int:
        return int(torch.argmax(engine.forward(engine.new_sequence(), ids)))

    # Store the history once (untimed) and keep private copies for the floor.
    seq = engine.new_sequence()
    engine.forward(seq, ids[:context])
    cache.store_async(chain, ids[:context], seq, 0)
    if not cache.wait_stored(600):
        raise RuntimeError("storing the history did not finish")
    blocks = [engine.adapter.export(seq, i) for i in range(context // bt)]
    del seq
    keys = chain.keys(ids[:context])
    if cache.store.lookup(chain.tenant, keys) != len(keys):
        raise RuntimeError("the sidecar did not keep every block (capacity too small?)")

    cache_ops: list[float] = []

    def hit() -> int:
        # The server's own path, on its engine thread: restore, prefill the rest while
        # the checksums are checked, wait for them, sample the first token.
        req = GenerationRequest(ids, SamplingParams(max_tokens=1, temperature=0.0), chain)
        result = batcher.run(req)
        t = result.timings
        cache_ops.append(t["lookup"] + t["lease"] + t["map_verify"])
        if result.cached_tokens != context:
            raise RuntimeError(f"hit path restored {result.cached_tokens} of {context} tokens")
        return result.token_ids[0] if result.token_ids else -1

    def in_memory() -> int:
        s = engine.new_sequence()
        engine.adapter.restore(s, blocks)
        return int(torch.argmax(engine.forward(s, ids[context:])))

    first_hit = _timed(hit)
    fulls = [_timed(full) for _ in range(repeat)]
    hits: list[float] = []
    mems: list[float] = []
    # The cheap pair runs more often, interleaved and in alternating order, so load
    # drift on a shared machine hits both alike; medians over all runs.
    for i in range(max(repeat, hit_repeat)):
        if i % 2:
            mems.append(_timed(in_memory))
            hits.append(_timed(hit))
        else:
            hits.append(_timed(hit))
            mems.append(_timed(in_memory))
    f, h, m = statistics.median(fulls), statistics.median(hits), statistics.median(mems)
    return {
        "context": context,
        "new_tokens": new_tokens,
        "prompt_tokens": context + new_tokens,
        "full_prefill_s": f,
        "hit_s": h,
        "in_memory_s": m,
        "hit_first_s": first_hit,
        "hit_cache_ops_s": statistics.median(cache_ops[1:] or cache_ops),
        "full_over_hit": f / h,
        "hit_over_in_memory": h / m,
        "kv_bytes": context * engine.layout.bytes_per_token(),
        "runs": {"full_prefill_s": fulls, "hit_s": hits, "in_memory_s": mems},
    }


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark; returns the JSON document."""
    contexts = [int(c) for c in str(args.context).split(",") if c.strip()]
    if args.repeat < 3:
        raise ValueError("--repeat must be >= 3 (medians of at least three runs)")
    engine = load_engine(
        args.model, block_tokens=args.block_tokens, threads=args.threads, dtype=args.dtype
    )
    tmp = tempfile.TemporaryDirectory(prefix="dscache-bench-")
    data_dir = Path(args.data_dir) if args.data_dir else Path(tmp.name) / "data"
    daemon = SidecarProcess(data_dir, "--capacity", args.capacity)

    def make_store() -> SidecarBlockStore:
        return SidecarBlockStore(daemon.socket, data_dir=str(data_dir), timeout_s=5.0)

    try:
        daemon.start()
        always = CostModel(1.0, 1e12, 0.0, 1)
        metrics = ServerMetrics()
        cache = PrefixCache(make_store(), engine.adapter, metrics, always, min_tokens=0)
        tokenizer = DeepSeekTokenizer()
        batcher = Batcher(engine, tokenizer, cache, metrics, prefill_chunk=1 << 30)
        results = []
        for i, context in enumerate(contexts):
            log.info("context %d ...", context)
            row = bench_context(
                engine,
                cache,
                batcher,
                context=context,
                new_tokens=args.new_tokens,
                repeat=args.repeat,
                hit_repeat=args.hit_repeat,
                seed=i,
            )
            log.info(
                "context %d: full %.3fs hit %.3fs floor %.3fs",
                row["context"],
                row["full_prefill_s"],
                row["hit_s"],
                row["in_memory_s"],
            )
            results.append(row)
        batcher.close()
        cache.close()
    finally:
        daemon.stop()
        tmp.cleanup()
    return {
        "benchmark": "ttft",
        "model": args.model,
        "layout": engine.layout.to_dict(),
        "block_tokens": args.block_tokens,
        "threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "hit_repeat": max(args.repeat, args.hit_repeat),
        "dtype": engine.layout.dtype,
        "results": results,
    }


def format_table(doc: dict[str, Any]) -> str:
    """A plain-text table of the results."""
    head = (
        f"{'context':>8} {'full_prefill_s':>15} {'hit_s':>9} {'in_memory_s':>12} "
        f"{'full/hit':>9} {'hit/in_mem':>11}"
    )
    title = f"ttft on {doc['model']} ({doc['threads']} threads, medians of {doc['repeat']})"
    rows = [
        f"{r['context']:>8} {r['full_prefill_s']:>15.3f} {r['hit_s']:>9.3f} "
        f"{r['in_memory_s']:>12.3f} {r['full_over_hit']:>9.1f} {r['hit_over_in_memory']:>11.3f}"
        for r in doc["results"]
    ]
    return "\n".join([title, head, *rows])


def run_cli(args: argparse.Namespace) -> int:
    """Entry point of ``dscache bench ttft``."""
    return report(
        "ttft",
        lambda: run_bench(args),
        format_table,
        args.json_out,
        (ValueError, RuntimeError),
    )
