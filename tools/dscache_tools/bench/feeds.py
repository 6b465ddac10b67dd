"""How a router learns what a pod holds: KV events against holdings filters, side by side.

Part of ``dscache bench router``. One real sidecar child (``dscache sidecar`` with
``--kv-events-endpoint``, a 64 MiB sparse store) takes chains of blocks at a steady
rate (each chain a new conversation's prefix, with its token ids, through the real
gRPC client), and two observers watch it at the same time, as a router would:

* ``events``: a ZeroMQ SUB socket on the sidecar's KV events (vLLM's format),
  decoding every batch;
* ``filters``: the picker's way: ``GET /dscache/holdings`` every second with
  ``If-None-Match`` (the sidecar rebuilds its filter every 2 s when the index
  changed), testing the chains' keys in each new filter.

For every chain, the staleness is the time from its store call to the observer
first knowing every block of it; the bytes are what each observer read
(event payloads; filter bodies), per second of the run. Ratios are
filters / events in one run, so the machine's speed cancels.

JSON (``feeds`` in the router bench's): ``chains``, ``blocks_per_chain``,
``duration_s``, ``events`` and ``filters`` (each ``staleness_p50_ms``,
``staleness_p99_ms``, ``bytes_per_s``, ``missed``: chains never seen by the end),
``staleness_p50_ratio``, ``bytes_ratio``.
"""

from __future__ import annotations

import hashlib
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import zmq
from dscache_sidecar.client import BlockData, SidecarClient
from dscache_sidecar.holdings import HOLDINGS_PATH, HoldingsFilter

from dscache_tools.net import free_port
from dscache_tools.sidecarproc import SidecarProcess

#: Tokens per block and blocks per chain: 256-token blocks, a 1k-token prefix.
BLOCK_TOKENS = 256
BLOCKS_PER_CHAIN = 4
#: The picker's filter refresh (its default), and the sidecar's rebuild period.
FILTER_POLL_S = 1.0
SIDECAR_REFRESH_S = 2.0


@dataclass
class _Observer:
    """When each key became known, and the bytes read to know it."""

    known: dict[bytes, float] = field(default_factory=dict)
    bytes_read: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _events(endpoint: str, obs: _Observer, stop: threading.Event) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        while not stop.is_set():
            if not sub.poll(50):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            now = time.monotonic()
            _ts, events, _rank = msgspec.msgpack.decode(payload)
            with obs.lock:
                obs.bytes_read += len(payload)
                for event in events:
                    if event["type"] == "BlockStored":
                        for key in event["block_hashes"]:
                            obs.known.setdefault(key, now)
    finally:
        sub.close()
        ctx.term()


def _filters(url: str, keys: list[bytes], obs: _Observer, stop: threading.Event) -> None:
    etag: str | None = None
    with httpx.Client(timeout=5.0) as client:
        while not stop.wait(FILTER_POLL_S):
            resp = client.get(url, headers={"If-None-Match": etag} if etag else {})
            now = time.monotonic()
            with obs.lock:
                obs.bytes_read += len(resp.content)
            if resp.status_code != 200:
                continue
            etag = resp.headers.get("ETag")
            bloom = HoldingsFilter.from_bytes(resp.content)
            with obs.lock:
                wanted = list(keys)  # the chains stored so far
                for key in wanted:
                    if key not in obs.known and key in bloom:
                        obs.known[key] = now


def _chain(seed: int) -> tuple[list[bytes], list[list[int]]]:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 100_000, BLOCK_TOKENS).tolist() for _ in range(BLOCKS_PER_CHAIN)]
    keys: list[bytes] = []
    for block in ids:
        parent = keys[-1] if keys else b"root"
        keys.append(hashlib.sha256(parent + np.asarray(block, "<u4").tobytes()).digest())
    return keys, ids


def _summary(
    obs: _Observer, chains: list[tuple[float, list[bytes]]], duration: float
) -> dict[str, Any]:
    stale: list[float] = []
    missed = 0
    for stored_at, keys in chains:
        seen = [obs.known.get(k) for k in keys]
        if any(t is None for t in seen):
            missed += 1
            continue
        stale.append(1000 * (max(t for t in seen if t is not None) - stored_at))
    arr = np.asarray(stale) if stale else np.asarray([np.nan])
    return {
        "staleness_p50_ms": round(float(np.percentile(arr, 50)), 2),
        "staleness_p99_ms": round(float(np.percentile(arr, 99)), 2),
        "bytes_per_s": round(obs.bytes_read / duration, 1),
        "missed": missed,
    }


def run_feeds(quick: bool) -> dict[str, Any]:
    """Runs the sidecar and both observers; the ``feeds`` part of the router bench."""
    rate = 10.0  # chains a second: 40 blocks a second, a busy pod's new prefixes
    duration = 6.0 if quick else 30.0
    n = int(rate * duration)
    chains = [_chain(i) for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="dscache-bench-feeds-") as tmp:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        side = SidecarProcess(
            Path(tmp) / "store",
            "--capacity", "64MiB", "--segment-size", "16MiB", "--segment-init", "sparse",
            "--holdings-refresh", str(SIDECAR_REFRESH_S), "--kv-events-endpoint", endpoint,
        )  # fmt: skip
        side.start()
        events, filters = _Observer(), _Observer()
        all_keys: list[bytes] = []
        stop = threading.Event()
        url = f"http://127.0.0.1:{side.http_port}{HOLDINGS_PATH}"
        threads = [
            threading.Thread(target=_events, args=(endpoint, events, stop), daemon=True),
            threading.Thread(target=_filters, args=(url, all_keys, filters, stop), daemon=True),
        ]
        try:
            for t in threads:
                t.start()
            time.sleep(0.5)  # the subscriber joins (a PUB drops what precedes it)
            stored: list[tuple[float, list[bytes]]] = []
            arr = np.zeros((2, 16), dtype=np.float32)  # 128 B blocks: the store is not the subject
            with SidecarClient(side.socket, data_dir=str(side.data_dir)) as client:
                start = time.monotonic()
                for i, (keys, ids) in enumerate(chains):
                    time.sleep(max(0.0, start + i / rate - time.monotonic()))
                    blocks = [
                        BlockData(k, keys[j - 1] if j else b"", arr, token_ids=ids[j])
                        for j, k in enumerate(keys)
                    ]
                    began = time.monotonic()
                    client.store("bench", blocks)
                    stored.append((began, keys))
                    with filters.lock:
                        all_keys.extend(keys)
            # Long enough for the last chains to reach a filter too.
            time.sleep(SIDECAR_REFRESH_S + 2 * FILTER_POLL_S)
            elapsed = time.monotonic() - start
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
            side.stop()
    ev, fi = _summary(events, stored, elapsed), _summary(filters, stored, elapsed)
    return {
        "chains": n,
        "blocks_per_chain": BLOCKS_PER_CHAIN,
        "duration_s": round(elapsed, 1),
        "events": ev,
        "filters": fi,
        "staleness_p50_ratio": (
            round(fi["staleness_p50_ms"] / ev["staleness_p50_ms"], 1)
            if ev["staleness_p50_ms"] > 0
            else None
        ),
        "bytes_ratio": round(fi["bytes_per_s"] / ev["bytes_per_s"], 2)
        if ev["bytes_per_s"]
        else None,
    }


def feeds_table(doc: dict[str, Any]) -> str:
    """Two rows: events and filters."""
    lines = [
        f"holdings feeds ({doc['chains']} chains of {doc['blocks_per_chain']} blocks over "
        f"{doc['duration_s']} s): {'staleness P50':>14} {'P99':>9} {'bytes/s':>10} {'missed':>7}"
    ]
    for name in ("events", "filters"):
        r = doc[name]
        lines.append(
            f"{name:>52} {r['staleness_p50_ms']:>11.1f} ms {r['staleness_p99_ms']:>6.1f} ms "
            f"{r['bytes_per_s']:>10.0f} {r['missed']:>7}"
        )
    ratios = f"staleness P50 {doc['staleness_p50_ratio']}x, bytes {doc['bytes_ratio']}x"
    lines.append(f"filters / events: {ratios}")
    return "\n".join(lines)
