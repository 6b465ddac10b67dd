"""``dscache bench store``: the store's write and read paths against baselines.

Everything is measured in one run on the same bytes: a KV of ``tokens`` tokens in
the GQA geometry 12 layers x 4 KV heads x 64 dims x fp32 (24,576 B/token), cut into
256-token blocks. Each figure is the median of ``repeat`` runs, reported in seconds
and as a ratio to its baseline from the same run:

    writes: torch.save (first baseline), raw write() into a preallocated file
    reads:  warm torch.load (first baseline), memcpy of the same bytes

The zero-copy read is timed until every page of every tensor has been touched.
The daemon runs as its own process on a temp dir (as beside a model server),
reached over its real unix socket. Lookups are timed both ways on a 32-block
prefix: over gRPC (``lookup_p99_ms``) and as the model server does them, reading
the daemon's LMDB index in this process without a round trip
(``direct_lookup_p99_ms``).

``eviction``: each eviction policy's cost per block access, in the store's own hot
path (lease, release, put; real LMDB and segment files) and alone
(:mod:`dscache_tools.bench.evictioncost`), as a ratio to LRU's in the same run
(``ratios.chain_store_access_vs_lru``; the target is 2x at most).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from dscache_sidecar.client import RAW, BlockData, LoadedBlocks, SidecarClient

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt
from dscache_tools.bench import evictioncost
from dscache_tools.sidecarproc import SidecarProcess

LAYOUT = KVLayout(
    LayoutKind.GQA, num_layers=12, dtype="float32", num_kv_heads=4, head_dim=64, v_head_dim=64
)
BLOCK_TOKENS = 256
PAGE = 4096


def _median(
    fn: Callable[[], object], repeat: int, setup: Callable[[], object] | None = None
) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _touch_pages(arrays: list[Any]) -> int:
    """Reads one byte per 4 KiB page of each array (forces every page in)."""
    total = 0
    for arr in arrays:
        flat = arr.reshape(-1).view(np.uint8) if isinstance(arr, np.ndarray) else arr
        total += int(flat[::PAGE].sum())
    return total


def _baselines(arrays: list[np.ndarray], repeat: int, data_dir: Path) -> dict[str, float]:
    """torch.save/torch.load of the blocks, memcpy and raw write() of their bytes."""
    import torch

    tensors = [torch.from_numpy(a) for a in arrays]
    flat = np.concatenate([a.reshape(-1) for a in arrays]).view(np.uint8)
    pt = data_dir / "kv.pt"

    def save() -> None:
        torch.save(tensors, pt)

    def load() -> None:
        loaded = torch.load(pt, weights_only=True)
        _touch_pages([t.numpy() for t in loaded])

    out = {"torch_save_s": _median(save, repeat)}
    load()  # warm: the file is in the page cache
    out["torch_load_s"] = _median(load, repeat)
    dst = np.empty_like(flat)
    out["memcpy_s"] = _median(lambda: np.copyto(dst, flat), repeat)
    fd = os.open(data_dir / "raw.bin", os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, flat.nbytes)
    flat_buf: Any = flat

    def raw_write() -> None:
        view = memoryview(flat_buf)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)

    try:
        out["raw_write_s"] = _median(raw_write, repeat)
    finally:
        os.close(fd)
    return out


class _Chains:
    """Fresh key chains over the same block arrays (each call: new keys)."""

    def __init__(self, arrays: list[np.ndarray], tokens: int) -> None:
        fp = ModelFingerprint("bench", "0", LAYOUT, block_tokens=BLOCK_TOKENS)
        self.chain = KeyChain(fp, tenant_salt("bench"))
        self.tenant = self.chain.tenant
        self._arrays = arrays
        self.tokens = tokens
        self._made = 0

    def fresh(self) -> list[BlockData]:
        self._made += 1
        toks = np.arange(self.tokens, dtype=np.int64) + self._made * self.tokens
        keys = self.chain.keys(toks)
        return [
            BlockData(k, keys[i - 1] if i else b"", self._arrays[i]) for i, k in enumerate(keys)
        ]


def _time_write(client: SidecarClient, chains: _Chains, repeat: int) -> float:
    pending: list[list[BlockData]] = []
    n_blocks = chains.tokens // BLOCK_TOKENS

    def do_write() -> None:
        stored = client.store(chains.tenant, pending.pop(), RAW)
        assert stored == n_blocks, stored

    return _median(do_write, repeat, setup=lambda: pending.append(chains.fresh()))


def _time_zero_copy(
    client: SidecarClient, tenant: str, keys: list[bytes], repeat: int
) -> tuple[float, float]:
    """Zero-copy reads without and with checksums (seconds)."""
    import torch

    held: list[LoadedBlocks] = []

    def zero_copy(verify: bool) -> Callable[[], None]:
        # Timed: Lease, views on the mapping, tensors, every page touched. The
        # Release after use is not part of the read (see release_held).
        def read() -> None:
            loaded = client.load(tenant, keys, verify=verify)
            held.append(loaded)
            assert len(loaded) == len(keys)
            with warnings.catch_warnings():  # read-only views, only read: as the server
                warnings.simplefilter("ignore", UserWarning)
                views = [torch.from_numpy(a) for a in loaded.arrays]
            _touch_pages([v.numpy() for v in views])

        return read

    def release_held() -> None:
        while held:
            held.pop().release()

    zero_copy(False)()  # the first map of the segments (and its page faults) happens here
    release_held()
    plain = _median(zero_copy(False), repeat, setup=release_held)
    verified = _median(zero_copy(True), repeat, setup=release_held)
    release_held()
    return plain, verified


def _lookup_ms(
    lookup: Callable[[str, list[bytes]], int], chains: _Chains, calls: int = 2000
) -> np.ndarray:
    """Latencies of ``lookup`` on a stored 32-block prefix, in milliseconds."""
    prefix = chains.chain.keys(np.arange(32 * BLOCK_TOKENS, dtype=np.int64))
    if lookup(chains.tenant, prefix) != len(prefix):
        raise RuntimeError("the 32-block lookup prefix is not stored")
    lat = []
    for _ in range(calls):
        start = time.perf_counter()
        lookup(chains.tenant, prefix)
        lat.append(time.perf_counter() - start)
    return np.array(lat) * 1000


def _lookup_by(client: SidecarClient, *, direct: bool) -> Callable[[str, list[bytes]], int]:
    """``client.find`` that insists on one path: the index (``direct``) or gRPC."""

    def lookup(tenant: str, keys: list[bytes]) -> int:
        answer = client.find(tenant, keys)
        if answer.direct != direct:
            raise RuntimeError(f"lookup took the other path (direct={answer.direct})")
        return answer.found

    return lookup


def _dscache(arrays: list[np.ndarray], tokens: int, repeat: int, data_dir: Path) -> dict[str, Any]:
    """The daemon as its own process, reached over its real unix socket."""
    kv_bytes = sum(a.nbytes for a in arrays)
    store_dir = data_dir / "store"
    capacity = max(4 * kv_bytes, 256 * 1024**2)
    daemon = SidecarProcess(store_dir, "--capacity", str(capacity), "--segment-size", "128MiB")
    daemon.start()
    client = SidecarClient(daemon.socket, data_dir=str(store_dir), timeout_s=5)
    streamer = SidecarClient(daemon.socket, timeout_s=5)
    chains = _Chains(arrays, tokens)
    try:
        out: dict[str, Any] = {"write_s": _time_write(client, chains, repeat)}
        blocks = chains.fresh()
        client.store(chains.tenant, blocks, RAW)
        keys = [b.key for b in blocks]
        out["zero_copy_read_s"], out["zero_copy_read_verified_s"] = _time_zero_copy(
            client, chains.tenant, keys, repeat
        )

        def stream() -> None:
            with streamer.load(chains.tenant, keys) as loaded:
                assert len(loaded) == len(keys)
                _touch_pages(loaded.arrays)

        out["stream_get_s"] = _median(stream, max(3, repeat // 2))
        lookup_blocks = chains.chain.keys(np.arange(32 * BLOCK_TOKENS, dtype=np.int64))
        lookup_arrays = [arrays[i % len(arrays)] for i in range(len(lookup_blocks))]
        client.store(
            chains.tenant,
            [
                BlockData(k, lookup_blocks[i - 1] if i else b"", lookup_arrays[i])
                for i, k in enumerate(lookup_blocks)
            ],
            RAW,
        )
        lat_ms = _lookup_ms(_lookup_by(streamer, direct=False), chains)
        out["lookup_p50_ms"] = float(np.percentile(lat_ms, 50))
        out["lookup_p99_ms"] = float(np.percentile(lat_ms, 99))
        direct_ms = _lookup_ms(_lookup_by(client, direct=True), chains)
        out["direct_lookup_p50_ms"] = float(np.percentile(direct_ms, 50))
        out["direct_lookup_p99_ms"] = float(np.percentile(direct_ms, 99))
    finally:
        client.close()
        streamer.close()
        daemon.stop()
    return out


def run(tokens: int, repeat: int, data_dir: Path) -> dict[str, Any]:
    """Runs every measurement; returns the JSON-ready results."""
    n_blocks = tokens // BLOCK_TOKENS
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, BLOCK_TOKENS, LAYOUT.head_dim)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(n_blocks)]
    r: dict[str, Any] = {
        "kv_bytes": sum(a.nbytes for a in arrays),
        "tokens": tokens,
        "blocks": n_blocks,
        "block_tokens": BLOCK_TOKENS,
        "repeat": repeat,
        **_baselines(arrays, repeat, data_dir),
        **_dscache(arrays, tokens, repeat, data_dir),
        "eviction": evictioncost.measure(data_dir, min(repeat, 3)),
    }
    r["ratios"] = {
        "write_vs_torch_save": r["torch_save_s"] / r["write_s"],
        "write_vs_raw_write": r["raw_write_s"] / r["write_s"],
        "zero_copy_read_vs_torch_load": r["torch_load_s"] / r["zero_copy_read_s"],
        "zero_copy_read_verified_vs_torch_load": r["torch_load_s"] / r["zero_copy_read_verified_s"],
        "stream_get_vs_torch_load": r["torch_load_s"] / r["stream_get_s"],
        "zero_copy_read_vs_memcpy": r["memcpy_s"] / r["zero_copy_read_s"],
        "direct_lookup_p99_vs_rpc": r["lookup_p99_ms"] / r["direct_lookup_p99_ms"],
        "chain_store_access_vs_lru": r["eviction"]["policies"]["chain"]["store_access_vs_lru"],
    }
    return r


def format_table(r: dict[str, Any]) -> str:
    """The results as an aligned text table."""
    q = r["ratios"]
    rows = [
        ("torch.save (write baseline)", r["torch_save_s"], "1.00x"),
        ("raw write()", r["raw_write_s"], f"{r['torch_save_s'] / r['raw_write_s']:.2f}x"),
        ("dscache write (Allocate/Commit)", r["write_s"], f"{q['write_vs_torch_save']:.2f}x"),
        ("warm torch.load (read baseline)", r["torch_load_s"], "1.00x"),
        ("memcpy", r["memcpy_s"], f"{r['torch_load_s'] / r['memcpy_s']:.2f}x"),
        (
            "dscache zero-copy read",
            r["zero_copy_read_s"],
            f"{q['zero_copy_read_vs_torch_load']:.2f}x",
        ),
        (
            "dscache zero-copy read + checksum",
            r["zero_copy_read_verified_s"],
            f"{q['zero_copy_read_verified_vs_torch_load']:.2f}x",
        ),
        ("dscache streaming Get", r["stream_get_s"], f"{q['stream_get_vs_torch_load']:.2f}x"),
    ]
    mib = r["kv_bytes"] / 2**20
    lines = [
        f"KV: {r['tokens']} tokens, {mib:.0f} MiB, {r['blocks']} blocks; median of {r['repeat']}",
        f"{'path':<36} {'seconds':>10} {'speed vs baseline':>18}",
    ]
    lines += [f"{name:<36} {sec:>10.4f} {ratio:>18}" for name, sec, ratio in rows]
    lines.append(f"write / raw write(): {r['ratios']['write_vs_raw_write']:.2f}x")
    lines.append(
        f"Lookup (32 blocks) over gRPC: p50 {r['lookup_p50_ms']:.3f} ms, "
        f"p99 {r['lookup_p99_ms']:.3f} ms; direct from the index (no RPC): "
        f"p50 {r['direct_lookup_p50_ms']:.4f} ms, p99 {r['direct_lookup_p99_ms']:.4f} ms "
        f"({r['ratios']['direct_lookup_p99_vs_rpc']:.0f}x faster at p99)"
    )
    ev = r["eviction"]
    lines.append(
        f"Eviction cost per block access ({ev['requests']} requests through a "
        f"{ev['store_blocks']}-block store, best of runs):"
    )
    for name, v in ev["policies"].items():
        alone_us = v["policy_access_ns"] / 1000
        lines.append(
            f"  {name:<8} store {v['store_access_us']:7.1f} us "
            f"({v['store_access_vs_lru']:.2f}x lru)  policy alone {alone_us:7.2f} us "
            f"({v['policy_access_vs_lru']:.1f}x lru)"
        )
    return "\n".join(lines)


def run_cli(args: argparse.Namespace) -> int:
    """``dscache bench store``."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError:
        print("dscache bench store needs torch: pip install 'dscache[bench]'")
        return 2
    if args.tokens < BLOCK_TOKENS or args.repeat < 1:
        print(f"--tokens must be >= {BLOCK_TOKENS} and --repeat >= 1")
        return 2
    with tempfile.TemporaryDirectory(dir=args.data_dir) as tmp:
        results = run(args.tokens, max(args.repeat, 5), Path(tmp))
    print(format_table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0
