"""The exclusive lock on a data directory: two daemons must never share a store.

Two allocators on one set of segment files write over each other's blocks (two
rollout tracks on one ``hostPath`` directory did exactly that). So the store takes
this lock before it opens the index or any segment file, and holds it until it is
closed.

Contract:
    * The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<data_dir>/LOCK``: a kernel lock
      on the open file, freed by the kernel when the process dies however it dies
      (``kill -9`` included), so a stale lock cannot outlive its holder. Two opens
      in one process conflict as well (each has its own open file description).
    * :meth:`DataDirLock.acquire` never blocks: a held lock raises
      :class:`~dscache_sidecar.errors.DataDirLockedError` at once, naming the holder
      as its file records it, and changes nothing on disk (the file is opened
      without truncation and only the holder writes it).
    * The holder writes itself into the file (JSON: ``pid``, ``host``, ``pod`` from
      ``POD_NAME`` or ``HOSTNAME``, ``since`` in UTC), for the next one's error.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from dscache_sidecar.errors import DataDirLockedError

LOCK_NAME = "LOCK"
_MAX_HOLDER_BYTES = 4096


def _holder_record() -> dict[str, object]:
    since = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "pod": os.environ.get("POD_NAME") or os.environ.get("HOSTNAME") or "",
        "since": since.isoformat().replace("+00:00", "Z"),
    }


def describe_holder(raw: bytes) -> str:
    """``pid 1234 on host h, pod p, since 2026-12-01T11:00:00Z`` from a lock file's text."""
    try:
        rec = json.loads(raw)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or "pid" not in rec:
        return "holder not recorded yet"
    text = f"pid {rec.get('pid')} on host {rec.get('host', '?')}"
    pod = rec.get("pod")
    if pod and pod != rec.get("host"):
        text += f", pod {pod}"
    return f"{text}, since {rec.get('since', '?')}"


class DataDirLock:
    """The lock on one data directory; :meth:`acquire`, then :meth:`release` (idempotent)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Takes the lock and records this process as its holder.

        Raises:
            DataDirLockedError: another daemon (or another store in this process)
                holds it.
        """
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = describe_holder(os.pread(fd, _MAX_HOLDER_BYTES, 0))
            os.close(fd)
            raise DataDirLockedError(self.directory, holder) from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps(_holder_record()).encode() + b"\n"
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd

    def release(self) -> None:
        """Clears the holder record and frees the lock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the only descriptor frees the flock
