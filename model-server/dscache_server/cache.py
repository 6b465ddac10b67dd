"""The request path's view of the KV cache: admission, restore, background store.

Contract:
    * ``PrefixCache.restore`` never raises. Any cache failure (sidecar down or slow,
      a rejected call, a corrupt or mis-shaped block, any bug below it) leaves the
      sequence empty and is counted in ``dscache_server_cache_fallbacks_total`` by
      reason; the request then recomputes. A short load (blocks evicted or dropped as
      corrupt between Lookup and Lease) is a smaller hit, counted as ``short_load``.
    * Lookups have no side effects; loaded blocks are leased, and the lease is held
      (extended in the background by the sidecar client) until the request's
      ``Restored.release()``, however long the prefill and the decoding take. Before
      each use of the restored prefix the engine asks ``Restored.guard_lease``: a
      lease about to run out all the same (its extensions failing) gets its prefix
      copied into private memory first; one that lapsed in use is a ``lease_lapsed``
      fallback, and the request recomputes from nothing, as for a corrupt block.
    * Checksums are checked while the prefill runs (``background_verify``, on by
      default): ``PrefixCache.confirm`` must be called before the first token is
      sampled; when a block failed, the request is told to recompute from nothing
      (counted as ``corrupt``), so a corrupt byte never reaches a token.
    * ``Restored`` carries the seconds each cache phase took (``lookup``, ``lease``,
      ``map_verify``) for the request's time breakdown.
    * At least the last prompt token is always recomputed: the request needs its
      logits, and a cache holds KV, not logits.
    * New full blocks are exported and stored on a background thread (``writer``); a
      full store queue drops the job (counted) rather than delaying any response.
    * The store is a ``blockstore.KVBlockStore``; the sidecar's is
      ``blockstore.SidecarBlockStore``.
    * ``respell`` follows the tokenization a prompt's text was stored with (the
      store's ``Descending``), so a previous answer's generated ids are found again
      in another process; it never raises and never changes what the text says.
    * Signals for the sidecar's eviction policy (``signal``: now, for ``queued``;
      ``signal_async``: behind the request's store, for ``ended``/``expected``)
      never raise and never delay a response.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field

from dscache.keys import KeyChain
from dscache_server.admission import Admission, CostModel
from dscache_server.kv import LayoutAdapter, SequenceKV
from dscache_server.kvstore import CacheError, Descending, KVBlockStore, Loaded, Signalling
from dscache_server.metrics import ServerMetrics
from dscache_server.respell import Spelling
from dscache_server.storecodec import StorePolicy
from dscache_server.writer import BlockWriter

log = logging.getLogger(__name__)

#: Seconds between two cache-fallback warnings (the rest go to debug: hot path).
WARNING_INTERVAL_S = 10.0
#: Share of the lease TTL left at which a restored prefix is copied out of the
#: mapping (the lease is extended every third of its TTL while held: with that
#: little left, the extensions are failing).
LEASE_MARGIN = 0.25


@dataclass
class Restored:
    """What ``PrefixCache.restore`` found for one request."""

    hit_blocks: int = 0
    lookup_blocks: int = 0
    cacheable_blocks: int = 0
    admitted: bool = False
    fallback: str | None = None
    lookup_s: float = 0.0
    lease_s: float = 0.0
    map_verify_s: float = 0.0  # views, restore, and any wait for a background check
    _loaded: Loaded | None = None

    def release(self) -> None:
        """Ends the lease (idempotent)."""
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            try:
                loaded.release()
            except Exception as exc:  # never fail a request on release
                log.debug("lease release failed: %s", exc)

    def guard_lease(self, seq: SequenceKV, ttl_s: float) -> bool:
        """Call before the engine reads the restored prefix again. False when its lease
        lapsed while in use (the mapping may show other blocks' bytes: the caller
        recomputes); copies the prefix into private memory and ends the lease when
        the lease is about to run out all the same (its extensions failing)."""
        loaded = self._loaded
        if loaded is None:
            return True
        if loaded.lapsed():
            return False
        if loaded.held_until() - time.monotonic() < ttl_s * LEASE_MARGIN:
            seq.materialize()
            self.release()
        return True


@dataclass(eq=False)
class PrefixCache:
    """Admission, restore and background store for one engine.

    Attributes:
        store: the block store, or None to run without a cache.
        adapter: the engine's layout adapter.
        metrics: where decisions and failures are counted.
        cost: the calibrated cost model.
        min_tokens: a floor: prompts shorter than this skip the cache (no lookup, no
            store) whatever the cost model says; 0 = the cost model alone decides.
        admission_refit_s: refit the cost model from the requests' own timings at
            most this often, and probe each refused size class once per this period
            (None: the calibrated model stays; see ``admission``).
        admission_probe: share of prompts refused on cost that are loaded anyway,
            to keep measuring the sizes refused.
        lease_ttl_s: lease requested on loads.
        store_queue: background jobs pending at most.
        background_verify: check checksums while the prefill runs (see ``confirm``)
            instead of before it starts.
        verify_timeout_s: how long ``confirm`` waits for a background check before
            it gives up on the blocks (and the request recomputes).
        store_nice: niceness of the background store thread (Linux; 0 = as the
            request threads), so stores take what the requests leave.
        store_policy: the encoding of each store job (None: every block raw).
    """

    store: KVBlockStore | None
    adapter: LayoutAdapter
    metrics: ServerMetrics
    cost: CostModel
    _: KW_ONLY
    min_tokens: int = 0
    admission_refit_s: InitVar[float | None] = None
    admission_probe: InitVar[float] = 0.0
    max_tokens: InitVar[int] = 1 << 17
    lease_ttl_s: float = 60.0
    store_queue: InitVar[int] = 64
    background_verify: bool = True
    verify_timeout_s: float = 10.0
    store_nice: InitVar[int] = 0
    store_policy: StorePolicy | None = None
    _writer: BlockWriter | None = field(init=False, default=None)
    _last_warning: float = field(init=False, default=0.0)
    admission: Admission = field(init=False)

    def __post_init__(
        self,
        admission_refit_s: float | None,
        admission_probe: float,
        max_tokens: int,
        store_queue: int,
        store_nice: int,
    ) -> None:
        self.admission = Admission(
            self.cost,
            block_tokens=self.adapter.block_tokens,
            max_tokens=max_tokens,
            refit_s=admission_refit_s,
            probe=admission_probe,
            # A refused size class is measured again at each refit period, so one
            # slow moment cannot keep a warm cache unused (see the admission module).
            probe_every_s=admission_refit_s,
            metrics=self.metrics,
        )
        if self.store is not None:
            self._writer = BlockWriter(
                self.store,
                self.adapter,
                self.metrics,
                queue=store_queue,
                nice=store_nice,
                policy=self.store_policy,
            )

    @property
    def block_tokens(self) -> int:
        """Tokens per block."""
        return self.adapter.block_tokens

    def admit(self, prompt_tokens: int) -> str:
        """Admission decision for a prompt: admit, probe, short, no_gain or disabled."""
        decision: str
        if self.store is None:
            decision = "disabled"
        elif prompt_tokens < self.min_tokens:
            decision = "short"
        else:
            usable = ((prompt_tokens - 1) // self.block_tokens) * self.block_tokens
            decision = self.admission.decide(usable)
        self.metrics.admission.labels(decision=decision).inc()
        if decision == "no_gain":
            log.debug("cache skipped for %d tokens: loading would not pay", prompt_tokens)
        return decision

    def observe(self, prompt_tokens: int, restored: Restored, compute_s: float) -> None:
        """A finished prefill's timings, for the admission model: a restored prefix
        is a load sample, a prompt computed from nothing a recompute sample."""
        if restored.fallback is not None:
            return  # its timings mix a failed load with a recompute
        hit = restored.hit_blocks * self.block_tokens
        if hit:
            load_s = restored.lookup_s + restored.lease_s + restored.map_verify_s
            self.admission.observe("load", hit, load_s)
        else:
            self.admission.observe("recompute", prompt_tokens, compute_s)

    def restore(self, chain: KeyChain, token_ids: Sequence[int], seq: SequenceKV) -> Restored:
        """Looks up, leases and maps the longest cached prefix into ``seq``. Never raises."""
        result = Restored()
        n = len(token_ids)
        result.cacheable_blocks = n // self.block_tokens
        if self.admit(n) not in ("admit", "probe") or self.store is None:
            return result
        result.admitted = True
        # The last token is always recomputed: its logits are needed.
        usable = (n - 1) // self.block_tokens
        if usable == 0:
            return result
        try:
            t0 = time.perf_counter()
            keys = chain.keys(token_ids[: usable * self.block_tokens])
            found = self.store.lookup(chain.tenant, keys)
            t1 = time.perf_counter()
            result.lookup_s = t1 - t0
            self.metrics.cache_op_seconds.labels(op="lookup").observe(t1 - t0)
            result.lookup_blocks = found
            if found == 0:
                return result
            loaded = self.store.load(
                chain.tenant,
                keys[:found],
                ttl_s=self.lease_ttl_s,
                background_verify=self.background_verify,
            )
            result._loaded = loaded
            result.lease_s = loaded.lease_s
            got = min(len(loaded.arrays), found)
            if got and loaded.keys[:got] != keys[:got]:
                raise CacheError("corrupt", "the store returned blocks of other keys")
            t2 = time.perf_counter()
            try:
                self.adapter.restore(seq, loaded.arrays[:got])
            except ValueError as exc:
                raise CacheError("corrupt", str(exc)) from exc
            result.map_verify_s = loaded.map_s + (time.perf_counter() - t2)
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

    def confirm(self, result: Restored) -> bool:
        """Waits for the restored blocks' checksums; False when one failed (or the
        check did not finish in time): the caller then recomputes from nothing.

        Call it after the prefill and before the first token is sampled. A failure
        ends the lease and is counted as a ``corrupt`` fallback.
        """
        loaded = result._loaded
        if loaded is None or result.hit_blocks == 0:
            return True
        if loaded.lapsed():
            self.lapsed(result)
            return False
        t0 = time.perf_counter()
        try:
            good = loaded.verified(self.verify_timeout_s)
        except TimeoutError:
            good, why = -1, f"checksums not checked within {self.verify_timeout_s:g}s"
        except Exception as exc:  # a bug in the check must not fail the request
            good, why = -1, f"{type(exc).__name__}: {exc}"
        else:
            why = f"block {good} of {result.hit_blocks} failed its checksum"
        result.map_verify_s += time.perf_counter() - t0
        if good >= result.hit_blocks:
            return True
        result.release()
        result.hit_blocks = 0
        self._fallback(result, "corrupt", why)
        return False

    def lapsed(self, result: Restored) -> None:
        """The restored prefix's lease lapsed while in use: ends it and counts the
        fallback (``lease_lapsed``); the caller recomputes from nothing."""
        result.release()
        result.hit_blocks = 0
        self._fallback(result, "lease_lapsed", "the lease of the restored blocks ran out in use")

    def _reset(self, seq: SequenceKV, result: Restored) -> None:
        result.release()
        result.hit_blocks = 0
        fresh = self.adapter.new_sequence()
        seq.layers, seq.length, seq.restored_tokens = fresh.layers, 0, 0

    def _fallback(self, result: Restored, reason: str, message: str) -> None:
        result.fallback = reason
        self.metrics.fallbacks.labels(reason=reason).inc()
        self._warn("cache fallback (%s): %s", reason, message)

    def _warn(self, msg: str, *args: object) -> None:
        """A warning at most every ``WARNING_INTERVAL_S`` (hot path), else debug."""
        now = time.monotonic()
        if now - self._last_warning > WARNING_INTERVAL_S:
            self._last_warning = now
            log.warning(msg, *args)
        else:
            log.debug(msg, *args)

    def store_async(
        self, chain: KeyChain, token_ids: Sequence[int], seq: SequenceKV, first_block: int
    ) -> bool:
        """Queues the store of full prompt blocks from ``first_block`` on; never blocks.

        Returns:
            True when a job was queued.
        """
        if self._writer is None or len(token_ids) < self.min_tokens:
            return False
        last = min(len(token_ids), seq.length) // self.block_tokens
        if first_block >= last:
            return False
        ids = list(token_ids[: last * self.block_tokens])
        return self._writer.submit(chain, ids, seq, first_block, last)

    def respell(
        self,
        chain: KeyChain,
        token_ids: Sequence[int],
        spelling: Spelling,
        encode: Callable[[str], list[int]],
    ) -> list[int]:
        """``token_ids`` (a prompt encoded from text) with the blocks stored after its
        leading stored ones followed where their tokens spell the same text
        (``respell``): a previous answer stored with the ids the model generated is
        found again after a restart or on another pod. Never raises; the prompt's
        own ids on any failure. One lookup, and one ``Descendants`` call when the
        stored prefix ends before the prompt's blocks do, at a block this process
        did not store last in a chain."""
        store = self.store
        bt = self.block_tokens
        usable = (len(token_ids) - 1) // bt
        if not isinstance(store, Descending) or usable < 2:
            return list(token_ids)
        try:
            keys = chain.keys(token_ids[: usable * bt])
            found = store.lookup(chain.tenant, keys)
            writer = self._writer
            if found in (0, usable) or (writer is not None and writer.wrote_end(keys[found - 1])):
                # Nothing stored, all of it, or this process's own conversation:
                # the text after its last stored block is new.
                return list(token_ids)
            ids, followed = spelling.follow(
                token_ids,
                found * bt,
                keys[found - 1],
                lambda key, firsts: store.descendants(chain.tenant, key, first_tokens=firsts),
                encode,
            )
        except CacheError as exc:
            log.debug("respelling the prompt failed (%s): %s", exc.reason, exc)
            return list(token_ids)
        except Exception as exc:  # a bug must not fail the request
            self._warn("respelling the prompt failed: %s: %s", type(exc).__name__, exc)
            return list(token_ids)
        self.metrics.respelled.inc(followed)
        return ids

    def signal_async(self, chain: KeyChain, token_ids: Sequence[int], kind: str) -> bool:
        """Queues a signal (``ended``/``expected``) on the prompt's full blocks behind
        its store; never blocks. True when queued."""
        blocks = len(token_ids) // self.block_tokens
        if self._writer is None or blocks == 0:
            return False
        ids = list(token_ids[: blocks * self.block_tokens])
        return self._writer.submit_signal(chain, ids, kind)

    def signal(self, chain: KeyChain, token_ids: Sequence[int], kind: str) -> int:
        """Sends a signal (``queued``) on the prompt's full blocks now; never raises.
        Returns the blocks the sidecar marked (0 on any failure or without a store)."""
        store = self.store
        blocks = len(token_ids) // self.block_tokens
        if not isinstance(store, Signalling) or blocks == 0:
            return 0
        try:
            keys = chain.keys(token_ids[: blocks * self.block_tokens])
            marked = store.signal(chain.tenant, keys, kind)
        except CacheError as exc:
            self.metrics.signals_sent.labels(kind=kind, result="failed").inc()
            log.debug("signal %s failed (%s): %s", kind, exc.reason, exc)
            return 0
        self.metrics.signals_sent.labels(kind=kind, result="sent").inc()
        return marked

    def wait_stored(self, timeout_s: float = 30.0) -> bool:
        """Blocks until no store job is pending (tests, prewarm, shutdown)."""
        return self._writer is None or self._writer.wait_idle(timeout_s)

    def close(self) -> None:
        """Finishes pending stores and closes the store."""
        if self._writer is not None:
            self._writer.close()
        if self.store is not None:
            self.store.close()
