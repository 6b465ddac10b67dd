"""The worker side of the vLLM connector: loads before a forward, saves after it.

Contract:
    * :meth:`KVWorker.load` leases the planned blocks, checks their checksums
      (``verify="sync"``), copies the planned pages in and releases the lease. Pages
      it could not fill (a block evicted since the lookup, a checksum mismatch, the
      sidecar down) are returned: vLLM recomputes them
      (``kv_load_failure_policy="recompute"``), and the failure is counted. A load
      never raises.
    * :meth:`KVWorker.save` copies the blocks out of vLLM's pages at once (the pages
      may be reused after this step) and queues them; one writer thread stores them
      through the sidecar client. When the queue is full the blocks are dropped and
      counted: the forward pass never waits for the store.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from dscache_sidecar.client import BlockData, SidecarClient

from dscache_vllm.metrics import ConnectorMetrics
from dscache_vllm.paged import PagedKV
from dscache_vllm.plan import LoadSpec, SaveSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Write:
    tenant: str
    blocks: list[BlockData]


class KVWorker:
    """Loads and saves for one vLLM worker process.

    Args:
        client: the sidecar client (its ``data_dir`` decides zero-copy maps).
        paged: vLLM's KV tensors.
        metrics: where failures and volumes are counted.
        verify: check every loaded block's checksum first.
        queue_blocks: bound of blocks waiting for the writer.
    """

    def __init__(
        self,
        client: SidecarClient,
        paged: PagedKV,
        metrics: ConnectorMetrics,
        *,
        verify: bool = True,
        queue_blocks: int = 256,
    ) -> None:
        self.client = client
        self.paged = paged
        self.metrics = metrics
        self.verify = verify
        self._queue_blocks = queue_blocks
        self._queued = 0
        self._lock = threading.Lock()
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._writer = threading.Thread(target=self._write_loop, name="dscache-writer", daemon=True)
        self._writer.start()

    # -- loads

    def load(self, spec: LoadSpec) -> set[int]:
        """Fills the spec's pages from the store; returns the page ids left unfilled."""
        try:
            loaded = self.client.load(spec.tenant, list(spec.keys), verify=self.verify)
        except Exception as exc:  # the cache never fails a request
            log.warning("dscache load failed (%s); vLLM recomputes %d pages", exc, spec.tokens)
            self.metrics.load_failed("unavailable", len(spec.page_ids))
            return set(spec.page_ids)
        try:
            filled = self.paged.scatter(
                loaded.arrays, spec.first_block, spec.first_page, spec.page_ids
            )
        except Exception as exc:
            log.warning("dscache blocks did not fit vLLM's pages (%s); recomputing", exc)
            filled = 0
        finally:
            loaded.release()
        missing = set(spec.page_ids[filled:])
        if missing:
            # Fewer blocks than planned: evicted since the lookup, or one failed its
            # checksum (the client stops at it and tells the daemon to drop it).
            reason = "missing" if len(loaded) < len(spec.keys) else "layout"
            self.metrics.load_failed(reason, len(missing))
        self.metrics.loaded(filled * self.paged.geometry.page_tokens)
        return missing

    # -- saves

    def save(self, spec: SaveSpec) -> None:
        """Copies the spec's blocks out of vLLM's pages and queues them for the store."""
        n = len(spec.keys)
        with self._lock:
            if self._queued + n > self._queue_blocks:
                self.metrics.dropped(n)
                return
            self._queued += n
            self._idle.clear()
        try:
            arrays = self.paged.gather(spec.page_ids)
        except Exception:
            self._done(n)
            raise
        dtype = self.paged.contract_dtype
        blocks = [
            BlockData(key=k, parent=p, array=a, dtype=dtype)
            for k, p, a in zip(spec.keys, spec.parents, arrays, strict=True)
        ]
        self._writes.put(_Write(spec.tenant, blocks))

    def _done(self, n: int) -> None:
        with self._lock:
            self._queued -= n
            if self._queued == 0:
                self._idle.set()

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            try:
                self.client.store(item.tenant, item.blocks, compress=False)
                self.metrics.stored(len(item.blocks))
            except Exception as exc:  # a failed store is a future miss, nothing more
                log.warning("dscache store of %d blocks failed: %s", len(item.blocks), exc)
                self.metrics.store_failed(len(item.blocks))
            finally:
                self._done(len(item.blocks))

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until every queued block was written (or failed); tests and shutdown."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Lets queued writes finish (bounded), then stops the writer and the client."""
        self.wait_idle(timeout_s)
        self._writes.put(None)
        self._writer.join(timeout_s)
        self.client.close()
