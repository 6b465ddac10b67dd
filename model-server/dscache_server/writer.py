"""Background store of a prompt's new full blocks: the response never waits for it.

Contract:
    * ``BlockWriter.submit`` never blocks: it queues one job (export the blocks from
      the finished prefill, then one store call) on a single background thread, or,
      with ``queue`` jobs already pending, drops it and counts the blocks as
      ``dropped``.
    * Every block of a job is counted once in ``dscache_server_blocks_stored_total``
      by result: ``stored`` (new), ``existing``, ``dropped`` or ``failed``; a failed
      store is logged, never raised.
    * ``store_backlog`` is the number of jobs pending; ``wait_idle`` waits for zero.
    * ``wrote_end(key)``: whether ``key`` is the last block of a chain this process
      stored (the latest ``ENDS_KEPT``): a prompt whose stored prefix ends there
      continues this process's own conversation (``PrefixCache.respell`` then
      skips asking the store what lies below).
    * ``submit_signal`` queues a serving-path signal for the sidecar's eviction
      policy behind the stores before it (so it marks the blocks they publish),
      counted in ``dscache_server_cache_signals_total``; never raised.
    * With ``nice`` > 0 the thread runs that much nicer than the process (Linux sets
      it per thread; a server started niced keeps the gap), so on a busy machine its
      copies and writes take only the CPU the request threads leave; each job's
      duration is the ``store`` phase of its request.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cachetools import LRUCache
from dscache_sidecar.client import RAW

from dscache.keys import KeyChain
from dscache_server.kv import LayoutAdapter, SequenceKV
from dscache_server.kvstore import CacheError, KVBlockStore, NewBlock, Signalling
from dscache_server.metrics import ServerMetrics
from dscache_server.storecodec import StorePolicy

log = logging.getLogger(__name__)

#: Chain ends remembered by ``BlockWriter.wrote_end`` (32-byte keys: ~6 MB).
ENDS_KEPT = 65536


class BlockWriter:
    """Stores blocks of finished prefills on one background thread.

    Args:
        store: where blocks go.
        adapter: exports blocks from a sequence.
        metrics: where results and the backlog are counted.
        queue: jobs pending at most; more are dropped.
        nice: how much nicer than the process the store thread runs (0: unchanged).
        policy: chooses each job's codec on the store thread (None: the store's
            default).
    """

    def __init__(
        self,
        store: KVBlockStore,
        adapter: LayoutAdapter,
        metrics: ServerMetrics,
        *,
        queue: int,
        nice: int = 0,
        policy: StorePolicy | None = None,
    ) -> None:
        self._store, self._adapter, self._metrics = store, adapter, metrics
        self._policy = policy
        self._limit = queue
        self._pending = 0
        self._idle = threading.Condition()  # notified when a job ends
        self._ends: LRUCache[bytes, None] = LRUCache(ENDS_KEPT)
        self._ends_lock = threading.Lock()  # LRUCache is not thread safe
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-store", initializer=_renice, initargs=(nice,)
        )

    def wrote_end(self, key: bytes) -> bool:
        """Whether ``key`` ends a chain this process stored (recently)."""
        with self._ends_lock:
            return key in self._ends

    def submit(
        self, chain: KeyChain, ids: list[int], seq: SequenceKV, first: int, last: int
    ) -> bool:
        """Queues the store of blocks ``first``..``last - 1`` of ``ids``; False if dropped."""
        with self._idle:
            if self._pending >= self._limit:
                self._metrics.blocks_stored.labels(result="dropped").inc(last - first)
                return False
            self._pending += 1
            self._metrics.store_backlog.set(self._pending)
        self._executor.submit(self._job, chain, ids, seq, first, last)
        return True

    def _job(self, chain: KeyChain, ids: list[int], seq: SequenceKV, first: int, last: int) -> None:
        stored = self._metrics.blocks_stored
        started = time.perf_counter()
        try:
            keys = chain.keys(ids)
            dtype = self._adapter.layout.dtype
            bt = chain.block_tokens
            blocks = [
                NewBlock(
                    keys[i],
                    keys[i - 1] if i else b"",
                    self._adapter.export(seq, i),
                    dtype,
                    ids[i * bt : (i + 1) * bt],
                )
                for i in range(first, last)
            ]
            encoding = self._policy.choose(ids) if self._policy is not None else RAW
            t0 = time.perf_counter()
            new = self._store.store(chain.tenant, blocks, encoding)
            with self._ends_lock:
                self._ends[keys[last - 1]] = None
            self._metrics.cache_op_seconds.labels(op="store").observe(time.perf_counter() - t0)
            stored.labels(result="stored").inc(new)
            stored.labels(result="existing").inc(len(blocks) - new)
        except CacheError as exc:
            stored.labels(result="failed").inc(last - first)
            log.debug("background store failed (%s): %s", exc.reason, exc)
        except Exception:
            stored.labels(result="failed").inc(last - first)
            log.exception("background store failed")
        finally:
            self._metrics.phase_seconds.labels(phase="store").observe(time.perf_counter() - started)
            with self._idle:
                self._pending -= 1
                self._metrics.store_backlog.set(self._pending)
                self._idle.notify_all()

    def submit_signal(self, chain: KeyChain, ids: list[int], kind: str) -> bool:
        """Queues a signal on the chain of ``ids`` (full blocks) behind the stores
        queued before it, so it reaches the blocks they publish; False if dropped."""
        with self._idle:
            if self._pending >= self._limit:
                return False
            self._pending += 1
        self._executor.submit(self._signal_job, chain, ids, kind)
        return True

    def _signal_job(self, chain: KeyChain, ids: list[int], kind: str) -> None:
        try:
            if isinstance(self._store, Signalling):
                self._store.signal(chain.tenant, chain.keys(ids), kind)
                self._metrics.signals_sent.labels(kind=kind, result="sent").inc()
        except CacheError as exc:
            self._metrics.signals_sent.labels(kind=kind, result="failed").inc()
            log.debug("signal %s failed (%s): %s", kind, exc.reason, exc)
        except Exception:
            self._metrics.signals_sent.labels(kind=kind, result="failed").inc()
            log.exception("signal %s failed", kind)
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no job is pending; False if ``timeout_s`` ran out first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        """Finishes the pending jobs."""
        self._executor.shutdown(wait=True)


def _renice(nice: int) -> None:
    """Makes the calling thread ``nice`` nicer than the process (Linux: per thread);
    best effort."""
    if nice <= 0:
        return
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, base + nice))
    except OSError as exc:
        log.debug("could not renice the store thread: %s", exc)
