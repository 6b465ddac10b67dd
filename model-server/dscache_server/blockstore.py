"""The request path's view of the KV cache: admission, restore, background store.

Contract:
    * ``PrefixCache.restore`` never raises. Any cache failure (sidecar down or slow,
      a rejected call, a corrupt or mis-shaped block, any bug below it) leaves the
      sequence empty and is counted in ``dscache_server_cache_fallbacks_total`` by
      reason; the request then recomputes. A short load (blocks evicted or dropped as
      corrupt between Lookup and Lease) is a smaller hit, counted as ``short_load``.
    * Lookups have no side effects; loaded blocks are leased, and the lease is held
      until the request's ``Restored.release()``. A request that runs longer than half
      the lease copies its restored prefix into private memory first.
    * At least the last prompt token is always recomputed: the request needs its
      logits, and a cache holds KV, not logits.
    * New full blocks are exported and stored on a background thread; a full store
      queue drops the job (counted) rather than delaying any response.
    * The sidecar is reached only through ``dscache_sidecar.client``. After a failure
      the cache is skipped for ``circuit_cooldown_s`` and the client is rebuilt, so a
      dead sidecar costs one timeout, not one per request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dscache.keys import KeyChain
from dscache_server.kv import LayoutAdapter, SequenceKV
from dscache_server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class CacheError(Exception):
    """A cache operation failed; ``reason`` is a fallback-metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class NewBlock:
    """A block to store: key, parent key (b"" for block 0) and its array."""

    key: bytes
    parent: bytes
    array: np.ndarray


class Loaded(Protocol):
    """Leased blocks; arrays stay valid until ``release()``."""

    keys: list[bytes]
    arrays: list[np.ndarray]

    def release(self) -> None:
        """Ends the lease."""
        ...


class KVBlockStore(Protocol):
    """What the request path needs from a block store. Raises ``CacheError`` only."""

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Number of leading keys stored; no side effects."""
        ...

    def load(self, tenant: str, keys: Sequence[bytes], *, ttl_s: float) -> Loaded:
        """Leases and maps the leading stored blocks."""
        ...

    def store(self, tenant: str, blocks: Sequence[NewBlock]) -> int:
        """Stores blocks; returns how many were new."""
        ...

    def healthy(self) -> bool:
        """Whether the store answers."""
        ...

    def close(self) -> None:
        """Frees connections and mappings."""
        ...


class SidecarBlockStore:
    """``KVBlockStore`` over the sidecar client, with a circuit breaker.

    Args:
        socket_path: the daemon's unix socket.
        data_dir: the cache volume as mounted here, for zero-copy reads.
        timeout_s: deadline of each lookup/lease call.
        compress: True/False force zstd/raw; None lets the codec sample.
        cooldown_s: how long to skip the sidecar after a failure.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        data_dir: str | None = None,
        timeout_s: float = 0.5,
        compress: bool | None = None,
        cooldown_s: float = 2.0,
    ) -> None:
        from dscache_sidecar import client as sidecar_client

        self._mod = sidecar_client
        self._socket = socket_path
        self._data_dir = data_dir
        self._timeout = timeout_s
        self._compress = compress
        self._cooldown = cooldown_s
        self._lock = threading.Lock()
        self._client = self._new_client()
        self._open_until = 0.0
        self._broken = False

    def _new_client(self) -> object:
        return self._mod.SidecarClient(
            self._socket, data_dir=self._data_dir, timeout_s=self._timeout
        )

    def _get_client(self) -> object:
        with self._lock:
            if time.monotonic() < self._open_until:
                raise CacheError("circuit_open", "sidecar failed recently; skipping the cache")
            if self._broken:
                # A fresh channel reconnects at once instead of waiting out gRPC's
                # reconnect backoff, which grows to minutes.
                old = self._client
                self._client = self._new_client()
                self._broken = False
                try:
                    old.close()  # type: ignore[attr-defined]
                except Exception as exc:
                    log.debug("closing the old sidecar client failed: %s", exc)
            return self._client

    def _failed(self, exc: BaseException) -> CacheError:
        mod = self._mod
        if isinstance(exc, CacheError):
            return exc
        if isinstance(exc, mod.SidecarUnavailableError):
            reason = "timeout" if "DEADLINE" in str(exc) else "unavailable"
        elif isinstance(exc, mod.SidecarFullError):
            reason = "full"
        elif isinstance(exc, mod.SidecarRejectedError):
            reason = "rejected"
        else:
            reason = "error"
        if reason in ("timeout", "unavailable", "error"):
            with self._lock:
                self._broken = True
                self._open_until = time.monotonic() + self._cooldown
        return CacheError(reason, f"{type(exc).__name__}: {exc}")

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Leading keys stored."""
        client = self._get_client()
        try:
            return int(client.lookup(tenant, keys))  # type: ignore[attr-defined]
        except Exception as exc:
            raise self._failed(exc) from exc

    def load(self, tenant: str, keys: Sequence[bytes], *, ttl_s: float) -> Loaded:
        """Leases the leading stored blocks."""
        client = self._get_client()
        try:
            loaded: Loaded = client.load(tenant, keys, ttl_s=ttl_s, verify=True)  # type: ignore[attr-defined]
        except Exception as exc:
            raise self._failed(exc) from exc
        return loaded

    def store(self, tenant: str, blocks: Sequence[NewBlock]) -> int:
        """Stores blocks through Allocate/Commit (or Put without the volume)."""
        client = self._get_client()
        data = [self._mod.BlockData(b.key, b.parent, b.array) for b in blocks]
        try:
            return int(client.store(tenant, data, compress=self._compress))  # type: ignore[attr-defined]
        except Exception as exc:
            raise self._failed(exc) from exc

    def healthy(self) -> bool:
        """Whether the daemon reports SERVING."""
        try:
            return bool(self._get_client().healthy())  # type: ignore[attr-defined]
        except CacheError:
            return False

    def close(self) -> None:
        """Closes the client."""
        with self._lock:
            self._client.close()  # type: ignore[attr-defined]


@dataclass
class CostModel:
    """Store-vs-recompute: does reading ``n`` cached tokens beat recomputing them?

    Attributes:
        prefill_tokens_per_s: measured prefill speed.
        load_bytes_per_s: measured cache read speed (lease + map + first touch).
        lookup_overhead_s: fixed cost of lookup + lease.
        bytes_per_token: KV bytes per token of this model.
    """

    prefill_tokens_per_s: float
    load_bytes_per_s: float
    lookup_overhead_s: float
    bytes_per_token: int

    def load_cost_s(self, tokens: int) -> float:
        """Seconds to restore ``tokens`` from the cache."""
        return self.lookup_overhead_s + tokens * self.bytes_per_token / self.load_bytes_per_s

    def recompute_cost_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` (linear model; prefill only grows faster)."""
        return tokens / self.prefill_tokens_per_s

    def pays(self, tokens: int) -> bool:
        """Whether loading ``tokens`` beats recomputing them."""
        return tokens > 0 and self.load_cost_s(tokens) < self.recompute_cost_s(tokens)

    def crossover_tokens(self) -> int | None:
        """Smallest token count where loading pays; None if it never does."""
        per_token_gain = 1.0 / self.prefill_tokens_per_s - (
            self.bytes_per_token / self.load_bytes_per_s
        )
        if per_token_gain <= 0:
            return None
        return int(self.lookup_overhead_s / per_token_gain) + 1


@dataclass
class Restored:
    """What ``PrefixCache.restore`` found for one request."""

    hit_blocks: int = 0
    lookup_blocks: int = 0
    cacheable_blocks: int = 0
    admitted: bool = False
    fallback: str | None = None
    _loaded: Loaded | None = None
    _leased_at: float = 0.0

    def release(self) -> None:
        """Ends the lease (idempotent)."""
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            try:
                loaded.release()
            except Exception as exc:  # never fail a request on release
                log.debug("lease release failed: %s", exc)

    def guard_lease(self, seq: SequenceKV, ttl_s: float) -> None:
        """Copies the restored prefix out of the mapping before the lease runs out."""
        if self._loaded is not None and time.monotonic() - self._leased_at > ttl_s / 2:
            seq.materialize()
            self.release()


class PrefixCache:
    """Admission, restore and background store for one engine.

    Args:
        store: the block store, or None to run without a cache.
        adapter: the engine's layout adapter.
        metrics: where decisions and failures are counted.
        cost: the calibrated cost model.
        min_tokens: prompts shorter than this skip the cache.
        lease_ttl_s: lease requested on loads.
        store_queue: background jobs pending at most.
    """

    def __init__(
        self,
        store: KVBlockStore | None,
        adapter: LayoutAdapter,
        metrics: ServerMetrics,
        cost: CostModel,
        *,
        min_tokens: int = 512,
        lease_ttl_s: float = 60.0,
        store_queue: int = 64,
    ) -> None:
        self.store = store
        self.adapter = adapter
        self.metrics = metrics
        self.cost = cost
        self.min_tokens = min_tokens
        self.lease_ttl_s = lease_ttl_s
        self._store_queue = store_queue
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-store")
        self._last_warning = 0.0

    @property
    def block_tokens(self) -> int:
        """Tokens per block."""
        return self.adapter.block_tokens

    def admit(self, prompt_tokens: int) -> str:
        """Admission decision for a prompt: admit, short, no_gain or disabled."""
        if self.store is None:
            decision = "disabled"
        elif prompt_tokens < self.min_tokens:
            decision = "short"
        elif not self.cost.pays(((prompt_tokens - 1) // self.block_tokens) * self.block_tokens):
            decision = "no_gain"
        else:
            decision = "admit"
        self.metrics.admission.labels(decision=decision).inc()
        if decision == "no_gain":
            log.debug("cache skipped for %d tokens: loading would not pay", prompt_tokens)
        return decision

    def restore(self, chain: KeyChain, token_ids: Sequence[int], seq: SequenceKV) -> Restored:
        """Looks up, leases and maps the longest cached prefix into ``seq``. Never raises."""
        result = Restored()
        n = len(token_ids)
        result.cacheable_blocks = n // self.block_tokens
        if self.admit(n) != "admit" or self.store is None:
            return result
        result.admitted = True
        # The last token is always recomputed: its logits are needed.
        usable = (n - 1) // self.block_tokens
        if usable == 0:
            return result
        try:
            keys = chain.keys(token_ids[: usable * self.block_tokens])
            t0 = time.perf_counter()
            found = self.store.lookup(chain.tenant, keys)
            t1 = time.perf_counter()
            self.metrics.cache_op_seconds.labels(op="lookup").observe(t1 - t0)
            result.lookup_blocks = found
            if found == 0:
                return result
            loaded = self.store.load(chain.tenant, keys[:found], ttl_s=self.lease_ttl_s)
            result._loaded, result._leased_at = loaded, time.monotonic()
            got = min(len(loaded.arrays), found)
            if got and loaded.keys[:got] != keys[:got]:
                raise CacheError("corrupt", "the store returned blocks of other keys")
            try:
                self.adapter.restore(seq, loaded.arrays[:got])
            except ValueError as exc:
                raise CacheError("corrupt", str(exc)) from exc
            self.metrics.cache_op_seconds.labels(op="load").observe(time.perf_counter() - t1)
            result.hit_blocks = got
            if got < found:
                self._fallback(result, "short_load", f"{found} blocks found, {got} loaded")
        except CacheError as exc:
            self._reset(seq, result)
            self._fallback(result, exc.reason, str(exc))
        except Exception as exc:  # a bug must not fail the request either
            self._reset(seq, result)
            self._fallback(result, "error", f"{type(exc).__name__}: {exc}")
        return result

    def _reset(self, seq: SequenceKV, result: Restored) -> None:
        result.release()
        result.hit_blocks = 0
        fresh = self.adapter.new_sequence()
        seq.layers, seq.length, seq.restored_tokens = fresh.layers, 0, 0

    def _fallback(self, result: Restored, reason: str, message: str) -> None:
        result.fallback = reason
        self.metrics.fallbacks.labels(reason=reason).inc()
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # rate-limited: this is the hot path
            self._last_warning = now
            log.warning("cache fallback (%s): %s", reason, message)
        else:
            log.debug("cache fallback (%s): %s", reason, message)

    def store_async(
        self, chain: KeyChain, token_ids: Sequence[int], seq: SequenceKV, first_block: int
    ) -> bool:
        """Queues the store of full prompt blocks from ``first_block`` on; never blocks.

        Returns:
            True when a job was queued.
        """
        if self.store is None or len(token_ids) < self.min_tokens:
            return False
        last = min(len(token_ids), seq.length) // self.block_tokens
        if first_block >= last:
            return False
        with self._pending_lock:
            if self._pending >= self._store_queue:
                self.metrics.blocks_stored.labels(result="dropped").inc(last - first_block)
                return False
            self._pending += 1
            self.metrics.store_backlog.set(self._pending)
        ids = list(token_ids[: last * self.block_tokens])
        self._executor.submit(self._store_job, chain, ids, seq, first_block, last)
        return True

    def _store_job(
        self, chain: KeyChain, ids: list[int], seq: SequenceKV, first: int, last: int
    ) -> None:
        store = self.store
        try:
            assert store is not None
            keys = chain.keys(ids)
            blocks = [
                NewBlock(keys[i], keys[i - 1] if i else b"", self.adapter.export(seq, i))
                for i in range(first, last)
            ]
            t0 = time.perf_counter()
            new = store.store(chain.tenant, blocks)
            self.metrics.cache_op_seconds.labels(op="store").observe(time.perf_counter() - t0)
            self.metrics.blocks_stored.labels(result="stored").inc(new)
            self.metrics.blocks_stored.labels(result="existing").inc(len(blocks) - new)
        except CacheError as exc:
            self.metrics.blocks_stored.labels(result="failed").inc(last - first)
            log.debug("background store failed (%s): %s", exc.reason, exc)
        except Exception:
            self.metrics.blocks_stored.labels(result="failed").inc(last - first)
            log.exception("background store failed")
        finally:
            with self._pending_lock:
                self._pending -= 1
                self.metrics.store_backlog.set(self._pending)
                self._idle.notify_all()

    def wait_stored(self, timeout_s: float = 30.0) -> bool:
        """Blocks until no store job is pending (tests, prewarm, shutdown)."""
        deadline = time.monotonic() + timeout_s
        with self._pending_lock:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Finishes pending stores and closes the store."""
        self._executor.shutdown(wait=True)
        if self.store is not None:
            self.store.close()
