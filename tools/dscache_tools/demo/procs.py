"""Child processes of the local stack: start, wait for readiness, stop them all.

Contract:
    * Every child runs in its own process group with its output in a log file
      under the stack's work dir; nothing inherits the terminal, so Ctrl-C reaches
      only the parent, which then stops the children in reverse start order
      (SIGTERM, then SIGKILL after a grace period) and never leaves one behind.
    * On Linux each child also gets ``PR_SET_PDEATHSIG`` = SIGTERM, so even a parent
      killed with SIGKILL takes its children down. The signal fires when the
      *thread* that started the child ends, so start children from the main thread.
    * ``free_port()`` asks the kernel for an unused loopback port; the small race
      until the child binds it is accepted (the child then fails to start and the
      readiness wait says so, naming its log).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.polling import poll

log = logging.getLogger(__name__)


class StartError(RuntimeError):
    """A child did not become ready; the message names its log file."""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    os.setsid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


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
        """Starts ``argv`` with output to ``<log_dir>/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with log_path.open("ab") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=str(cwd) if cwd else None,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - setsid + pdeathsig only
            )
        child = Child(name, list(argv), proc, log_path, stop_signal)
        self.children.append(child)
        log.debug("started %s (pid %d): %s", name, proc.pid, " ".join(argv))
        return child

    def stop(self, child: Child, *, grace_s: float = 10.0, sig: int | None = None) -> int | None:
        """Stops one child (its signal, then SIGKILL after ``grace_s``); returns its code."""
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, sig if sig is not None else child.stop_signal)
            try:
                child.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0fs; killing it", child.name, grace_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.proc.wait()
        else:
            # Its group may still hold grandchildren (NGINX workers).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
        if child in self.children:
            self.children.remove(child)
        return child.proc.returncode

    def kill(self, child: Child) -> None:
        """SIGKILL, as a crash would (the child stays listed until ``stop``)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.proc.wait()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stops every child, last started first."""
        for child in reversed(list(self.children)):
            self.stop(child, grace_s=grace_s)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def wait_until(
    check: Callable[[], bool],
    *,
    child: Child,
    timeout_s: float,
    what: str,
    interval_s: float = 0.2,
) -> None:
    """Polls ``check`` until it is true; fails early if ``child`` exits."""

    def ready() -> bool:
        if check():
            return True
        if not child.alive():
            raise StartError(
                f"{child.name} exited with code {child.proc.returncode} before {what}; "
                f"log {child.log_path}:\n{child.tail()}"
            )
        return False

    if not poll(ready, timeout_s, interval_s):
        raise StartError(
            f"{child.name} not {what} after {timeout_s:.0f}s; log {child.log_path}:\n{child.tail()}"
        )


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
