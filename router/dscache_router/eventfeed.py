"""The picker's KV-event feed: what each pod's sidecar holds, as it changes.

The picker learns a pod's holdings from its sidecar's Bloom filter, fetched every
second and rebuilt every two: a block stored now is known there seconds later.
With the feed on, the picker also subscribes to each known pod's KV events
(:mod:`dscache_sidecar.kvevents`, vLLM's format) and keeps the exact set of block
keys the sidecar announced; while that set is in sync it answers "does this pod
hold this key" instead of the filter (tens of milliseconds behind, no false
positives), and the filter stays the answer for a pod whose feed is not in sync
(just connected, a gap not yet repaired, too many keys, a sidecar without events):
events are lossy by design (a ZeroMQ PUB drops what a slow or joining subscriber
misses), the filter is the periodic reconciliation.

Contract:
    * One daemon thread owns every socket (ZeroMQ sockets are not thread safe):
      per pod a SUB socket on ``tcp://<pod host>:<port>`` and a DEALER on the
      replay port, created for the pods the picker knows and closed for the pods
      it forgot, checked every ``check_s``.
    * Every (re)connection of the live socket starts over from a baseline (a replay
      from 0): a ZeroMQ SUB loses what was published while it was away, and a
      sidecar that restarted is a new publisher whose first batches may be gone.
    * In sync means: the feed applied a baseline (a batch that starts with
      ``AllBlocksCleared``: the sidecar's start, or its answer to a replay from 0,
      whose batches all carry one number) and every batch numbered after it, in
      order. On connecting, and at any gap,
      the feed asks for a replay from the first number it lacks (from 0 on
      connecting); until the answer ends, live batches wait. A lower number in a
      batch newer than the last applied is a restarted sidecar: replay from 0.
    * Without baselines (``baselines=False``: vLLM's own events, which have none;
      the target is :class:`dscache_router.gputier.GpuTier`) the feed asks the same
      replay from 0 on connecting and starts from the first batch it gets (vLLM's
      replay buffer holds its last 10,000 batches); gaps and reconnections are
      handled as above, and the target knows it never has the whole picture.
    * A pod's set holds at most ``max_keys``; past it the pod leaves the feed
      (the filter answers for it from then on) and a warning says so.
    * With an internal token the feed logs in with ZeroMQ PLAIN (user
      ``dscache``, the token), as the sidecar asks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
from dscache_sidecar.kvevents import END_SEQ, PLAIN_USER

log = logging.getLogger(__name__)

Event = dict[str, Any]
#: What a socket of a feed is: the live stream, the replay answers, the live
#: socket's connection events.
_LIVE, _REPLAY, _MONITOR = 0, 1, 2
#: Seconds a replay may go unanswered before it is asked again on a new socket.
REPLAY_TIMEOUT_S = 5.0
#: Live batches kept while a replay is under way (more are dropped: the replay
#: that follows brings them).
MAX_WAITING = 10_000


class FeedTarget(Protocol):
    """What the feed updates: the picker (:class:`dscache_router.picker.Picker`)."""

    def pods(self) -> list[str]: ...

    def events_applied(self, address: str, events: list[Event], baseline: bool) -> bool: ...

    def events_lost(self, address: str) -> None: ...


@dataclass
class _Feed:
    address: str
    sub: zmq.Socket[bytes]
    dealer: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]  # the SUB's connection events
    next_seq: int = -1  # -1: no baseline yet
    last_ts: float = 0.0
    replaying: bool = False
    waiting: list[tuple[int, bytes]] = field(default_factory=list)
    asked_at: float = 0.0
    snapshot_seq: int = -1  # the number of a replayed baseline's batches (all share it)
    dropped: bool = False  # over max_keys: the filter answers for this pod


class EventFeed:
    """Subscribes ``target`` to every pod's sidecar KV events (module contract)."""

    def __init__(
        self,
        target: FeedTarget,
        port: int,
        replay_port: int,
        token: str = "",
        *,
        check_s: float = 1.0,
        baselines: bool = True,
    ) -> None:
        """``baselines`` False: the publisher sends none (vLLM's engine); the feed then
        starts from the first batch it gets (the replay's oldest, else the stream's)."""
        self._target = target
        self._baselines = baselines
        self._port = port
        self._replay_port = replay_port
        self._token = token
        self._check_s = check_s
        self._ctx = zmq.Context()
        self._feeds: dict[str, _Feed] = {}
        self._by_socket: dict[zmq.Socket[bytes], tuple[_Feed, int]] = {}
        self._poller = zmq.Poller()
        self._decoder = msgspec.msgpack.Decoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="picker-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    # -- sockets -----------------------------------------------------------------------

    def _new(self, kind: int) -> zmq.Socket[bytes]:
        """A socket that logs in with the token (when there is one), not yet connected."""
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._token:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._token.encode())
        return sock

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._new(kind)
        sock.connect(endpoint)
        return sock

    def _open(self, address: str) -> None:
        host = address.rsplit(":", 1)[0]
        sub = self._new(zmq.SUB)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)  # before connect: the first too
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://{host}:{self._port}")
        dealer = self._socket(zmq.DEALER, f"tcp://{host}:{self._replay_port}")
        feed = _Feed(address, sub, dealer, monitor)
        self._feeds[address] = feed
        for sock, role in ((sub, _LIVE), (dealer, _REPLAY), (monitor, _MONITOR)):
            self._by_socket[sock] = (feed, role)
            self._poller.register(sock, zmq.POLLIN)

    def _close(self, feed: _Feed) -> None:
        feed.sub.disable_monitor()
        for sock in (feed.monitor, feed.sub, feed.dealer):
            self._poller.unregister(sock)
            self._by_socket.pop(sock, None)
            sock.close(linger=0)
        self._feeds.pop(feed.address, None)
        self._target.events_lost(feed.address)

    def _reconcile(self) -> None:
        known = set(self._target.pods())
        for address in list(self._feeds):
            if address not in known:
                self._close(self._feeds[address])
        for address in known - set(self._feeds):
            self._open(address)

    # -- the protocol --------------------------------------------------------------------

    def _ask(self, feed: _Feed, start: int) -> None:
        """Asks for a replay from ``start``; live batches wait until it ends."""
        if feed.replaying:
            return
        feed.replaying = True
        feed.asked_at = time.monotonic()
        feed.dealer.send_multipart([b"", max(0, start).to_bytes(8, "big")])

    def _unstick(self, now: float) -> None:
        """A replay unanswered for :data:`REPLAY_TIMEOUT_S` (a sidecar restarted or
        gone) is asked again on a new socket; what waited is dropped (the replay
        brings it)."""
        for feed in self._feeds.values():
            if feed.replaying and now - feed.asked_at > REPLAY_TIMEOUT_S:
                self._poller.unregister(feed.dealer)
                self._by_socket.pop(feed.dealer, None)
                feed.dealer.close(linger=0)
                host = feed.address.rsplit(":", 1)[0]
                feed.dealer = self._socket(zmq.DEALER, f"tcp://{host}:{self._replay_port}")
                self._by_socket[feed.dealer] = (feed, _REPLAY)
                self._poller.register(feed.dealer, zmq.POLLIN)
                feed.replaying, feed.waiting = False, []
                self._ask(feed, max(feed.next_seq, 0))

    def _on_connected(self, feed: _Feed) -> None:
        """The SUB (re)connected: whatever was published meanwhile is lost to it,
        and the publisher may be a new one. Start from a baseline again."""
        if feed.next_seq >= 0:
            self._target.events_lost(feed.address)
            feed.next_seq = -1
        self._ask(feed, 0)

    def _on_live(self, feed: _Feed, seq: int, payload: bytes) -> None:
        if feed.replaying:
            if len(feed.waiting) < MAX_WAITING:
                feed.waiting.append((seq, payload))
            return
        self._take(feed, seq, payload, live=True)

    def _on_replay(self, feed: _Feed, frames: list[bytes]) -> None:
        if len(frames) != 4:
            return
        _topic, seq, payload = frames[1], frames[2], frames[3]
        if seq == END_SEQ:
            feed.replaying = False
            feed.snapshot_seq = -1
            waiting, feed.waiting = feed.waiting, []
            for n, body in waiting:
                if feed.replaying:  # a gap among them asked again
                    feed.waiting.append((n, body))
                else:
                    self._take(feed, n, body, live=True)
            return
        self._take(feed, int.from_bytes(seq, "big"), payload, live=False)

    def _take(self, feed: _Feed, seq: int, payload: bytes, live: bool) -> None:
        if feed.dropped:
            return
        try:
            ts, events, _rank = self._decoder.decode(payload)
            events = [e for e in events if isinstance(e, dict)]
        except (msgspec.DecodeError, ValueError, TypeError):
            log.warning("picker: an undecodable KV event batch from %s", feed.address)
            return
        baseline = bool(events) and events[0].get("type") == "AllBlocksCleared"
        if not live and seq == feed.snapshot_seq and not baseline:
            pass  # the rest of a replayed baseline: its batches share one number
        elif not baseline and feed.next_seq < 0:
            if self._baselines:
                return  # nothing to build on yet: the replay from 0 brings the baseline
            # No baselines (vLLM's engine): the first batch the feed gets is its start.
        elif not baseline:
            if seq < feed.next_seq:
                if live and isinstance(ts, float) and ts > feed.last_ts:
                    # Numbered lower but newer: the sidecar restarted.
                    self._target.events_lost(feed.address)
                    feed.next_seq = -1
                    self._ask(feed, 0)
                return  # else already applied (a replay overlapping the stream)
            if seq > feed.next_seq:
                if live:
                    feed.waiting.append((seq, payload))
                    self._ask(feed, feed.next_seq)
                return
        if not self._target.events_applied(feed.address, events, baseline):
            feed.dropped = True
            log.warning("picker: %s announced too many keys; its filter answers", feed.address)
            return
        if baseline and not live:
            feed.snapshot_seq = seq
        feed.next_seq = seq + 1
        feed.last_ts = ts if isinstance(ts, float) else feed.last_ts

    # -- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        next_check = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_check:
                    self._reconcile()
                    self._unstick(now)
                    next_check = now + self._check_s
                for sock, _ in self._poller.poll(100):
                    entry = self._by_socket.get(sock)
                    if entry is None:
                        continue
                    feed, role = entry
                    frames = sock.recv_multipart()
                    if role == _REPLAY:
                        self._on_replay(feed, frames)
                    elif role == _MONITOR:
                        self._on_connected(feed)
                    elif len(frames) == 3:
                        self._on_live(feed, int.from_bytes(frames[1], "big"), frames[2])
        except Exception:  # the picker goes on with its filters
            log.exception("picker: the KV event feed stopped")
        finally:
            for feed in list(self._feeds.values()):
                self._close(feed)
            self._ctx.term()
