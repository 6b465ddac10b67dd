"""Errors of the sidecar: the client's (every failure of the cache is a ``SidecarError``)
and the one that stops a daemon from starting (:class:`DataDirLockedError`).

Callers treat any ``SidecarError`` as a miss and recompute; the subclasses say
why, for metrics and logs.
"""

from __future__ import annotations

from pathlib import Path

import grpc


class DataDirLockedError(Exception):
    """Another daemon (or store) holds the data directory's lock (:mod:`dscache_sidecar.dirlock`).

    Not a ``SidecarError``: it is raised where a store opens, never to a cache client.
    """

    def __init__(self, directory: Path, holder: str) -> None:
        self.directory = directory
        self.holder = holder
        super().__init__(
            f"data dir {directory} is locked by another dscache sidecar ({holder}): "
            "two daemons must never share a store"
        )


class SidecarError(Exception):
    """Any failure of the cache; callers fall back to recompute."""


class SidecarUnavailableError(SidecarError):
    """The daemon did not answer (down, restarting, or slower than the timeout)."""


class SidecarFullError(SidecarError):
    """The store could not make room (RESOURCE_EXHAUSTED)."""


class SidecarRejectedError(SidecarError):
    """The daemon rejected the request as malformed (INVALID_ARGUMENT)."""


def wrap_rpc_error(exc: grpc.RpcError) -> SidecarError:
    """The ``SidecarError`` subclass for a gRPC failure's status code."""
    code = exc.code() if hasattr(exc, "code") else None
    detail = exc.details() if hasattr(exc, "details") else str(exc)
    msg = f"{code.name if code else 'ERROR'}: {detail}"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return SidecarUnavailableError(msg)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return SidecarFullError(msg)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        return SidecarRejectedError(msg)
    return SidecarError(msg)
