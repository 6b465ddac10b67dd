"""``dscache bench store``: the store's write and read paths against baselines.

Everything is measured in one run on the same bytes: a KV of ``tokens`` tokens in
the GQA geometry 12 layers x 4 KV heads x 64 dims x fp32 (24,576 B/token), cut into
256-token blocks. Each figure is the median of ``repeat`` runs, reported in seconds
and as a ratio to its baseline from the same run:

    writes: torch.save (first baseline), raw write() into a preallocated file
    reads:  warm torch.load (first baseline), memcpy of the same bytes

The zero-copy read is timed until every page of every tensor has been touched.
The daemon runs in this process on a temp dir, reached over its real unix socket.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from dscache_sidecar.client import BlockData, LoadedBlocks, SidecarClient
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.daemon import create_server
from dscache_sidecar.metrics import SidecarMetrics

from dscache.keys import KeyChain, KVLayout, LayoutKind, ModelFingerprint, tenant_salt

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


def run(tokens: int, repeat: int, data_dir: Path) -> dict[str, Any]:
    """Runs every measurement; returns the JSON-ready results."""
    import torch

    n_blocks = tokens // BLOCK_TOKENS
    shape = (LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, BLOCK_TOKENS, LAYOUT.head_dim)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape, dtype=np.float32) for _ in range(n_blocks)]
    tensors = [torch.from_numpy(a) for a in arrays]
    kv_bytes = sum(a.nbytes for a in arrays)
    flat = np.concatenate([a.reshape(-1) for a in arrays]).view(np.uint8)

    # -- baselines
    pt = data_dir / "kv.pt"

    def save() -> None:
        torch.save(tensors, pt)

    torch_save_s = _median(save, repeat)

    def load() -> None:
        loaded = torch.load(pt, weights_only=True)
        _touch_pages([t.numpy() for t in loaded])

    load()  # warm: the file is in the page cache
    torch_load_s = _median(load, repeat)
    dst = np.empty_like(flat)
    memcpy_s = _median(lambda: np.copyto(dst, flat), repeat)
    raw = data_dir / "raw.bin"
    fd = os.open(raw, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, kv_bytes)

    flat_buf: Any = flat

    def raw_write() -> None:
        view = memoryview(flat_buf)
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)

    raw_write_s = _median(raw_write, repeat)
    os.close(fd)

    # -- dscache, over the real unix socket
    settings = SidecarSettings(
        data_dir=data_dir / "store",
        capacity_bytes=max(4 * kv_bytes, 256 * 1024**2),
        segment_bytes=128 * 1024**2,
        metrics_port=None,
        restart_quarantine_s=0,
    )
    running = create_server(settings, SidecarMetrics())
    client = SidecarClient(running.socket_path, data_dir=str(settings.data_dir), timeout_s=5)
    streamer = SidecarClient(running.socket_path, timeout_s=5)
    try:
        fp = ModelFingerprint("bench", "0", LAYOUT, block_tokens=BLOCK_TOKENS)
        chain = KeyChain(fp, tenant_salt("bench"))
        counter = [0]

        def fresh_blocks() -> list[BlockData]:
            counter[0] += 1
            toks = np.arange(tokens, dtype=np.int64) + counter[0] * tokens
            keys = chain.keys(toks)
            return [BlockData(k, keys[i - 1] if i else b"", arrays[i]) for i, k in enumerate(keys)]

        pending: list[list[BlockData]] = []

        def prepare_write() -> None:
            pending.append(fresh_blocks())

        def do_write() -> None:
            stored = client.store(chain.tenant, pending.pop(), compress=False)
            assert stored == n_blocks, stored

        write_s = _median(do_write, repeat, setup=prepare_write)

        blocks = fresh_blocks()
        client.store(chain.tenant, blocks, compress=False)
        keys = [b.key for b in blocks]

        held: list[LoadedBlocks] = []

        def zero_copy(verify: bool) -> Callable[[], None]:
            # Timed: Lease, views on the mapping, tensors, every page touched. The
            # Release after use is not part of the read (see release_held).
            def read() -> None:
                loaded = client.load(chain.tenant, keys, verify=verify)
                held.append(loaded)
                assert len(loaded) == n_blocks
                views = [torch.from_numpy(a) for a in loaded.arrays]
                _touch_pages([v.numpy() for v in views])

            return read

        def release_held() -> None:
            while held:
                held.pop().release()

        zero_copy(False)()  # first map of the segments (MAP_POPULATE) happens here
        release_held()
        zero_copy_read_s = _median(zero_copy(False), repeat, setup=release_held)
        zero_copy_verified_s = _median(zero_copy(True), repeat, setup=release_held)
        release_held()

        def stream() -> None:
            with streamer.load(chain.tenant, keys) as loaded:
                assert len(loaded) == n_blocks
                _touch_pages(loaded.arrays)

        stream_get_s = _median(stream, max(3, repeat // 2))

        prefix = chain.keys(np.arange(32 * BLOCK_TOKENS, dtype=np.int64))
        client.lookup(chain.tenant, prefix)
        lat = []
        for _ in range(2000):
            start = time.perf_counter()
            client.lookup(chain.tenant, prefix)
            lat.append(time.perf_counter() - start)
        lat_ms = np.array(lat) * 1000
    finally:
        client.close()
        streamer.close()
        running.stop(grace_s=1)

    return {
        "kv_bytes": kv_bytes,
        "tokens": tokens,
        "blocks": n_blocks,
        "block_tokens": BLOCK_TOKENS,
        "repeat": repeat,
        "torch_save_s": torch_save_s,
        "torch_load_s": torch_load_s,
        "memcpy_s": memcpy_s,
        "raw_write_s": raw_write_s,
        "write_s": write_s,
        "zero_copy_read_s": zero_copy_read_s,
        "zero_copy_read_verified_s": zero_copy_verified_s,
        "stream_get_s": stream_get_s,
        "lookup_p50_ms": float(np.percentile(lat_ms, 50)),
        "lookup_p99_ms": float(np.percentile(lat_ms, 99)),
        "ratios": {
            "write_vs_torch_save": torch_save_s / write_s,
            "write_vs_raw_write": raw_write_s / write_s,
            "zero_copy_read_vs_torch_load": torch_load_s / zero_copy_read_s,
            "zero_copy_read_verified_vs_torch_load": torch_load_s / zero_copy_verified_s,
            "stream_get_vs_torch_load": torch_load_s / stream_get_s,
            "zero_copy_read_vs_memcpy": memcpy_s / zero_copy_read_s,
        },
    }


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
    lines.append(
        f"write / raw write(): {r['ratios']['write_vs_raw_write']:.2f}x   "
        f"Lookup (32 blocks) p50 {r['lookup_p50_ms']:.3f} ms, p99 {r['lookup_p99_ms']:.3f} ms"
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
