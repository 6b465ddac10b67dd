"""The holdings publisher: a Bloom filter of every key in the index, kept fresh.

The sidecar's HTTP server serves the latest build at ``GET /dscache/holdings``
(:mod:`dscache_sidecar.probes`); the format is :mod:`dscache_sidecar.holdings`.

Contract:
    * Every ``refresh_s`` seconds a daemon thread asks the store whether its index
      changed since the last build (:meth:`Listing.change_id`, one LMDB call) and
      only then reads its keys, all tenants, in one read transaction that takes no
      store lock and copies no values, straight into a filter sized for
      ``max(2 x keys, 1024)`` keys at a 1% false-positive rate. The first build is
      made as soon as the thread starts.
    * A build is encoded once and replaces the previous one in a single reference
      assignment: a reader gets the old build or the new one, whole. Builds are
      numbered from 1, one up per build; a refresh that finds the index unchanged
      keeps the build and its number. A build's ``etag`` (the publisher's random
      boot id and the number) names it across restarts, so a reader that has it
      can ask for the body only when it changed (``If-None-Match``: 304).
    * At most :data:`MAX_KEYS` keys go into a filter; the keys past it (in key
      order, so an arbitrary sample) are missing from it, which costs a router
      only a less-than-ideal choice. A warning says so when it starts happening.
    * A failed build is logged (at most once a minute) and the previous build
      stays published; the thread outlives it. :meth:`HoldingsPublisher.stop`
      ends it within one wait, and must come before the store is closed.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from dataclasses import dataclass

from dscache_sidecar.blockstore import Listing
from dscache_sidecar.holdings import HoldingsFilter
from dscache_sidecar.metrics import SidecarMetrics

log = logging.getLogger(__name__)

#: Most keys read into one filter: a filter sized for twice as many is about 10 MiB,
#: and reading them takes seconds (a 1 GiB LMDB map holds a few million records).
MAX_KEYS = 4 * 1024 * 1024
#: The smallest filter built, in keys, so an empty or tiny index still answers at
#: the target false-positive rate while it fills.
MIN_CAPACITY = 1024
#: The false-positive rate at the filter's capacity (at half of it, the usual
#: load, the rate is far lower).
FALSE_POSITIVE_RATE = 0.01
#: Seconds between two logged build failures.
_LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Holdings:
    """One published build."""

    generation: int
    """The build's number: 1 for the first, one up per build."""
    keys: int
    """Keys in the filter."""
    body: bytes
    """The filter's bytes (:meth:`HoldingsFilter.to_bytes`), the response body."""
    etag: str = ""
    """The build's HTTP entity tag (quoted): the publisher's boot id and ``generation``."""


class HoldingsPublisher:
    """Rebuilds the holdings filter of ``store`` every ``refresh_s`` seconds, on a
    daemon thread started by :meth:`start`."""

    def __init__(
        self,
        store: Listing,
        refresh_s: float,
        metrics: SidecarMetrics,
        max_keys: int = MAX_KEYS,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError("refresh_s must be positive")
        self._store = store
        self._refresh_s = refresh_s
        self._metrics = metrics
        self._max_keys = max_keys
        self._current: Holdings | None = None
        self._built_from: int | None = None
        self._capped = False
        self._boot = secrets.token_hex(6)  # a restarted sidecar's builds never match old tags
        self._last_failure_log = -_LOG_EVERY_S
        # refresh() runs on the thread, and in tests on the caller's: one at a time.
        self._build_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kv-holdings", daemon=True)

    def current(self) -> Holdings | None:
        """The latest build, or None before the first."""
        return self._current

    def start(self) -> None:
        """Starts the thread; it builds at once, then every ``refresh_s``."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ends the thread (waits at most ``timeout_s`` for a build in progress)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def refresh(self) -> bool:
        """Builds and publishes a new filter if the index changed; whether it did."""
        with self._build_lock:
            change = self._store.change_id()
            if change == self._built_from and self._current is not None:
                return False
            start = time.perf_counter()
            with self._store.scan_keys() as (total, keys):
                # The count and the keys come from one snapshot: exactly ``count`` go in.
                count = min(total, self._max_keys)
                bloom = HoldingsFilter(max(2 * count, MIN_CAPACITY), FALSE_POSITIVE_RATE)
                bloom.update(itertools.islice(keys, count))
            body = bloom.to_bytes()
            previous = self._current
            generation = 1 if previous is None else previous.generation + 1
            self._current = Holdings(generation, count, body, f'"{self._boot}-{generation}"')
            self._built_from = change
            self._metrics.holdings_build.observe(time.perf_counter() - start)
            self._metrics.holdings_keys.set(count)
            self._metrics.holdings_bytes.set(len(body))
            self._note_cap(total)
            return True

    def _note_cap(self, total: int) -> None:
        capped = total > self._max_keys
        if capped and not self._capped:
            log.warning(
                "holdings filter: the index has %d keys, only the first %d are published",
                total,
                self._max_keys,
            )
        self._capped = capped

    def _loop(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception:  # the publisher must outlive any one failure
                now = time.monotonic()
                if now - self._last_failure_log >= _LOG_EVERY_S:
                    self._last_failure_log = now
                    log.exception("holdings filter build failed; the previous one stays")
            if self._stop.wait(self._refresh_s):
                return
