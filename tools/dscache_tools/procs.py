"""The tooling's one process supervisor: children with a log each, waited on, stopped.

Every child process the tooling runs (the local demo's stack, the benches' stand-ins,
test sidecars, ``vllm serve``, Redis Cluster nodes, the dev cluster's components) is
started here.

Contract:
    * :func:`start_child` runs a command in a session (process group) of its own with
      stdin closed and stdout and stderr appended to its log file (after a
      ``# command line`` header when asked); nothing inherits the terminal, so Ctrl-C
      reaches only the parent, which stops the children.
    * ``tie`` gives the child ``PR_SET_PDEATHSIG`` (Linux) with that signal, so even a
      parent killed with SIGKILL takes it down. The signal fires when the *thread*
      that started the child ends: tie only children started from a thread that
      lives as long as they should.
    * :meth:`Child.wait_ready` polls a readiness check and fails early, naming the log
      and its tail, when the child exits first or the time is up.
    * :meth:`Child.stop` signals the child's whole group (its stop signal, then
      SIGKILL after a grace period; a group whose leader died, e.g. NGINX workers, is
      killed) and returns the exit code; :meth:`Child.kill` is the crash case.
    * Standard library only at import: the image builder runs it before the
      project's own install.
    * :class:`ProcessGroup` holds the children of one stack and stops them in reverse
      start order on exit (their signal, then SIGKILL), never leaving one behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class StartError(RuntimeError):
    """A child did not become ready; the message names its log file."""


#: prctl option that sets the signal a child gets when its parent thread ends.
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A ``preexec_fn`` that sends ``sig`` to the child when its parent dies (even by
    SIGKILL); a no-op off Linux."""

    def preexec() -> None:  # pragma: no cover - runs in the child
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return preexec


def start_child(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stop_signal: int = signal.SIGTERM,
    tie: signal.Signals | None = None,
    header: bool = False,
) -> Child:
    """Starts ``argv`` in a session of its own with its output appended to ``log_path``.

    Args:
        env: the child's whole environment (None: this process's).
        cwd: its working directory.
        stop_signal: what :meth:`Child.stop` sends first.
        tie: the signal the child gets when the starting thread ends (None: none).
        header: write ``# <command line>`` to the log first.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        if header:
            out.write(("# " + shlex.join(argv) + "\n").encode())
            out.flush()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=str(cwd) if cwd else None,
            start_new_session=True,
            preexec_fn=die_with_parent(tie) if tie is not None else None,  # noqa: PLW1509
        )
    log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
    return Child(name, list(argv), proc, log_path, stop_signal)


@dataclass
class Child:
    """One running child process."""

    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_signal: int = signal.SIGTERM

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    def alive(self) -> bool:
        """Whether the process still runs."""
        return self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The last lines of its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(
        self, check: Callable[[], bool], *, timeout_s: float, what: str, interval_s: float = 0.2
    ) -> None:
        """Polls ``check`` until it is true; fails early, with the log's tail, if the
        process exits first.

        Raises:
            StartError: the process exited, or ``timeout_s`` passed.
        """

        from dscache_tools.polling import poll  # tenacity: not at import (stdlib only)

        def ready() -> bool:
            if check():
                return True
            if not self.alive():
                raise StartError(
                    f"{self.name} exited with code {self.proc.returncode} before {what}; "
                    f"log {self.log_path}:\n{self.tail()}"
                )
            return False

        if not poll(ready, timeout_s, interval_s):
            log = f"log {self.log_path}:\n{self.tail()}"
            raise StartError(f"{self.name} not {what} after {timeout_s:.0f}s; {log}")

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the child's process group (nothing if it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def stop(self, grace_s: float = 10.0, sig: int | None = None) -> int | None:
        """Its stop signal (or ``sig``), SIGKILL after ``grace_s``; returns the exit code."""
        if self.alive():
            self.signal(sig if sig is not None else self.stop_signal)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", self.name, grace_s)
                self.signal(signal.SIGKILL)
                self.proc.wait()
        else:
            self.signal(signal.SIGKILL)  # its group may still hold grandchildren
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL to the whole group, as a crash would; waits for the child."""
        self.signal(signal.SIGKILL)
        self.proc.wait()


class ProcessGroup:
    """The children of one stack; a context manager that stops them on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        stop_signal: int = signal.SIGTERM,
    ) -> Child:
        """Starts ``argv`` with output to ``<log_dir>/<name>.log``, tied to this thread
        (SIGTERM when it ends) and with ``env`` on top of this process's environment."""
        child = start_child(
            name,
            argv,
            self.log_dir / f"{name}.log",
            env={**os.environ, **(env or {})},
            cwd=cwd,
            stop_signal=stop_signal,
            tie=signal.SIGTERM,
        )
        self.children.append(child)
        return child

    def stop(self, child: Child, *, grace_s: float = 10.0, sig: int | None = None) -> int | None:
        """Stops one child (its signal, then SIGKILL after ``grace_s``); returns its code."""
        code = child.stop(grace_s, sig)
        if child in self.children:
            self.children.remove(child)
        return code

    def kill(self, child: Child) -> None:
        """SIGKILL, as a crash would (the child stays listed until ``stop``)."""
        child.kill()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stops every child, last started first."""
        for child in reversed(list(self.children)):
            self.stop(child, grace_s=grace_s)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """Whether GET ``url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - loopback
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def terminate_on_sigterm() -> Iterator[None]:
    """Turns SIGTERM and SIGINT into KeyboardInterrupt for the block, so cleanup runs.

    SIGINT is set explicitly because a shell starts background jobs with it
    ignored, and ``kill -INT`` should stop the demo there too.
    """

    def handler(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
