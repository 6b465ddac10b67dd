"""What the shared tier needs from a remote key-value engine: a small interface.

Contract:
    * A :class:`RemoteTier` stores opaque values under string names, with a time to
      live. It knows nothing of blocks, tenants or checksums: naming, the value
      format and verification live in :mod:`dscache_sidecar.shared`, so another
      engine (Valkey, Mooncake Store) is one more class of this protocol.
    * Every batched call is one round trip per engine node (a pipeline), answers in
      the order of the names given, and never retries on its own.
    * Any failure (refused connection, timeout, cluster down, a node moved) raises
      :class:`RemoteTierError`; a name that is not there is ``None``/``False``,
      never an error. Callers treat an error as a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["RemoteTier", "RemoteTierConnectingError", "RemoteTierError"]


class RemoteTierError(Exception):
    """The remote engine failed or did not answer in time.

    Attributes:
        kind: ``timeout``, ``connection`` or ``other`` (a metrics label).
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class RemoteTierConnectingError(RemoteTierError):
    """The engine is still connecting (another call builds its connections): this
    call cannot use it yet. A miss for a read, not a failure: the tier is not
    skipped for it."""

    def __init__(self) -> None:
        super().__init__("connection", "not connected yet: a connect is under way")


class RemoteTier(Protocol):
    """A remote engine behind the shared tier."""

    @property
    def engine(self) -> str:
        """Short engine name for Stats and logs, e.g. ``redis-cluster``."""
        ...

    def connect(self) -> None:
        """Opens a connection to every node now, so that no request pays for it
        (the sidecar calls this in the background at start and after a failure)."""
        ...

    def exists(self, names: Sequence[str]) -> list[bool]:
        """Whether each name holds a value."""
        ...

    def get(self, names: Sequence[str], ttl_s: int) -> list[bytes | None]:
        """Each name's value (None when absent); a read renews the value's TTL."""
        ...

    def put(self, items: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Stores each (name, value) with a time to live, overwriting."""
        ...

    def delete(self, names: Sequence[str]) -> None:
        """Removes the names (absent ones are fine)."""
        ...

    def close(self) -> None:
        """Closes connections; idempotent."""
        ...
