"""The store's upkeep thread: ends expired leases and reservations, runs periodic jobs.

Contract:
    * Every ``interval_s`` (0.5 s) it calls ``expire``; each periodic job ``(period_s,
      fn)`` runs when ``period_s`` of the clock's monotonic time passed since its last
      run (the store's: flushing access statistics, clearing the reader slots of
      reader processes that died).
    * It outlives any one failure (logged), and :meth:`Reaper.stop` ends it
      within one interval.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from dscache_sidecar.blockstore import Clock

log = logging.getLogger(__name__)

#: A periodic job: how often (monotonic seconds) and what.
Job = tuple[float, Callable[[], object]]


class Reaper:
    """A daemon thread running the store's periodic upkeep; starts at once."""

    def __init__(
        self,
        expire: Callable[[], object],
        jobs: Sequence[Job],
        clock: Clock,
        interval_s: float = 0.5,
    ) -> None:
        self._expire = expire
        self._jobs = list(jobs)
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
        last = [self._clock.monotonic()] * len(self._jobs)
        while not self._stop.wait(self._interval_s):
            try:
                self._expire()
            except Exception:  # the reaper must outlive any one failure
                log.exception("store upkeep failed")
            for i, (period_s, job) in enumerate(self._jobs):
                if self._clock.monotonic() - last[i] < period_s:
                    continue
                try:
                    job()
                except Exception:
                    log.exception("store upkeep failed")
                last[i] = self._clock.monotonic()
