"""The processes of one dev cluster: started with a log each, recorded, waited on, stopped.

Contract:
    * :meth:`Supervisor.launch` starts a command through the tooling's supervisor
      (:func:`dscache_tools.procs.start_child`: its own session, stdout and stderr
      appended to ``<state_dir>/logs/<name>.log``, the command line first),
      records it as a :class:`ProcessRecord` and calls ``on_change`` so the
      cluster's ``state.json`` always lists every process.
    * With ``tie_to_parent`` each process also gets PR_SET_PDEATHSIG (SIGKILL),
      so none outlives the process that started it even if that process is
      killed. SIGKILL, not SIGTERM: with its parent gone nobody stops the
      processes in order, and an API server whose etcd went first retries its
      lease clean-up instead of exiting. The state is throw-away anyway.
    * :meth:`Supervisor.wait` polls a readiness probe and fails fast with
      :class:`ClusterError` (naming the log and its tail) when a process it
      started exits or the deadline passes.
    * :meth:`Supervisor.stop` sends SIGTERM to a group of processes, then
      SIGKILL after :data:`STOP_GRACE_S`; it only signals pids whose
      executable is the recorded one (:func:`.procs.process_running`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.devcluster.procs import process_running, tail
from dscache_tools.polling import poll
from dscache_tools.procs import start_child

logger = logging.getLogger(__name__)

#: Seconds from SIGTERM to SIGKILL.
STOP_GRACE_S = 10.0


class ClusterError(RuntimeError):
    """The cluster could not start, or a state dir holds a running cluster."""


@dataclass(frozen=True)
class ProcessRecord:
    """One started component."""

    name: str
    pid: int
    exe: str
    log: str


class Supervisor:
    """Starts and stops the processes of the cluster in ``state_dir``.

    Args:
        state_dir: The cluster's state directory (logs go to ``logs/``).
        records: Processes already started (from ``state.json``); appended to.
        on_change: Called after each launch (saves the state).
        tie_to_parent: Kill the processes when this process dies.
    """

    def __init__(
        self,
        state_dir: Path,
        records: list[ProcessRecord],
        on_change: Callable[[], None] = lambda: None,
        tie_to_parent: bool = False,
    ) -> None:
        self.state_dir = state_dir
        self.records = records
        self.tie_to_parent = tie_to_parent
        self._on_change = on_change
        self._popens: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def log_dir(self) -> Path:
        """Where each component's log is."""
        return self.state_dir / "logs"

    def running(self) -> list[str]:
        """Names of the components whose process is still alive."""
        return [p.name for p in self.records if process_running(p.pid, p.exe)]

    def launch(self, name: str, command: list[str]) -> None:
        """Starts ``command`` as component ``name``."""
        log_path = self.log_dir / f"{name}.log"
        tie = signal.SIGKILL if self.tie_to_parent else None
        child = start_child(name, command, log_path, cwd=self.state_dir, tie=tie, header=True)
        popen = child.proc
        self._popens[name] = popen
        # /proc/<pid>/exe is the resolved path; compare like with like.
        exe = os.path.realpath(command[0])
        self.records.append(ProcessRecord(name=name, pid=popen.pid, exe=exe, log=str(log_path)))
        self._on_change()
        logger.debug("started %s (pid %d)", name, popen.pid)

    def check_alive(self) -> None:
        """Raises :class:`ClusterError` when a process started here has exited."""
        for record in self.records:
            popen = self._popens.get(record.name)
            code = popen.poll() if popen is not None else None
            if code is not None:
                raise ClusterError(
                    f"{record.name} exited with code {code} during start-up; "
                    f"logs in {self.log_dir}. {record.log}:\n{tail(Path(record.log))}"
                )

    def wait(self, what: str, ready: Callable[[], bool], deadline: float) -> None:
        """Waits until ``ready()`` while every process lives; ``what`` names the log to show.

        Raises:
            ClusterError: A process exited, or ``deadline`` (monotonic) passed.
        """
        began = time.monotonic()

        def probe() -> bool:
            self.check_alive()
            return ready()

        if not poll(probe, deadline - began, interval=0.1):
            log = self.log_dir / f"{what}.log"
            raise ClusterError(
                f"timed out waiting for {what}; logs in {self.log_dir}. {log}:\n{tail(log)}"
            )
        logger.debug("%s ready after %.1f s", what, time.monotonic() - began)

    def stop(self, names: Collection[str]) -> None:
        """SIGTERM to the processes named, SIGKILL to those alive after the grace period."""
        records = [p for p in self.records if p.name in names]
        for record in records:
            if process_running(record.pid, record.exe):
                logger.debug("SIGTERM %s (pid %d)", record.name, record.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for record in records:
            self._wait_exit(record, deadline)

    def _wait_exit(self, record: ProcessRecord, deadline: float) -> None:
        popen = self._popens.get(record.name)

        def gone() -> bool:
            if popen is not None:
                # Reaps our own child, so it does not linger as a zombie.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    popen.wait(timeout=0)
            return not process_running(record.pid, record.exe)

        if not poll(gone, deadline - time.monotonic(), interval=0.1):
            logger.warning("%s (pid %d) ignored SIGTERM; killing it", record.name, record.pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGKILL)
        if popen is not None:
            popen.wait()
