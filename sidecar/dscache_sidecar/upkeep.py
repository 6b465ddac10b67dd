"""The store's upkeep thread: ends expired leases and reservations, flushes stats.

Contract:
    * Every ``interval_s`` (0.5 s) it calls ``expire``; every ``flush_s`` of the
      clock's monotonic time it calls ``flush``.
    * It outlives any one failure (logged), and :meth:`Reaper.stop` ends it
      within one interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dscache_sidecar.blockstore import Clock

log = logging.getLogger(__name__)


class Reaper:
    """A daemon thread running the store's periodic upkeep; starts at once."""

    def __init__(
        self,
        expire: Callable[[], object],
        flush: Callable[[], None],
        flush_s: float,
        clock: Clock,
        interval_s: float = 0.5,
    ) -> None:
        self._expire = expire
        self._flush = flush
        self._flush_s = flush_s
        self._clock = clock
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-reaper", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the thread (waits at most ``timeout_s``)."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        last_flush = self._clock.monotonic()
        while not self._stop.wait(self._interval_s):
            try:
                self._expire()
                if self._clock.monotonic() - last_flush >= self._flush_s:
                    self._flush()
                    last_flush = self._clock.monotonic()
            except Exception:  # the reaper must outlive any one failure
                log.exception("store upkeep failed")
