"""A KV-event subscriber as a router runs one (for the tests of every package): a real
ZeroMQ SUB socket (and a DEALER for replays) on a sidecar's endpoints, and the
holdings it learns from the events."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from dscache_sidecar.kvevents import END_SEQ, PLAIN_USER

Event = dict[str, Any]


@dataclass
class Holdings:
    """What a subscriber believes a node holds: key -> (parent, token ids)."""

    blocks: dict[bytes, tuple[bytes | None, list[int]]] = field(default_factory=dict)

    def apply(self, event: Event) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            self.blocks.clear()
        elif kind == "BlockStored":
            size = event["block_size"]
            parent = event["parent_block_hash"]
            for i, key in enumerate(event["block_hashes"]):
                self.blocks[key] = (parent, event["token_ids"][i * size : (i + 1) * size])
                parent = key
        elif kind == "BlockRemoved":
            for key in event["block_hashes"]:
                self.blocks.pop(key, None)
        else:
            raise AssertionError(f"unknown event type {kind!r}")


class Subscriber:
    """Subscribes to ``endpoint``; asks ``replay`` for missed batches.

    ``password``: log in with ZeroMQ PLAIN (as the sidecar's user) when set.
    """

    def __init__(self, endpoint: str, replay: str = "", password: str | None = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self._socket(zmq.SUB, password)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.password = password
        self.seen: list[tuple[int, list[Event]]] = []
        #: Every batch's payload as it came, in order (for a second decoder).
        self.payloads: list[bytes] = []
        self.holdings = Holdings()
        self.next_seq = 0
        self._snapshot_seq = -1  # a replayed baseline's batches share one number

    def _socket(self, kind: int, password: str | None) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if password is not None:
            sock.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, password.encode())
        return sock

    def _take(self, seq: int, payload: bytes) -> None:
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank is None
        baseline = bool(events) and events[0]["type"] == "AllBlocksCleared"
        if baseline:
            self._snapshot_seq = seq
        elif seq < self.next_seq and seq != self._snapshot_seq:
            return  # already had it (a replay overlapping the live stream)
        self.seen.append((seq, events))
        self.payloads.append(payload)
        for event in events:
            self.holdings.apply(event)
        self.next_seq = seq + 1

    def poll(self, until: Callable[[], bool], timeout_s: float = 10.0) -> bool:
        """Reads the live stream until ``until()`` holds; whether it did in time.

        As a router's subscriber does, it asks for a replay when a batch comes
        with a later number than the next it expects (a gap), and when the stream
        has been quiet for a while (a batch published while this socket was still
        joining never arrives at all: ZeroMQ's PUB drops it).
        """
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self.sub.poll(int(min(left, 0.1) * 1000)):
                _topic, seq, payload = self.sub.recv_multipart()
                n = int.from_bytes(seq, "big")
                if n > self.next_seq and self.replay_endpoint:
                    self.replay(self.next_seq)
                self._take(n, payload)
                quiet_since = time.monotonic()
            elif self.replay_endpoint and time.monotonic() - quiet_since > 0.5:
                self.replay(self.next_seq, timeout_s=max(0.1, min(left, 2.0)))
                quiet_since = time.monotonic()
        return True

    def replay(self, start: int, timeout_s: float = 10.0) -> list[int] | None:
        """Asks for the batches from ``start`` and takes those it had not seen (ask
        before reading the live stream): their sequence numbers, None without an
        answer."""
        dealer = self._socket(zmq.DEALER, self.password)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got: list[int] = []
            while True:
                if not dealer.poll(int(timeout_s * 1000)):
                    return None
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return got
                got.append(int.from_bytes(seq, "big"))
                self._take(got[-1], payload)
        finally:
            dealer.close()

    def events(self) -> list[Event]:
        return [e for _, batch in self.seen for e in batch]

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()
