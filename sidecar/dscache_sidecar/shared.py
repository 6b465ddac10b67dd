"""The shared tier: a cluster-wide copy of reused blocks behind the node-local store.

A session whose next turn lands on another pod (scale-out, a rescheduled pod, a
canary step, a router that re-hashed) finds its prefix here instead of
recomputing it. The engine is any :class:`~dscache_sidecar.remote.RemoteTier`
(:class:`~dscache_sidecar.redistier.RedisClusterTier` today).

Contract:
    * Same keys as the local store: a block lives under
      ``<prefix>:v1|v2:<tenant id hex>:<key hex>``, so a tenant reaches only its own
      blocks (the key chain is salted per tenant as well) and a namespace only its
      own prefix (its Redis ACL user's key pattern). The value is the block's
      stored bytes (same codec) behind a header naming its tenant, key, parent,
      layout and checksum, signed with the namespace's key when it has one
      (:mod:`dscache_sidecar.sharedvalue`).
    * Reads verify before use: a value whose signature does not verify is a miss,
      deleted remotely and counted (``forged``); one whose header or checksum does
      not match likewise (``corrupt``). A verified block is stored locally
      (promotion) and is leased from there.
    * Writes never block a request: the store's events (:meth:`SharedTier.stored`,
      :meth:`SharedTier.hit`) only queue a key; one writer thread reads the bytes
      back from the local store and writes batches. A full queue drops (counted).
      Policy ``reused`` queues a block the first time it is hit here, and a newly
      stored block whose parent was hit, fetched or queued (a conversation that has
      come back once will likely come back again); single-use prompts never leave
      the node. Policy ``all`` queues every stored block.
    * Connections are opened in the background: at start, and again once
      ``shared_retry_s`` has passed after a failure, so no request's bound is spent
      on a slot map or a handshake (a first lookup that paid for them timed out
      under load and read as a miss).
    * A remote failure or timeout is a miss, never an error: the tier is then
      skipped for ``shared_retry_s`` (lookups cost nothing meanwhile) and tried
      again. A Lease spends at most ``shared_fetch_budget_s`` fetching.
    * Fetches are pipelined: the next batch is in flight while one is verified and
      stored.

Thread safety: every public method may be called from any thread. ``stored`` is
called with the store's lock held: it only touches this object's own lock.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

from dscache_sidecar.blockstore import BlockSpec, StoreFullError, tenant_bytes
from dscache_sidecar.config import SidecarSettings
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.metrics import SidecarMetrics
from dscache_sidecar.remote import RemoteTier, RemoteTierConnectingError, RemoteTierError
from dscache_sidecar.sharedvalue import CorruptValueError, ForgedValueError, ValueFormat

log = logging.getLogger(__name__)

__all__ = [
    "BlockSource",
    "SharedTier",
    "value_format",
]

#: Keys remembered as hit, fetched or queued (policy decisions, no double writes).
_HOT_KEYS = 1 << 17
#: Blocks per write batch.
_WRITE_BATCH = 32
#: Seconds between two warnings about the remote tier (the rest go to debug).
_WARN_EVERY_S = 30.0


def value_format(settings: SidecarSettings) -> ValueFormat:
    """The names and value format the settings ask for (prefix, signing keys)."""
    previous = settings.shared_signing_key_previous.get_secret_value()
    return ValueFormat(
        prefix=settings.shared_key_prefix,
        signing_key=settings.shared_signing_key.get_secret_value().encode(),
        verify_keys=(previous.encode(),) if previous else (),
    )


class BlockSource(Protocol):
    """What the shared tier needs from the local store."""

    @property
    def max_stored_bytes(self) -> int:
        """Largest payload one block may have."""
        ...

    def stored_prefix(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Leading keys stored locally; no side effects, not counted."""
        ...

    def peek(self, tenant: str, key: bytes) -> tuple[BlockRecord, bytes] | None:
        """A verified copy of a stored block, not counted as an access."""
        ...

    def put(self, tenant: str, spec: BlockSpec, data: bytes, client_sum: int) -> tuple[bool, bool]:
        """Stores one block from bytes: (stored, existed)."""
        ...


@dataclass(frozen=True)
class SharedStatus:
    """What Stats and the metrics collector report."""

    engine: str
    up: bool
    queued: int


class SharedTier:
    """The shared tier over ``tier`` for the store ``source``. Call :meth:`start`."""

    def __init__(
        self,
        tier: RemoteTier,
        source: BlockSource,
        settings: SidecarSettings,
        metrics: SidecarMetrics,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tier = tier
        self.source = source
        self.settings = settings
        self.metrics = metrics
        self._now = monotonic
        self.format = value_format(settings)
        self._lock = threading.Lock()
        self._hot: OrderedDict[bytes, None] = OrderedDict()
        self._queue: queue.Queue[tuple[bytes, bytes] | None] = queue.Queue(
            settings.shared_queue_blocks
        )
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._down_until = 0.0
        # The tier answered since the last failure (the first connect included):
        # ``remote_up`` reads 0 until then.
        self._answered = False
        self._last_warning = -_WARN_EVERY_S
        # Remote calls run here so a request waits at most its bound for them, even
        # when the client library would go on (reconnecting, re-reading slots).
        self._calls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-remote")
        self._writer: threading.Thread | None = None
        self._reconnect: threading.Timer | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the writer thread and registers the tier's gauges."""
        self.metrics.watch_remote(self.status)
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-remote-write", daemon=True
        )
        self._writer.start()
        self._calls.submit(self._connect)

    def _connect(self) -> None:
        """Opens the engine's connections (a background call); a failure is one."""
        if self._closed:
            return
        try:
            self.tier.connect()
        except RemoteTierError as exc:
            self._failed("connect", exc)
        except Exception:  # a background call must not die silently
            log.exception("shared tier connect failed")
        else:
            self._answered = True

    def close(self) -> None:
        """Stops the writer (queued writes are dropped) and closes the engine."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self._reconnect is not None:
                self._reconnect.cancel()
        try:
            self._queue.put(None, timeout=5.0)  # wakes the writer (it drains a full queue)
        except queue.Full:
            log.warning("the shared tier's writer did not drain its queue; not waiting for it")
        if self._writer is not None:
            self._writer.join(timeout=5.0)
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.tier.close()

    def status(self) -> SharedStatus:
        up = self._answered and self._available()
        return SharedStatus(self.tier.engine, up, self._queue.qsize())

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Blocks until every queued write was written or dropped (tests, benches)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    # ------------------------------------------------------------------ health

    def _available(self) -> bool:
        return self._now() >= self._down_until

    def _failed(self, op: str, exc: RemoteTierError) -> None:
        self.metrics.remote_errors.labels(op=op, kind=exc.kind).inc()
        self._answered = False
        now = self._now()
        self._down_until = now + self.settings.shared_retry_s
        with self._lock:
            # One reconnect pending at a time; a failed reconnect (this thread, the
            # timer's own) schedules the next.
            timer = self._reconnect
            pending = (
                timer is not None and timer.is_alive() and timer is not threading.current_thread()
            )
            if not self._closed and not pending:
                self._reconnect = threading.Timer(self.settings.shared_retry_s, self._connect)
                self._reconnect.daemon = True
                self._reconnect.start()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(
                "shared tier %s failed (%s): local-only for %.0fs",
                op,
                exc,
                self.settings.shared_retry_s,
            )
        else:
            log.debug("shared tier %s failed: %s", op, exc)

    # ------------------------------------------------------------------ events

    def _mark(self, hot_key: bytes) -> bool:
        """Remembers a key as hot (lock held); False when it already was."""
        if hot_key in self._hot:
            self._hot.move_to_end(hot_key)
            return False
        self._hot[hot_key] = None
        if len(self._hot) > _HOT_KEYS:
            self._hot.popitem(last=False)
        return True

    def _enqueue(self, tid: bytes, key: bytes) -> None:
        """Queues one write (lock held); drops it when the queue is full."""
        try:
            self._queue.put_nowait((tid, key))
        except queue.Full:
            self.metrics.remote_write_drops.labels(reason="queue_full").inc()
            return
        self._pending += 1

    def stored(self, rec: BlockRecord) -> None:
        """The store published ``rec`` (called with the store's lock held)."""
        with self._lock:
            hot_key = rec.tenant + rec.key
            if hot_key in self._hot:
                return  # fetched from the tier: it is there already
            if self.settings.shared_write_policy == "all" or (
                rec.parent and rec.tenant + rec.parent in self._hot
            ):
                self._mark(hot_key)
                self._enqueue(rec.tenant, rec.key)

    def hit(self, recs: Sequence[BlockRecord]) -> None:
        """Blocks were leased (reused) here: queue those not yet written."""
        with self._lock:
            for rec in recs:
                if self._mark(rec.tenant + rec.key):
                    self._enqueue(rec.tenant, rec.key)

    # ------------------------------------------------------------------ writes

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < _WRITE_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._done(len(batch))
                    return
                batch.append(item)
            try:
                self._write(batch)
            except Exception:  # the writer must outlive any bug
                log.exception("shared tier write failed")
            finally:
                self._done(len(batch))

    def _done(self, n: int) -> None:
        with self._idle:
            self._pending -= n
            self._idle.notify_all()

    def _write(self, batch: list[tuple[bytes, bytes]]) -> None:
        drops = self.metrics.remote_write_drops
        if not self._available():
            drops.labels(reason="down").inc(len(batch))
            return
        items: list[tuple[str, bytes]] = []
        for tid, key in batch:
            found = self.source.peek(tid.hex(), key)
            if found is None:
                drops.labels(reason="gone").inc()
                continue
            rec, data = found
            items.append((self.format.name(tid, key), self.format.pack(rec, data)))
        if not items:
            return
        t0 = time.perf_counter()
        try:
            self.tier.put(items, self.settings.shared_ttl_s)
        except RemoteTierError as exc:
            self._failed("push", exc)
            drops.labels(reason="error").inc(len(items))
            return
        self._answered = True
        self.metrics.remote_latency.labels(op="push").observe(time.perf_counter() - t0)
        self.metrics.remote_blocks.labels(op="push", result="ok").inc(len(items))
        self.metrics.remote_bytes.labels(op="push").inc(sum(len(v) for _, v in items))

    # ------------------------------------------------------------------ reads

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the tier holds; 0 when it fails. Never raises."""
        if not keys or not self._available():
            return 0
        tid = tenant_bytes(tenant)
        t0 = time.perf_counter()
        call = self._calls.submit(self.tier.exists, [self.format.name(tid, k) for k in keys])
        try:
            present = call.result(timeout=self.settings.shared_timeout_s)
        except FutureTimeout:
            self._failed("lookup", RemoteTierError("timeout", "no answer within the timeout"))
            return 0
        except RemoteTierConnectingError:
            return 0  # a miss: the background connect is not done yet
        except RemoteTierError as exc:
            self._failed("lookup", exc)
            return 0
        self._answered = True
        self.metrics.remote_latency.labels(op="lookup").observe(time.perf_counter() - t0)
        found = 0
        for there in present:
            if not there:
                break
            found += 1
        blocks = self.metrics.remote_blocks
        if found:
            blocks.labels(op="lookup", result="hit").inc(found)
        if found < len(keys):
            blocks.labels(op="lookup", result="miss").inc(len(keys) - found)
        return found

    def promote(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Fetches the keys of the chain ``keys`` that follow its locally stored
        prefix from the tier, verifies them and stores them locally, in chain order,
        within the fetch budget; returns how many. Stops at the first block that is
        missing, corrupt, late or does not fit. Never raises."""
        keys = keys[self.source.stored_prefix(tenant, keys) :]
        if not keys or not self._available():
            return 0
        tid = tenant_bytes(tenant)
        deadline = self._now() + self.settings.shared_fetch_budget_s
        step = self.settings.shared_fetch_batch
        batches = [list(keys[i : i + step]) for i in range(0, len(keys), step)]
        promoted = 0
        t0 = time.perf_counter()
        pending: Future[list[bytes | None]] | None = self._fetch(tid, batches[0])
        try:
            for i, batch in enumerate(batches):
                assert pending is not None
                values = self._wait(pending, deadline)
                pending = None
                if values is None:
                    break
                if i + 1 < len(batches):
                    pending = self._fetch(tid, batches[i + 1])  # in flight while we store
                good = self._store_batch(tenant, tid, batch, values)
                promoted += good
                if good < len(batch):
                    break
        finally:
            if pending is not None:
                pending.cancel()
        self.metrics.remote_latency.labels(op="fetch").observe(time.perf_counter() - t0)
        return promoted

    def _fetch(self, tid: bytes, batch: list[bytes]) -> Future[list[bytes | None]]:
        names = [self.format.name(tid, k) for k in batch]
        return self._calls.submit(self.tier.get, names, self.settings.shared_ttl_s)

    def _wait(
        self, pending: Future[list[bytes | None]], deadline: float
    ) -> list[bytes | None] | None:
        try:
            values = pending.result(timeout=max(0.0, deadline - self._now()))
        except FutureTimeout:
            # A long prefix on a slow link, not a failed tier: counted, not skipped.
            self.metrics.remote_errors.labels(op="fetch", kind="budget").inc()
            return None
        except RemoteTierConnectingError:
            return None  # a miss: the background connect is not done yet
        except RemoteTierError as exc:
            self._failed("fetch", exc)
            return None
        self._answered = True
        return values

    def _store_batch(
        self, tenant: str, tid: bytes, batch: list[bytes], values: list[bytes | None]
    ) -> int:
        blocks = self.metrics.remote_blocks
        for n, (key, value) in enumerate(zip(batch, values, strict=True)):
            if value is None:
                blocks.labels(op="fetch", result="miss").inc()
                return n
            try:
                spec, csum, data = self.format.unpack(tid, key, value, self.source.max_stored_bytes)
            except CorruptValueError as exc:
                self._corrupt(tid, key, exc)
                return n
            with self._lock:
                self._mark(tid + key)  # already remote: its publish must not queue a write
            try:
                self.source.put(tenant, spec, data, csum)
            except (StoreFullError, ValueError) as exc:
                log.debug("a fetched block could not be stored locally: %s", exc)
                blocks.labels(op="fetch", result="not_stored").inc()
                return n
            blocks.labels(op="fetch", result="ok").inc()
            self.metrics.remote_bytes.labels(op="fetch").inc(len(value))
        return len(batch)

    def _corrupt(self, tid: bytes, key: bytes, exc: CorruptValueError) -> None:
        if isinstance(exc, ForgedValueError):
            # Written by someone without this namespace's key: never loaded.
            self.metrics.remote_blocks.labels(op="fetch", result="forged").inc()
            what = "a forged (unsigned or wrongly signed)"
        else:
            self.metrics.remote_blocks.labels(op="fetch", result="corrupt").inc()
            self.metrics.checksum_failures.labels(where="remote").inc()
            what = "a corrupt"
        log.warning("dropped %s block of the shared tier: %s", what, exc)
        try:
            self.tier.delete([self.format.name(tid, key)])
        except RemoteTierError as err:
            self._failed("delete", err)
