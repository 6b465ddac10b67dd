"""Serving on after SIGTERM while the daemon's clients are still connected.

Why: Kubernetes sends SIGTERM to every container of a deleted pod at once. The
model server then finishes its in-flight requests and its queued stores before it
exits; a sidecar that stopped at once refused those stores, so a deleted pod lost
the blocks of its last second or so of answers. Serving on until the model server
has gone keeps them, with no change to the pod template (no native sidecar
container, no ``preStop`` hook).

Contract:
    * :func:`connected_clients` counts the connections accepted on a unix socket
      that are still open (Linux ``/proc/net/unix``: an accepted socket carries the
      listening socket's path; a client's own end carries none). A client process
      that exits closes its end and grpc closes ours. Unreadable: 0 (a platform
      without ``/proc`` stops at once, as before).
    * :func:`serve_on` returns as soon as no client is connected, ``max_s`` have
      passed, or ``stop_now`` is set (SIGINT, a second SIGTERM); it returns why.
      It never blocks longer than ``max_s`` plus one poll.
    * Only the unix socket is watched: a client over the loopback TCP listener
      gets what SIGTERM always gave (the grace of in-flight calls).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

#: ``/proc/net/unix``'s state of a connected socket (``SS_CONNECTED``).
_CONNECTED = "03"


def connected_clients(socket_path: str, table: Path = Path("/proc/net/unix")) -> int:
    """Open connections accepted on the unix socket at ``socket_path``."""
    names = {socket_path, os.path.abspath(socket_path)}
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return 0
    count = 0
    for line in lines:
        # Num RefCount Protocol Flags Type St Inode [Path]; the path may hold spaces.
        fields = line.split(maxsplit=7)
        if len(fields) == 8 and fields[5] == _CONNECTED and fields[7] in names:
            count += 1
    return count


def serve_on(
    clients: Callable[[], int],
    max_s: float,
    stop_now: threading.Event,
    poll_s: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """Waits while ``clients()`` is above zero, at most ``max_s``; returns why it
    stopped: ``"no clients"``, ``"max"`` or ``"signal"``."""
    deadline = clock() + max_s
    while True:
        if stop_now.is_set():
            return "signal"
        if clients() == 0:
            return "no clients"
        left = deadline - clock()
        if left <= 0:
            return "max"
        stop_now.wait(min(poll_s, left))
