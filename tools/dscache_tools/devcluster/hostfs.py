"""Host file-system changes of real nodes: cgroups and mounts; and their undoing.

Contract:
    * :func:`add_cgroup` records, then creates, a cgroup in every mounted
      hierarchy; :func:`add_mount_root` records a directory whose mounts
      (kubelet volumes, sandbox shm) are the cluster's.
    * :func:`undo` kills what still runs in the recorded cgroups and the
      containerd shims serving a recorded directory, lazily unmounts
      everything below the recorded roots, and removes the cgroups deepest
      first; it tolerates what is already gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from dscache_tools.devcluster.hostrecord import HostRecord, run
from dscache_tools.devcluster.procs import mount_points, remove_cgroup_tree
from dscache_tools.polling import poll


def cgroup_hierarchies() -> list[Path]:
    """Mount points of the cgroup hierarchies (v1 controllers and/or the v2 tree)."""
    found: list[Path] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype = right.split()[0] if right else ""
        if fstype in ("cgroup", "cgroup2"):
            found.append(Path(left.split()[4]))
    return found


def add_cgroup(record: HostRecord, name: str) -> str:
    """Creates cgroup ``/<name>`` in every hierarchy; returns it as a cgroup path.

    cpuset directories get their parent's CPUs and memory nodes (a new cpuset
    starts empty and could hold no task).
    """
    for hierarchy in cgroup_hierarchies():
        path = hierarchy / name
        record.cgroups.append(str(path))
        record.save()
        path.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            parent = hierarchy / knob
            if parent.exists() and not (path / knob).read_text().strip():
                (path / knob).write_text(parent.read_text().strip())
    return f"/{name}"


def add_mount_root(record: HostRecord, path: Path) -> None:
    """Records that mounts under ``path`` belong to this cluster."""
    record.mount_roots.append(str(path))
    record.save()


def undo(record: HostRecord) -> None:
    """Kills the cluster's leftover processes, unmounts its mounts, removes its cgroups."""
    for cgroup in record.cgroups:
        _kill_cgroup_tasks(Path(cgroup))
    _kill_shims(record.mount_roots)
    for root in record.mount_roots:
        unmount_below(Path(root))
    for cgroup in sorted(record.cgroups, key=len, reverse=True):
        remove_cgroup_tree(Path(cgroup))


def _cgroup_pids(path: Path) -> set[int]:
    pids: set[int] = set()
    for procs in path.rglob("cgroup.procs"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(p) for p in procs.read_text().split())
    return pids


def _kill_cgroup_tasks(path: Path) -> None:
    if not path.exists():
        return

    def emptied() -> bool:
        pids = _cgroup_pids(path)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    poll(emptied, timeout=10.0, interval=0.1)


def _kill_shims(roots: Iterable[str]) -> None:
    """Kills containerd shims serving a containerd under ``roots`` (its owner was killed)."""
    prefixes = tuple(r.rstrip("/") + "/" for r in roots)
    if not prefixes:
        return
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if not argv or b"containerd-shim" not in argv[0]:
            continue
        if any(a.decode(errors="replace").startswith(prefixes) for a in argv[1:]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(proc.name), signal.SIGKILL)


def unmount_below(root: Path) -> None:
    """Lazily unmounts everything mounted at or below ``root``."""
    for _ in range(3):
        points = mount_points(root.resolve() if root.exists() else root)
        if not points:
            return
        for point in points:
            run("umount", "-l", point, check=False)
