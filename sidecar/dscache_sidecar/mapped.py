"""The client's view of the segment files: read-only maps and write descriptors.

Contract:
    * Segment names come from the daemon; a name that resolves outside the data
      directory is refused (``SidecarError``), never opened.
    * A view is checked against the file's current size first: touching a mapping
      past the end of a truncated file would be SIGBUS, so it is an error instead.
    * Thread safe: maps and descriptors are opened once under a lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from pathlib import Path

from dscache_sidecar.errors import SidecarError


class MappedSegments:
    """Read-only mappings and write descriptors of segment files, opened once.

    Paths are resolved (and checked to stay inside the data directory) once per
    segment; the size check that guards against SIGBUS on a truncated file is one
    ``fstat`` of a kept descriptor per segment per load.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._root = data_dir.resolve()
        self._paths: dict[str, Path] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._ro_fds: dict[str, int] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path:
        path = self._paths.get(name)
        if path is None:
            path = (self.data_dir / name).resolve()
            if self._root not in path.parents:
                raise SidecarError(f"segment {name!r} is outside the data directory")
            self._paths[name] = path
        return path

    def _reader(self, name: str) -> tuple[int, mmap.mmap | None]:
        fd = self._ro_fds.get(name)
        if fd is None:
            fd = os.open(self._path(name), os.O_RDONLY)
            self._ro_fds[name] = fd
        return fd, self._maps.get(name)

    def size(self, name: str) -> int:
        """Current size of a segment file."""
        with self._lock:
            fd, _ = self._reader(name)
        try:
            return os.fstat(fd).st_size
        except OSError as exc:
            raise SidecarError(f"segment {name} unreadable: {exc}") from exc

    def view(
        self, name: str, offset: int, length: int, sizes: dict[str, int] | None = None
    ) -> memoryview:
        """A zero-copy view of ``length`` bytes at ``offset``; SidecarError if out of file.

        ``sizes`` caches file sizes for the duration of one load.
        """
        with self._lock:
            fd, m = self._reader(name)
            if m is not None and offset + length > len(m):
                # Mapped while the file was shorter (truncated, since extended again by
                # the daemon): map it anew, or the block stays unreadable for good.
                self._maps.pop(name)
                m = None
            if m is None:
                # Not MAP_POPULATE: that reads and maps the whole segment (256 MiB by
                # default) on its first load; a copy out of a block faults in only
                # its own pages, 64 KiB at a time (the kernel's fault-around).
                m = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED)
                self._maps[name] = m
        # A truncated file would turn a read into SIGBUS: check before touching.
        if sizes is None:
            sizes = {}
        if name not in sizes:
            sizes[name] = self.size(name)
        if offset + length > min(sizes[name], len(m)):
            raise SidecarError(f"segment {name} is shorter than the block (truncated?)")
        return memoryview(m)[offset : offset + length]

    def prefetch(self, name: str, offset: int, length: int) -> None:
        """Asks the kernel to read ``length`` bytes at ``offset`` ahead (MADV_WILLNEED):
        pages evicted since the segment was mapped come back while the caller works,
        instead of one fault at a time on first touch. Best effort."""
        with self._lock:
            m = self._maps.get(name)
        advice = getattr(mmap, "MADV_WILLNEED", None)
        if m is None or advice is None:
            return
        start = offset - offset % mmap.PAGESIZE
        end = min(offset + length, len(m))
        if end > start:
            with contextlib.suppress(OSError, ValueError):
                m.madvise(advice, start, end - start)

    def write(self, name: str, offset: int, data: bytes | memoryview) -> None:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = os.open(self._path(name), os.O_WRONLY)
                self._fds[name] = fd
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                # Views still alive keep the mapping; it goes with them.
                with contextlib.suppress(BufferError):
                    m.close()
            self._maps.clear()
            for fd in (*self._fds.values(), *self._ro_fds.values()):
                os.close(fd)
            self._fds.clear()
            self._ro_fds.clear()
