"""Fault injection for chaos tests: a slow daemon and a full disk, switched at run time.

A testing aid, off by default (``fault_injection``, flag ``--fault-injection``);
never to be enabled in production: anyone who reaches the HTTP port can then slow
the daemon down or refuse every write.

Contract (what ``dscache chaos`` codes against; keep it exact):
    * ``PUT /debug/fault`` on the daemon's HTTP port (the metrics/probe port) with a
      JSON object ``{"delay_s": float >= 0, "enospc": bool}``. Both keys are
      optional (default ``0`` and ``false``); the body *replaces* the current faults,
      so ``{}`` clears them. The answer is ``200`` with the faults now in force.
      A body that is not such an object is ``400`` with the reason and changes
      nothing.
    * ``GET /debug/fault`` answers the current faults in the same JSON shape.
    * With fault injection off, ``/debug/fault`` is ``404``.
    * ``delay_s``: every ``dscache.v1.KVCache`` call (never the health service) waits
      that long before it is served, in the daemon's interceptor; a call whose
      deadline comes first ends at its deadline with ``DEADLINE_EXCEEDED``, unserved.
    * ``enospc``: every write of block data (payload or header) to a segment file
      raises ``OSError(ENOSPC)`` at the lowest write point
      (:meth:`dscache_sidecar.segments.SegmentFiles.pwrite`), so the store's real
      full-disk handling runs: the write is refused with ``RESOURCE_EXHAUSTED``,
      its space is freed, reads go on.

Thread safety: :class:`FaultInjector` may be read and set from any thread.
"""

from __future__ import annotations

import errno
import threading
import time

from pydantic import BaseModel, ConfigDict, Field, StrictBool


class Faults(BaseModel):
    """The faults in force; the JSON body of ``/debug/fault``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delay_s: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Seconds every KVCache call waits before it is served."""
    enospc: StrictBool = False
    """Every write of block data to a segment file fails as on a full disk."""


class FaultInjector:
    """The daemon's current :class:`Faults`; the store and the interceptor ask it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults = Faults()

    @property
    def faults(self) -> Faults:
        with self._lock:
            return self._faults

    def set(self, faults: Faults) -> None:
        """Replaces the faults in force."""
        with self._lock:
            self._faults = faults

    def delay(self, time_remaining: float | None = None) -> bool:
        """Waits ``delay_s``, or only ``time_remaining`` (the caller's deadline) when
        that is shorter; False then: the caller has given up, do not serve it."""
        wait = self.faults.delay_s
        if wait <= 0:
            return True
        if time_remaining is not None and time_remaining < wait:
            time.sleep(max(0.0, time_remaining))
            return False
        time.sleep(wait)
        return True

    def check_write(self) -> None:
        """Raises ``OSError(ENOSPC)`` while ``enospc`` is set (before a segment write)."""
        if self.faults.enospc:
            raise OSError(errno.ENOSPC, "No space left on device (injected fault)")
