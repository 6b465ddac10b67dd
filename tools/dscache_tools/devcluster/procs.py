"""Process and file helpers every part of the dev cluster shares (standard library only).

The binary build (:mod:`.build`) and the image build (:mod:`.images`) run
before the project's dependencies are installed (CI starts them in the
background first), so this module imports nothing outside the standard
library; the cluster itself (:mod:`.cluster`) uses it too, so each rule is
written once.

Contract:
    * :func:`process_running` is true only for a live, non-zombie process whose
      executable is the one recorded, so a recycled pid is never mistaken for
      (and never signalled as) one of ours.
    * :func:`exclusive_lock` serialises builders on one host; the second waits
      and says so once.
    * :func:`wait_with_heartbeat` reports progress of a long child and, when
      interrupted, kills the child's whole process group so no compiler or
      build step outlives us.
    * :func:`write_private` creates files with mode 0600 (keys, kubeconfigs);
      :func:`atomic_write` replaces a file so a reader never sees half of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

#: Called with one line of human-readable progress.
Progress = Callable[[str], None]


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from ``/proc/<pid>/stat``, ``""`` when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # The command name in parentheses may itself hold spaces and ')'.
    return stat.rsplit(")", 1)[-1].split()[0]


def process_running(pid: int, exe: str) -> bool:
    """True when ``pid`` is alive, not a zombie, and runs ``exe``."""
    try:
        target = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    state = process_state(pid)
    return state not in ("", "Z", "X") and target.removesuffix(" (deleted)") == exe


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log, ``""`` when it cannot be read."""
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def atomic_write(path: Path, text: str) -> None:
    """Replaces ``path`` with ``text`` through a temporary file beside it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_private(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` readable by its owner only (0600), creating parents."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


@contextlib.contextmanager
def exclusive_lock(path: Path, say: Progress, what: str = "build") -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``path`` for the ``with`` block, waiting if needed."""
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another {what} holds {path}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def wait_with_heartbeat(
    proc: subprocess.Popen[bytes], every: float, beat: Callable[[], None]
) -> int:
    """Waits for ``proc`` (started with ``start_new_session``), calling ``beat`` every ``every`` s.

    Returns:
        The exit code.

    Raises:
        BaseException: Whatever interrupted the wait (Ctrl-C, a test timeout),
            after killing the child's process group.
    """
    try:
        while True:
            try:
                return proc.wait(timeout=every)
            except subprocess.TimeoutExpired:
                beat()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def exit_on_sigterm() -> None:
    """Turns SIGTERM into ``SystemExit``, so ``finally`` blocks stop what we started.

    CI may stop a background build with SIGTERM.
    """

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def process_name(pid: int) -> str:
    """``/proc/<pid>/comm``, ``""`` when the process is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    """The command line of ``pid`` joined by spaces, ``""`` when the process is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def terminate(pid: int, grace: float) -> None:
    """SIGTERM to ``pid``, SIGKILL when it still runs after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if process_state(pid) in ("", "Z"):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def mount_points(*roots: Path) -> list[str]:
    """Mount points at or under any of ``roots``, from /proc/self/mountinfo, deepest first."""
    prefixes = [str(root).rstrip("/") for root in roots]
    found: list[str] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


#: Where the kernel's cgroup hierarchies are mounted (v1: one directory each; v2: here).
CGROUP_ROOT = Path("/sys/fs/cgroup")


def remove_cgroup_tree(path: Path) -> list[Path]:
    """Removes cgroup ``path`` and every group under it, deepest first.

    A group removes with ``rmdir`` once it holds no process and no child group
    (its control files go with it). Returns the groups that could not be removed
    (still in use), deepest first; a missing one is no error.
    """
    if not path.is_dir():
        return []
    groups = [p for p in path.rglob("*") if p.is_dir()]
    left: list[Path] = []
    for group in [*sorted(groups, key=lambda p: len(p.parts), reverse=True), path]:
        try:
            group.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            left.append(group)
    return left


def remove_cgroup(name: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """Removes the top-level cgroup ``name`` and every group under it, in each hierarchy.

    For daemons told to put their work under a cgroup of their own (dockerd's
    ``--cgroup-parent``): the kernel keeps an empty cgroup until it is removed, so
    the host would keep it. Returns the groups left in use (:func:`remove_cgroup_tree`).
    """
    tops = [top for top in (root / name, *root.glob(f"*/{name}")) if top.is_dir()]
    return [group for top in tops for group in remove_cgroup_tree(top)]
