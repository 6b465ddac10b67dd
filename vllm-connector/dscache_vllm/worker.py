"""The worker side of the vLLM connector: layer-wise loads and saves around a forward.

One step of vLLM's model runner calls, in order: ``start_load_kv`` (this step's
loads), then per attention layer ``wait_for_layer_load`` before it and
``save_kv_layer`` after it, then ``wait_for_save`` and
``get_block_ids_with_load_errors``. :class:`KVWorker` maps them onto one copier
thread:

* :meth:`KVWorker.start_loads` leases and maps the planned blocks (one Lease call
  per load, zero-copy views on the segment files) and hands the copies to the
  copier, which fills vLLM's pages layer by layer (host pages: with
  ``copy_threads - 1`` helper threads, each a share of the blocks);
  :meth:`KVWorker.wait_layer` returns once its layer's pages are filled, so layer
  ``i``'s attention runs while later layers are still copied.
* Checksums are checked while the copies and the forward run
  (``verify="background"``): for host pages by the copy threads, each layer's slab
  of a block hashed right after its copy (the bytes are read from memory once);
  for pages on a GPU by the sidecar client's verifier thread. :meth:`KVWorker.settle`
  waits for them once the forward is done and returns every page whose block
  failed (or was evicted since the lookup, or whose copy failed); the connector
  reports them through ``get_block_ids_with_load_errors`` in that same step.
* :meth:`KVWorker.save_layer` copies a layer's pages of this step's completed
  blocks out on the copier while the forward goes on to the next layer;
  :meth:`KVWorker.finish_saves` waits for the copies and queues the blocks for the
  writer thread, which stores them through the sidecar client.

Contract:
    * A page whose block did not pass its checksum is never reported as loaded:
      ``settle`` returns it, in the step whose forward read it. vLLM then drops
      that step's output for the request (its sampled token never leaves the
      engine), rewinds the request to the last good page and recomputes the rest
      (``kv_load_failure_policy="recompute"``): a corrupt block costs a recompute,
      never a wrong answer. The request's saves of that step (blocks computed from
      the bad prefix) are dropped, never stored.
    * A block verified once is not hashed again while its segment file is
      unchanged (same inode, size, mtime and ctime, last written over a second
      before it was checked, every write to a segment being a ``pwrite`` that moves
      mtime and ctime) and for at most ``memo_ttl_s``: see
      :class:`dscache_vllm.verified.VerifiedBlocks`.
    * Saves never block the forward: the copy out runs on the copier, the write on
      the writer thread; a full write queue drops blocks (counted).
    * ``load`` and ``save`` never raise for a cache failure: it is counted, and
      the pages are recomputed or the blocks are a future miss.
    * ``shard`` picks this worker's keys in a spec (its tensor-parallel rank's
      blocks); a worker with ``saves=False`` (MLA ranks other than 0: the latent is
      the same on every rank) stores nothing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from dscache_sidecar.client import (
    RAW,
    BlockData,
    Codec,
    LoadedBlocks,
    SidecarClient,
    checksum_hasher,
)

from dscache_vllm.metrics import ConnectorMetrics
from dscache_vllm.paged import DTYPES, Block, PagedKV
from dscache_vllm.plan import LoadSpec, SaveSpec
from dscache_vllm.verified import VerifiedBlocks

log = logging.getLogger(__name__)

#: How loads check checksums: while the forward runs, before the copies, or not.
VerifyMode = Literal["background", "sync", "off"]

#: The longest a step waits for a copy or a background check before it gives the
#: pages up as failed (recomputed): a stuck disk must not hang vLLM.
WAIT_S = 60.0


@dataclass
class _Load:
    """One load of this step: the spec, its leased blocks, and what became of them."""

    spec: LoadSpec
    loaded: LoadedBlocks | None = None
    #: (block, first page in it, page ids) of the pages whose block was leased.
    runs: list[tuple[int, int, list[int]]] = field(default_factory=list)
    views: dict[int, Block] = field(default_factory=dict)
    #: Why nothing (or not everything) could be copied, as a load_failures reason.
    failed: str | None = None
    locations: list[Any] = field(default_factory=list)
    stamps: dict[str, Any] = field(default_factory=dict)
    checked: bool = False  # these blocks' checksums are hashed (not all remembered)
    #: Hashed on the copy threads as their layers are copied (host pages), not by the
    #: client's verifier: the checksums each block must have, and the blocks that
    #: did not match.
    expected: list[int] | None = None
    mismatched: set[int] = field(default_factory=set)
    start: float = 0.0


#: One block's share of a load: the load, the block, its first page, vLLM's page ids.
_Copy = tuple[_Load, int, int, list[int]]


@dataclass
class _Save:
    spec: SaveSpec
    keys: tuple[bytes, ...]
    parents: tuple[bytes, ...]
    out: np.ndarray
    views: list[Block]


@dataclass
class _Step:
    """The copier's work of one forward pass."""

    layers: int
    loads: list[_Load] = field(default_factory=list)
    filled: list[threading.Event] = field(default_factory=list)
    loads_done: threading.Event = field(default_factory=threading.Event)
    saves: list[_Save] | None = None
    saved_layers: set[int] = field(default_factory=set)
    saves_pending: int = 0
    saves_done: threading.Event = field(default_factory=threading.Event)
    settled: set[int] | None = None
    #: The copies ran past ``WAIT_S``: the copier stops writing pages.
    cancelled: bool = False
    #: ``get_block_ids_with_load_errors`` was answered: the next call opens a step.
    closed: bool = False
    #: The saves were handed to the writer (or dropped): ``finish_saves`` is done.
    queued: bool = False
    failed_requests: set[str] = field(default_factory=set)
    load_s: float = 0.0


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
        verify: when loaded blocks' checksums are checked (``True`` is "sync",
            ``False`` is "off").
        queue_blocks: bound of blocks waiting for the writer.
        shard: which keys of a spec are this worker's (its tensor-parallel rank for
            GQA/MHA; 0 for MLA).
        saves: whether this worker stores blocks.
        data_dir: the cache volume as the client maps it (where segment files are
            stamped for ``VerifiedBlocks``); None: no memo.
        memo_ttl_s: how long a verified block stays trusted while its segment is
            unchanged (0: hash on every load).
        copy_threads: threads that copy a load into host pages (the copier, or the
            caller, and ``copy_threads - 1`` helpers); pages on a device are copied by
            the copier.
        layerwise: "on": loads are copied on the copier, layer by layer, while the
            forward runs; "off": ``start_loads`` copies them before it returns;
            "auto": "on" for pages on a device, "off" for host pages (the forward and
            the copies share the CPU: running beside each other, both go slower).
    """

    def __init__(
        self,
        client: SidecarClient,
        paged: PagedKV,
        metrics: ConnectorMetrics,
        *,
        verify: VerifyMode | bool = "background",
        queue_blocks: int = 256,
        shard: int = 0,
        saves: bool = True,
        data_dir: str | None = None,
        memo_ttl_s: float = 60.0,
        copy_threads: int = 2,
        layerwise: Literal["auto", "on", "off"] = "auto",
    ) -> None:
        self.client = client
        self.paged = paged
        self.metrics = metrics
        self.verify: VerifyMode = (
            verify if isinstance(verify, str) else ("sync" if verify else "off")
        )
        self.shard = shard
        self.saves = saves
        self.memo = VerifiedBlocks(data_dir, memo_ttl_s)
        self._queue_blocks = queue_blocks
        self._queued = 0
        self._lock = threading.Lock()
        self._step: _Step | None = None
        #: Wall seconds of the loads (lease to last page copied), for benchmarks.
        self.load_seconds = 0.0
        #: Seconds the forward waited for a layer's pages (``wait_layer``).
        self.wait_seconds = 0.0
        #: Loads whose checksums were hashed (the others were all remembered).
        self.checked_loads = 0
        self._threads = max(1, copy_threads) if paged.on_host else 1
        self.layerwise = layerwise == "on" or (layerwise == "auto" and not paged.on_host)
        self._helpers = ThreadPoolExecutor(
            max_workers=max(1, self._threads - 1), thread_name_prefix="dscache-copy"
        )
        for _ in range(self._threads - 1):  # started now, not on the first load
            self._helpers.submit(lambda: None)
        self._copies: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._copier = threading.Thread(target=self._copy_loop, name="dscache-copier", daemon=True)
        self._copier.start()
        # Connect to the sidecar now, off vLLM's thread, so that the first load does
        # not pay for it (the channel, the health check, the shared-tier question).
        self._copies.put(self._connect)
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._writer = threading.Thread(target=self._write_loop, name="dscache-writer", daemon=True)
        self._writer.start()

    # -- one step

    def begin_step(self) -> None:
        """Starts a forward pass's work; the previous step's checks and copies are
        settled and its saves queued first, so nothing of it outlives it."""
        prev = self._step
        if prev is not None:
            self.settle()
            if prev.saves is not None and not prev.queued:
                self.finish_saves([])
        g = self.paged.geometry
        step = _Step(g.num_layers, filled=[threading.Event() for _ in range(g.num_layers)])
        step.loads_done.set()
        step.saves_done.set()
        for e in step.filled:
            e.set()
        self._step = step

    def _current(self) -> _Step:
        """The open step (vLLM calls ``start_load_kv`` before or after the forward,
        so the first call of a step, whichever it is, opens it)."""
        if self._step is None or self._step.closed:
            self.begin_step()
        assert self._step is not None
        return self._step

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Leases and maps this step's loads and copies them: on the copier, layer by
        layer beside the forward, or before returning (``layerwise``)."""
        step = self._current()
        if not specs:
            return
        start = time.perf_counter()
        loads = [self._lease(spec, start) for spec in specs]
        step.loads.extend(loads)
        for e in step.filled:
            e.clear()
        step.loads_done.clear()
        if self.layerwise:
            self._copies.put(lambda: self._copy_in(step, loads))
            return
        try:  # here, before the forward; the copier only ever reads pages meanwhile
            with torch.inference_mode():
                self._copy_in(step, loads)
        except Exception:  # _copy_in catches its own; never fail vLLM's step
            log.exception("dscache copies failed")

    def _lease(self, spec: LoadSpec, start: float) -> _Load:
        job = _Load(spec, start=start)
        keys = list(spec.keys_for(self.shard))
        try:
            grant = self.client.lease(spec.tenant, keys)  # None: no shared volume
            mode: bool | Literal["background"] = self.verify != "off"
            if grant is not None and self.verify == "background":
                job.locations = list(grant.blocks)
                segments = {loc.segment for loc in job.locations}
                job.stamps = {s: st for s in segments if (st := self.memo.stamp(s)) is not None}
                raw = all(Codec(loc.info.codec) is Codec.RAW for loc in job.locations)
                job.checked = not (raw and self.memo.all_known(job.locations, job.stamps))
                mode = "background" if job.checked else False
                if job.checked and raw and self.paged.on_host:
                    job.expected = [loc.info.checksum for loc in job.locations]
                    mode = False  # hashed by the copy threads, see _copy_share
                self.checked_loads += job.checked
            job.loaded = self.client.map_lease(grant, verify=mode, tenant=spec.tenant, keys=keys)
        except Exception as exc:  # the cache never fails a request
            log.warning("dscache load failed (%s); vLLM recomputes %d pages", exc, spec.tokens)
            job.failed = "unavailable"
            return job
        try:
            job.runs = self.paged.runs(
                len(job.loaded), spec.first_block, spec.first_page, spec.page_ids
            )
            job.views = {b: self.paged.block_view(job.loaded.arrays[b]) for b, _, _ in job.runs}
        except Exception as exc:
            log.warning("dscache blocks did not fit vLLM's pages (%s); recomputing", exc)
            job.failed = "layout"
            job.runs = []
        return job

    def _copy_in(self, step: _Step, loads: list[_Load]) -> None:
        """The copier's load job: every load's pages, layer by layer; host pages are
        shared out by block among ``copy_threads`` threads (this one and helpers)."""
        work = [(job, b, j, ids) for job in loads if job.failed is None for b, j, ids in job.runs]
        shares: list[list[_Copy]] = [[] for _ in range(self._threads)]
        pages = [0] * len(shares)
        for item in work:  # fewest pages first: one block's copies stay in one thread
            k = pages.index(min(pages))
            shares[k].append(item)
            pages[k] += len(item[3])
        shares = [share for share in shares if share] or [[]]
        remaining = [len(shares)] * step.layers
        lock = threading.Lock()

        def copy(share: list[_Copy]) -> None:
            self._copy_share(step, share, remaining, lock)

        try:
            helpers = [self._helpers.submit(copy, share) for share in shares[1:]]
            copy(shares[0])
            for f in helpers:
                try:
                    f.result(WAIT_S)
                except TimeoutError:  # a stuck copy: its pages are recomputed
                    step.cancelled = True
                    for job in loads:
                        job.failed = job.failed or "unavailable"
            end = time.perf_counter()
            for job in loads:
                step.load_s = max(step.load_s, end - job.start)
        finally:
            for e in step.filled:
                e.set()
            step.loads_done.set()

    def _copy_share(
        self, step: _Step, share: list[_Copy], remaining: list[int], lock: threading.Lock
    ) -> None:
        """One thread's blocks, layer by layer; a layer is reported filled once every
        thread copied it. A block to check is hashed as its layers are copied (each
        layer's slab of the block right after its copy, while it is in the CPU's
        cache, in the block's byte order), so its bytes are read from memory once."""
        hashers = {
            (id(job), b): checksum_hasher() for job, b, _, _ in share if job.expected is not None
        }
        for li in range(step.layers):
            for job, b, j, ids in share:
                if job.failed is not None or step.cancelled:
                    continue
                try:
                    self.paged.copy_in(li, job.views[b], j, ids)
                    hasher = hashers.get((id(job), b))
                    if hasher is not None:
                        hasher.update(job.loaded.arrays[b][li])  # type: ignore[union-attr]
                except Exception as exc:
                    log.warning("dscache copy into vLLM's pages failed: %s", exc)
                    job.failed = "layout"
            with lock:
                remaining[li] -= 1
                if remaining[li] == 0:
                    step.filled[li].set()
        for job, b, _, _ in share:
            hasher = hashers.get((id(job), b))
            if (
                hasher is not None
                and job.expected is not None
                and job.failed is None
                and hasher.intdigest() != job.expected[b]
            ):
                with lock:
                    job.mismatched.add(b)

    def wait_layer(self, layer: int) -> None:
        """Returns once ``layer``'s pages of this step's loads are filled."""
        step = self._step
        if step is None or step.closed or step.loads_done.is_set():
            return
        start = time.perf_counter()
        if not step.filled[layer].wait(WAIT_S):
            log.warning("dscache copy of layer %d took over %.0f s", layer, WAIT_S)
        self.wait_seconds += time.perf_counter() - start

    def settle(self) -> set[int]:
        """Waits for this step's copies and checks; the pages vLLM must recompute.

        Idempotent within a step; the requests whose pages failed are remembered
        so that this step's saves of theirs are dropped.
        """
        step = self._step
        if step is None:
            return set()
        if step.settled is not None:
            return step.settled
        bad: set[int] = set()
        if not step.loads_done.wait(WAIT_S):
            log.warning("dscache copies did not end in %.0f s; recomputing them", WAIT_S)
            step.cancelled = True
            for job in step.loads:
                job.failed = job.failed or "unavailable"
            step.loads_done.wait(WAIT_S)  # the copier stops at its next page run
        else:
            self.load_seconds += step.load_s
        for job in step.loads:
            bad |= self._settle_load(job, step)
        step.settled = bad
        return bad

    def _settle_load(self, job: _Load, step: _Step) -> set[int]:
        spec, loaded = job.spec, job.loaded
        good_blocks = 0
        reason = job.failed
        if loaded is not None and reason is None:
            try:
                good_blocks = loaded.verified(WAIT_S)
            except Exception as exc:  # a stuck check: give the pages up
                log.warning("dscache checksum check did not end: %s", exc)
                reason = "unavailable"
            if job.mismatched:  # hashed on the copy threads
                good_blocks = min(job.mismatched)
                self.client.report_corrupt([loaded.keys[good_blocks]])
            if good_blocks < len(loaded):
                reason = "corrupt"
            elif len(loaded) < len(spec.keys):
                reason = "missing"  # evicted since the lookup
            if job.checked and good_blocks == len(loaded):
                self.memo.remember(job.locations, job.stamps)
        if loaded is not None:
            loaded.release()
        filled = 0
        if reason != "unavailable" and job.failed is None:
            for b, _j, ids in job.runs:
                if b >= good_blocks:
                    break
                filled += len(ids)
        missing = set(spec.page_ids[filled:])
        if missing:
            self.metrics.load_failed(reason or "missing", len(missing))
            step.failed_requests.add(spec.req_id)
        self.metrics.loaded(filled * self.paged.geometry.page_tokens)
        return missing

    # -- saves

    def _admit(self, step: _Step, specs: Sequence[SaveSpec]) -> list[_Save]:
        """This step's saves that fit the write queue, with their host arrays."""
        g = self.paged.geometry
        np_dtype = DTYPES[g.dtype][1]
        out: list[_Save] = []
        for spec in specs:
            n = len(spec.keys)
            with self._lock:
                if self._queued + n > self._queue_blocks:
                    self.metrics.dropped(n)
                    continue
                self._queued += n
                self._idle.clear()
            keys, parents = spec.keys_for(self.shard)
            arr = np.empty((n, *g.block_shape), dtype=np_dtype)
            out.append(_Save(spec, keys, parents, arr, [self.paged.block_view(a) for a in arr]))
        return out

    def save_layer(self, layer: int, specs: Sequence[SaveSpec]) -> None:
        """Copies ``layer``'s pages of this step's saves out, on the copier."""
        if not self.saves or not specs:
            return
        step = self._current()
        if step.saves is None:
            step.saves = self._admit(step, specs)
        if layer in step.saved_layers or not step.saves:
            return
        step.saved_layers.add(layer)
        self._submit_copy_out(step, [layer])

    def _submit_copy_out(self, step: _Step, layers: list[int]) -> None:
        saves = step.saves or []
        r = self.paged.geometry.pages_per_block
        with self._lock:
            step.saves_pending += 1
            step.saves_done.clear()

        def job() -> None:
            try:
                for li in layers:
                    for s in saves:
                        for b, block in enumerate(s.views):
                            self.paged.copy_out(li, block, 0, s.spec.page_ids[b * r : (b + 1) * r])
            except Exception as exc:
                log.warning("dscache could not copy blocks out for saving: %s", exc)
                step.failed_requests.update(s.spec.req_id for s in saves)
            finally:
                with self._lock:
                    step.saves_pending -= 1
                    if step.saves_pending == 0:
                        step.saves_done.set()

        self._copies.put(job)

    def finish_saves(self, specs: Sequence[SaveSpec]) -> None:
        """Ends this step: copies out the layers no ``save_layer`` call covered,
        waits for the copies and queues the blocks for the writer (all but those of
        requests whose load failed in this step). With speculative decoding vLLM
        calls it after ``end_step``: it then ends the step just closed."""
        step = self._step if self._step is not None else self._current()
        if step.queued:
            return
        try:
            if self.saves and (specs or step.saves):
                if step.saves is None:
                    step.saves = self._admit(step, specs)
                rest = [li for li in range(step.layers) if li not in step.saved_layers]
                if rest and step.saves:
                    step.saved_layers.update(rest)
                    self._submit_copy_out(step, rest)
                if not step.saves_done.wait(WAIT_S):
                    log.warning("dscache copies out did not end in %.0f s; not saving", WAIT_S)
                    step.failed_requests.update(s.spec.req_id for s in step.saves or [])
                self.settle()
                for s in step.saves or []:
                    self._queue(s, step)
        finally:
            step.queued = True
            self.settle()

    def _queue(self, s: _Save, step: _Step) -> None:
        n = len(s.keys)
        if s.spec.req_id in step.failed_requests:
            self._done(n)
            self.metrics.store_failed(n)
            return
        dtype = self.paged.contract_dtype
        blocks = [
            BlockData(key=k, parent=p, array=a, dtype=dtype, token_ids=s.spec.block_token_ids(i))
            for i, (k, p, a) in enumerate(zip(s.keys, s.parents, s.out, strict=True))
        ]
        self._writes.put(_Write(s.spec.tenant, blocks))

    def end_step(self) -> set[int]:
        """Closes the step (``get_block_ids_with_load_errors``): its failed pages."""
        step = self._step
        if step is None:
            return set()
        bad = self.settle()
        step.closed = True
        return bad

    # -- whole operations (tests, and callers without a forward)

    def load(self, spec: LoadSpec) -> set[int]:
        """Fills the spec's pages from the store now; returns the page ids left unfilled."""
        self.begin_step()
        self.start_loads([spec])
        return self.end_step()

    def save(self, spec: SaveSpec) -> None:
        """Copies the spec's blocks out of vLLM's pages and queues them for the store."""
        self.begin_step()
        self.finish_saves([spec])
        self.end_step()

    # -- threads

    def _connect(self) -> None:
        try:
            self.client.has_shared_tier()  # connects first; never raises
        except Exception as exc:  # a dead sidecar: the first load finds out again
            log.debug("dscache sidecar not reachable yet: %s", exc)

    def _copy_loop(self) -> None:
        while True:
            job = self._copies.get()
            if job is None:
                return
            try:
                # vLLM's KV tensors (and tensors made in its forward) are inference
                # tensors: this thread may only write them in inference mode.
                with torch.inference_mode():
                    job()
            except Exception:  # jobs catch their own; never let the copier die
                log.exception("dscache copier job failed")

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
                self.client.store(item.tenant, item.blocks, RAW)
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
        """Lets queued writes finish (bounded), then stops the threads and the client."""
        self.wait_idle(timeout_s)
        self._copies.put(None)
        self._writes.put(None)
        self._copier.join(timeout_s)
        self._helpers.shutdown(wait=False)
        self._writer.join(timeout_s)
        self.client.close()
