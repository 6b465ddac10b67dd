"""The faults ``dscache chaos`` does to a running :class:`LocalStack`, and their undoing.

Every fault hits the first model server's pod (its server or its sidecar) or
the router; every undo returns once the part is healthy again, so the next case
starts from the whole stack. Each call returns a short note for the report.

Contract:
    * Start and restart children from the main thread only: a child dies with
      the thread that started it (``PR_SET_PDEATHSIG``, :mod:`dscache_tools.procs`).
    * A full disk is the real thing when the stack mounted a tmpfs per sidecar
      (root): a ballast file fills it, and removing it frees it. Otherwise it is
      the sidecar's injected ``enospc`` fault. :attr:`FaultDriver.disk_method`
      says which.
    * A slow sidecar is its injected ``delay_s`` (``--fault-injection``), set and
      cleared over ``PUT /debug/fault`` on its metrics port.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dscache_tools.demo.stack import LocalStack, Server, Sidecar

log = logging.getLogger(__name__)

#: Seconds the slow sidecar waits before each gRPC answer: twice the model
#: server's default deadline per call (0.5 s), so every cache call times out.
SLOW_SIDECAR_S = 1.0

BALLAST = "chaos-ballast"

DiskMethod = Literal["tmpfs", "enospc-fault"]


@dataclass
class FaultDriver:
    """Does and undoes each fault on ``stack``'s first pod or its router."""

    stack: LocalStack
    disk_method: DiskMethod

    @property
    def server(self) -> Server:
        """The pod every fault targets (its record changes when it restarts)."""
        return self.stack.servers[0]

    @property
    def sidecar(self) -> Sidecar:
        """That pod's sidecar."""
        sidecar = self.server.sidecar
        if sidecar is None:
            raise RuntimeError("chaos needs servers with sidecars")
        return sidecar

    # -- no fault --------------------------------------------------------------------

    def nothing(self) -> str:
        """The baseline's fault."""
        return ""

    # -- kill -9 ---------------------------------------------------------------------

    def kill_sidecar(self) -> str:
        """SIGKILLs the sidecar."""
        self.stack.kill_sidecar(self.sidecar)
        return f"kill -9 {self.sidecar.name}"

    def restart_sidecar(self) -> str:
        """Starts the sidecar again on its data dir; returns once it serves."""
        t0 = time.perf_counter()
        sidecar = self.stack.restart_sidecar(self.sidecar)
        return f"{sidecar.name} back in {time.perf_counter() - t0:.1f}s"

    def kill_server(self) -> str:
        """SIGKILLs the model server (its sidecar keeps running)."""
        self.stack.kill_server(self.server)
        return f"kill -9 {self.server.name}"

    def restart_server(self) -> str:
        """Starts the server again on its port; returns once it is ready."""
        t0 = time.perf_counter()
        server = self.stack.restart_server(self.server)
        return f"{server.name} ready again in {time.perf_counter() - t0:.1f}s"

    # -- router ----------------------------------------------------------------------

    def reload_router(self) -> str:
        """Reloads NGINX; returns once its old workers have finished and exited."""
        t0 = time.perf_counter()
        self.stack.reload_router()
        return f"nginx reloaded, old workers gone in {time.perf_counter() - t0:.1f}s"

    # -- full disk -------------------------------------------------------------------

    def fill_disk(self) -> str:
        """Fills the sidecar's filesystem (or injects ``enospc``)."""
        if self.disk_method == "enospc-fault":
            self._put_faults(delay_s=0.0, enospc=True)
            return "enospc fault injected (not root: no tmpfs)"
        written = _fill(self.sidecar.data_dir / BALLAST)
        return f"{written / 2**20:.0f} MiB ballast filled {self.sidecar.name}'s tmpfs"

    def free_disk(self) -> str:
        """Undoes :meth:`fill_disk`."""
        if self.disk_method == "enospc-fault":
            self._put_faults(delay_s=0.0, enospc=False)
            return "enospc fault cleared"
        (self.sidecar.data_dir / BALLAST).unlink(missing_ok=True)
        return "ballast removed"

    # -- slow sidecar ----------------------------------------------------------------

    def slow_sidecar(self) -> str:
        """Makes every gRPC answer of the sidecar wait :data:`SLOW_SIDECAR_S`."""
        self._put_faults(delay_s=SLOW_SIDECAR_S, enospc=False)
        return f"sidecar delays each call {SLOW_SIDECAR_S:g}s"

    def fast_sidecar(self) -> str:
        """Clears the delay."""
        self._put_faults(delay_s=0.0, enospc=False)
        return "delay cleared"

    def _put_faults(self, *, delay_s: float, enospc: bool) -> None:
        url = f"http://127.0.0.1:{self.sidecar.metrics_port}/debug/fault"
        body = json.dumps({"delay_s": delay_s, "enospc": enospc}).encode()
        req = urllib.request.Request(url, data=body, method="PUT")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback
                resp.read()
        except OSError as exc:
            raise RuntimeError(
                f"cannot set faults on {url} ({exc}): does this sidecar have --fault-injection?"
            ) from exc


def _fill(path: Path) -> int:
    """Writes to ``path`` until its filesystem is full; returns the bytes written.

    Megabytes first, then pages, so not even a page is left free.
    """
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (b"\0" * 2**20, b"\0" * 4096):
            while True:
                try:
                    written += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return written
