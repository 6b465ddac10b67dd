"""KV events: what this node's disk holds, in vLLM's KV-events format over ZeroMQ.

Routers that learn what each pod holds from vLLM's KV events (llm-d's KV-cache
indexer, NVIDIA Dynamo's KV router) subscribe to a ZeroMQ PUB socket. The sidecar
speaks the same protocol for its store, so they see the blocks on the node's disk
beside vLLM's own GPU blocks, under the medium ``STORAGE`` (vLLM's name for its
file-system offload tier).

Contract:
    * Wire (vLLM 0.32's ``ZmqEventPublisher``): each message is three frames: the
      topic, the batch's sequence number (u64 big-endian, from 0 at each start of the
      publisher) and the payload, msgpack of ``[ts, events, data_parallel_rank]``
      (unix seconds; a nil rank). An event is a map tagged by ``type``:
      ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
      ``block_size``, ``lora_id``, ``medium``, ``lora_name``), ``BlockRemoved``
      (``block_hashes``, ``medium``) or ``AllBlocksCleared``. vLLM's own decoder
      reads every batch (``tests/vllm/test_vllm_kvevents.py``).
    * A block hash is the dscache key (32 bytes): keys already carry the model, the
      tenant's salt, the LoRA adapter and the images (docs/keys.md), so two
      different KVs never share one.
    * One ``BlockStored`` names a run of blocks of one chain (each the parent of the
      next) that have the same number of tokens: ``token_ids`` is their tokens end to
      end, ``parent_block_hash`` the first one's parent (nil for a chain's first
      block). A block whose writer gave no tokens is named with ``token_ids`` [] and
      ``block_size`` 0: a consumer that keys by hash uses it, one that keys by
      tokens passes it by.
    * Holdings first: the first batches are ``AllBlocksCleared`` and then every
      block the store holds, parents first; from then on every block published and
      every block removed (evicted, deleted, a tenant cleared, found corrupt). The
      store hands over its holdings and starts telling of changes under one lock
      (:meth:`~dscache_sidecar.store.KVStore.watch_holdings`): nothing is missed or
      told twice.
    * Never in the store's way: a change is put on a bounded queue (no I/O under the
      store's lock); when the queue is full changes are dropped, counted, and a
      resync (``AllBlocksCleared`` and the whole holdings again) follows, so no
      subscriber keeps a wrong picture for long.
    * Replay (vLLM's ROUTER protocol, on the replay endpoint): a request ``[identity,
      "", start]`` (u64 big-endian) is answered with every buffered batch from
      ``start`` on, each ``[identity, "", topic, seq, payload]``, then an end marker
      ``[identity, "", "", -1 (i64 big-endian), ""]``. The buffer keeps the last
      ``buffer_batches``; a request that starts before them is answered, to the
      requester alone, with the whole holdings now (``AllBlocksCleared`` first), every
      batch numbered with the last sequence number published: the stream goes on
      from the next. The changes published after that number were queued before the
      holdings were read or after; applied in order on top of them (every event
      sets a block's state), they leave the right picture either way.
    * A subscriber's rules, then: a batch that starts with ``AllBlocksCleared`` is a
      new baseline, whatever its number (in a replay answer, the batches after it
      with the same number are the rest of it); otherwise apply the next number expected,
      ask for a replay at a gap, and take a lower number from a batch newer than the
      last applied for a restarted publisher (ask for a replay from 0).
    * One thread owns both sockets (ZeroMQ sockets are not thread safe): it sends
      what was queued every ``batch_s`` and serves replays in between.
    * Who may subscribe: the stream names every key the node holds, as the holdings
      filter does. With an internal token, subscribers authenticate with ZeroMQ PLAIN
      (user :data:`PLAIN_USER`, the token as password) unless ``open`` is set, for
      routers that cannot (then only a NetworkPolicy keeps others out).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

from dscache_sidecar.blockstore import HoldingsEvents
from dscache_sidecar.index import BlockRecord
from dscache_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

#: vLLM's medium for blocks in a storage tier (``vllm.distributed.kv_events``).
MEDIUM = "STORAGE"
#: The replay stream's end marker: sequence number -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The ZeroMQ PLAIN user name subscribers authenticate as (the token is the password).
PLAIN_USER = "dscache"
#: Most events in one batch, and most blocks in one event: a batch stays well under
#: a megabyte however large the holdings.
MAX_BATCH_EVENTS = 256
MAX_EVENT_BLOCKS = 256


class Watchable(Protocol):
    """A store that hands over its holdings and tells of changes from then on."""

    def watch_holdings(self, events: HoldingsEvents | None) -> list[tuple[BlockRecord, bytes]]: ...


Event = dict[str, Any]


def stored_events(blocks: Sequence[tuple[BlockRecord, bytes]], medium: str = MEDIUM) -> list[Event]:
    """``BlockStored`` events for ``blocks`` (in chain order, each with its token ids
    as little-endian u32 bytes), one per run of a chain (see the module contract)."""
    events: list[Event] = []
    run: list[tuple[BlockRecord, bytes]] = []
    for rec, tokens in blocks:
        if (
            run
            and rec.parent == run[-1][0].key
            and len(tokens) == len(run[-1][1])
            and len(run) < MAX_EVENT_BLOCKS
        ):
            run.append((rec, tokens))
            continue
        if run:
            events.append(_stored(run, medium))
        run = [(rec, tokens)]
    if run:
        events.append(_stored(run, medium))
    return events


def _stored(run: Sequence[tuple[BlockRecord, bytes]], medium: str) -> Event:
    ids = np.frombuffer(b"".join(t for _, t in run), dtype="<u4")
    return {
        "type": "BlockStored",
        "block_hashes": [rec.key for rec, _ in run],
        "parent_block_hash": run[0][0].parent or None,
        "token_ids": ids.tolist(),
        "block_size": len(run[0][1]) // 4,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed_events(keys: Sequence[bytes], medium: str = MEDIUM) -> list[Event]:
    """``BlockRemoved`` events for ``keys``."""
    return [
        {
            "type": "BlockRemoved",
            "block_hashes": list(keys[i : i + MAX_EVENT_BLOCKS]),
            "medium": medium,
        }
        for i in range(0, len(keys), MAX_EVENT_BLOCKS)
    ]


def encode_batch(events: Sequence[Event], ts: float) -> bytes:
    """One batch's payload: msgpack of ``[ts, events, nil]``."""
    return msgspec.msgpack.encode([ts, list(events), None])


@dataclass(frozen=True, slots=True)
class _Change:
    epoch: int
    events: list[Event]


class _Sink:
    """What the store calls, under its lock: queue the change, never block."""

    def __init__(self, owner: KVEventPublisher, epoch: int) -> None:
        self._owner = owner
        self._epoch = epoch

    def stored(self, recs: Sequence[BlockRecord], tokens: Sequence[bytes]) -> None:
        # Built here (a few microseconds per run) so the records are not kept.
        self._owner.offer(
            _Change(
                self._epoch, stored_events(list(zip(recs, tokens, strict=True)), self._owner.medium)
            )
        )

    def removed(self, recs: Sequence[BlockRecord]) -> None:
        self._owner.offer(
            _Change(self._epoch, removed_events([r.key for r in recs], self._owner.medium))
        )


class KVEventPublisher:
    """Publishes a store's holdings and changes as vLLM KV events (module contract).

    Args:
        store: the store to watch.
        endpoint: the PUB socket's bind address, e.g. ``tcp://*:5557``.
        replay_endpoint: the ROUTER socket's bind address for replays ("" = none).
        metrics: where the counts go.
        topic: the first frame of every message.
        medium: the medium named in every event.
        token: the internal token subscribers must present (ZeroMQ PLAIN); "" = none.
        open_to_all: serve without authentication even with a token.
        buffer_batches: batches kept for replay.
        batch_s: how long changes gather into one batch, seconds.
        max_queue: changes waiting at most; past it a resync replaces them.
    """

    def __init__(
        self,
        store: Watchable,
        endpoint: str,
        replay_endpoint: str,
        metrics: SidecarMetrics,
        *,
        topic: str = "",
        medium: str = MEDIUM,
        token: str = "",
        open_to_all: bool = False,
        buffer_batches: int = 10_000,
        batch_s: float = 0.05,
        max_queue: int = 100_000,
    ) -> None:
        self.medium = medium
        self._store = store
        self._metrics = metrics
        self._topic = topic.encode()
        self._batch_s = batch_s
        self._queue: queue.Queue[_Change] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._seq = itertools.count()
        self._epoch = 0
        self._resync_due: str | None = "start"
        self._sink: _Sink | None = None
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        if token and not open_to_all:
            self._auth = ThreadAuthenticator(self._ctx, log=log.getChild("zap"))
            self._auth.start()
            self._auth.configure_plain(domain="*", passwords={PLAIN_USER: token})
        self._pub = self._socket(zmq.PUB, endpoint)
        self._replay = self._socket(zmq.ROUTER, replay_endpoint) if replay_endpoint else None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else ""
        )
        self._thread = threading.Thread(target=self._loop, name="kv-events", daemon=True)

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, 100_000)
        if self._auth is not None:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            self.close()
            raise ValueError(f"cannot bind KV events to {endpoint!r}: {exc}") from exc
        return sock

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the thread: it publishes the holdings at once, then the changes."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops watching the store, sends what is queued and closes the sockets."""
        self._store.watch_holdings(None)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)
        self.close()

    def close(self) -> None:
        for sock in (getattr(self, "_pub", None), getattr(self, "_replay", None)):
            if sock is not None:
                sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()

    # ------------------------------------------------------------------ the store's side

    def offer(self, change: _Change) -> None:
        """Queues a change (called under the store's lock); a full queue asks for a resync."""
        try:
            self._queue.put_nowait(change)
        except queue.Full:
            self._metrics.kv_event_drops.inc()
            if self._resync_due is None:
                self._resync_due = "dropped"

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        while True:
            try:
                if self._resync_due is not None:
                    self._resync(self._resync_due)
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                changes = self._gather()
                if changes:
                    self._publish([e for c in changes if c.epoch == self._epoch for e in c.events])
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    return
                log.error("KV events: %s", exc)
                time.sleep(0.1)
            except Exception:  # the publisher must outlive any one failure
                log.exception("KV events: publishing failed; resyncing")
                self._resync_due = "error"
                time.sleep(0.1)
            if self._stop.is_set() and self._queue.empty():
                return

    def _gather(self) -> list[_Change]:
        """Changes queued within one batch interval (waits for the first at most that long)."""
        out: list[_Change] = []
        try:
            out.append(self._queue.get(timeout=self._batch_s))
        except queue.Empty:
            return out
        deadline = time.monotonic() + self._batch_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                out.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        return out

    def _resync(self, reason: str) -> None:
        """Publishes ``AllBlocksCleared`` and the whole holdings; later changes follow."""
        self._resync_due = None
        self._epoch += 1
        self._sink = _Sink(self, self._epoch)
        held = self._store.watch_holdings(self._sink)
        self._metrics.kv_event_resyncs.labels(reason=reason).inc()
        self._publish([{"type": "AllBlocksCleared"}, *stored_events(held, self.medium)])

    def _send_holdings(self, identity: bytes, last: int) -> None:
        """Answers one replay request with the whole holdings, numbered ``last``."""
        assert self._replay is not None and self._sink is not None
        held = self._store.watch_holdings(self._sink)  # the same sink: nothing dropped
        self._metrics.kv_event_resyncs.labels(reason="replay_gap").inc()
        number = last.to_bytes(8, "big")
        for batch in _batches([{"type": "AllBlocksCleared"}, *stored_events(held, self.medium)]):
            payload = encode_batch(batch, time.time())
            self._replay.send_multipart([identity, b"", self._topic, number, payload])
            self._metrics.kv_event_batches.labels(how="replay").inc()
        self._replay.send_multipart([identity, b"", b"", END_SEQ, b""])

    def _publish(self, events: Sequence[Event]) -> None:
        for batch in _batches(events):
            seq = next(self._seq)
            payload = encode_batch(batch, time.time())
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            self._buffer.append((seq, payload))
            self._metrics.kv_event_batches.labels(how="publish").inc()
            self._metrics.kv_event_bytes.inc(len(payload))
            for event in batch:
                kind = event["type"]
                self._metrics.kv_events.labels(type=kind).inc()
                self._metrics.kv_event_blocks.labels(type=kind).inc(
                    len(event.get("block_hashes", ()))
                )

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames was ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        if self._buffer and start < self._buffer[0][0]:
            # Batches before the buffer are gone: what they said is the holdings.
            self._send_holdings(identity, self._buffer[-1][0])
            return
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart(
                    [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                )
                self._metrics.kv_event_batches.labels(how="replay").inc()
        self._replay.send_multipart([identity, b"", b"", END_SEQ, b""])


def _batches(events: Sequence[Event]) -> Iterator[list[Event]]:
    for i in range(0, len(events), MAX_BATCH_EVENTS):
        yield list(events[i : i + MAX_BATCH_EVENTS])
