"""Blocks whose checksum matched, remembered while their segment file is unchanged.

A vLLM worker loads the same prefix blocks again and again (every turn of a
conversation); hashing them on every load would cost a pass over their bytes each
time. :class:`VerifiedBlocks` remembers a block checked once, bound to its segment
file's stamp, and says when it need not be hashed again.

Contract:
    * An entry binds a block's location (segment, offset, length, checksum, key) to
      the segment file's stamp (device, inode, size, mtime, ctime) taken *before*
      the block was read for its check; it counts only while the file's stamp is
      exactly that one and for at most ``ttl_s`` seconds.
    * Files changed less than ``QUIET_S`` before they are stamped are not stamped
      (no entry is made).
    * Bounded: at most ``capacity`` entries, the oldest dropped first. Thread safe.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: A segment written less than this long before a check may still change within
#: the file system's timestamp granularity: its blocks are not remembered as checked.
QUIET_S = 1.0


class VerifiedBlocks:
    """Blocks whose checksum matched, remembered while their segment file is unchanged
    (the entries as the module contract says). Trusting an entry again is safe
    because:

    * every change to a segment's bytes (a new block, an evicted block's space
      reused, a repair) is a ``pwrite`` by the sidecar or a client, which sets mtime
      and ctime to the current time; truncation changes size and ctime; a replaced
      file has another inode. ctime cannot be set back from user space;
    * entries are only made for files whose mtime and ctime were over ``QUIET_S``
      old when stamped, so a later write cannot land within the same timestamp
      tick and leave the stamp unchanged;
    * what no stamp shows (a drive returning other bytes than it stored, without an
      error, after the page cache dropped them) is bounded by ``ttl_s``: past it
      the block is hashed again.
    """

    def __init__(self, data_dir: str | None, ttl_s: float, capacity: int = 65_536) -> None:
        self._dir = Path(data_dir) if data_dir else None
        self.ttl_s = ttl_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: dict[tuple[Any, ...], tuple[tuple[int, ...], float]] = {}

    @property
    def enabled(self) -> bool:
        return self._dir is not None and self.ttl_s > 0

    def stamp(self, segment: str) -> tuple[int, ...] | None:
        """The segment file's identity and change times, None when it cannot be read
        or changed too recently to be trusted."""
        if self._dir is None:
            return None
        try:
            st = os.stat(self._dir / segment)
        except OSError:
            return None
        now = time.time_ns()
        if now - max(st.st_mtime_ns, st.st_ctime_ns) < QUIET_S * 1e9:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def all_known(self, locations: Sequence[Any], stamps: dict[str, Any]) -> bool:
        """Whether every leased block is remembered as verified under its current stamp."""
        if not self.enabled or not locations:
            return False
        now = time.monotonic()
        with self._lock:
            for loc in locations:
                stamp = stamps.get(loc.segment)
                entry = self._entries.get(_where(loc))
                if stamp is None or entry is None or entry[0] != stamp or now > entry[1]:
                    return False
        return True

    def remember(self, locations: Sequence[Any], stamps: dict[str, Any]) -> None:
        """Records blocks that just passed their check under the stamps taken before it."""
        if not self.enabled:
            return
        expires = time.monotonic() + self.ttl_s
        with self._lock:
            for loc in locations:
                stamp = stamps.get(loc.segment)
                if stamp is not None:
                    self._entries[_where(loc)] = (stamp, expires)
            while len(self._entries) > self._capacity:
                self._entries.pop(next(iter(self._entries)))


def _where(loc: Any) -> tuple[Any, ...]:
    return (loc.segment, loc.offset, loc.info.stored_bytes, loc.info.checksum, bytes(loc.key))
