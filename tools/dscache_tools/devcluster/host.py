"""Every change a dev cluster with real nodes makes to the host, recorded and undone.

Real nodes (kubelet + containerd on this machine) need a few host changes:
a bridge per node for the pod network, IP forwarding and bridged traffic
through iptables, a filter chain that keeps pod traffic on the machine, cgroup
directories the kubelet puts pods in, and the sysctls the kubelet sets itself
at start (``vm.overcommit_memory``, ``kernel.panic``, ...). This module makes
them and takes them back.

Contract:
    * Every change is written to a :class:`HostRecord` *before* it is made, and
      the record is saved to ``<state_dir>/host.json`` and to a host-wide
      ledger (``/run/dscache-devcluster/ledger.json``, on tmpfs, so a reboot
      clears it together with the changes). :func:`undo` only needs the record,
      so ``dscache dev cluster down`` in a new process, or the next ``up`` after
      a killed one, can take everything back.
    * Sysctls are restored to the values read before the first change, once
      every process that changed them has stopped.
    * One cluster with real nodes per host: iptables' service chains and the
      bridges are host-wide. :func:`claim` refuses while another live cluster
      holds the ledger, and cleans up after a dead one.
    * Pod traffic stays on the machine: the ``DSCACHE-DEV`` chain of the
      ``mangle`` table, jumped to first from its ``FORWARD`` (which the kernel
      walks before ``filter``'s), drops any packet from the pod network that
      would leave through an interface other than the node bridges.
    * Nothing here starts a long-running process; commands run are ``ip``,
      ``iptables`` and writes under ``/proc/sys`` and ``/sys/fs/cgroup``.

This module is the entry point (preflight, claim, undo); the record and
ledger are in :mod:`.hostrecord`, the changes in :mod:`.hostnet` (sysctls,
bridges, iptables) and :mod:`.hostfs` (cgroups, mounts), re-exported here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from dscache_tools.devcluster import hostfs, hostnet
from dscache_tools.devcluster.hostfs import add_cgroup, add_mount_root
from dscache_tools.devcluster.hostnet import (
    BRIDGE_PREFIX,
    CHAIN,
    KUBELET_SYSCTLS,
    NETWORK_SYSCTLS,
    add_bridge,
    keep_pods_local,
    remember_ipsets,
    remember_kube_chains,
    remember_netns,
    remember_sysctls,
    set_sysctls,
)
from dscache_tools.devcluster.hostrecord import (
    LEDGER,
    RECORD_FILE,
    HostError,
    HostRecord,
    find,
    which,
)
from dscache_tools.devcluster.procs import CGROUP_ROOT, process_running

logger = logging.getLogger(__name__)

__all__ = [
    "BRIDGE_PREFIX",
    "CGROUP_ROOT",
    "CHAIN",
    "KUBELET_SYSCTLS",
    "LEDGER",
    "NETWORK_SYSCTLS",
    "RECORD_FILE",
    "HostError",
    "HostRecord",
    "add_bridge",
    "add_cgroup",
    "add_mount_root",
    "claim",
    "find",
    "keep_pods_local",
    "preflight",
    "reclaim_dead",
    "refuse_if_held",
    "remember_ipsets",
    "remember_kube_chains",
    "remember_netns",
    "remember_sysctls",
    "set_sysctls",
    "undo",
    "which",
]


def preflight(required: Iterable[tuple[str, str]]) -> None:
    """Checks that this host can run real nodes; raises naming every missing piece.

    Args:
        required: ``(executable, Debian package)`` pairs that must be on PATH
            (or in /usr/sbin, /usr/bin).
    """
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("real nodes need root (containerd, bridges, iptables, cgroups)")
    missing = sorted({pkg for exe, pkg in required if find(exe) is None})
    if missing:
        problems.append("missing Debian packages: apt-get install " + " ".join(missing))
    if "overlay" not in Path("/proc/filesystems").read_text():
        problems.append("the kernel has no overlay filesystem (containerd's snapshotter)")
    if not Path("/proc/sys/net/bridge").is_dir():
        problems.append("bridged traffic cannot pass iptables: load br_netfilter")
    if not hostfs.cgroup_hierarchies():
        problems.append(f"no cgroup hierarchy is mounted under {CGROUP_ROOT}")
    if problems:
        raise HostError("this host cannot run real nodes: " + "; ".join(problems))


def refuse_if_held(state_dir: Path | None) -> HostRecord | None:
    """The record of a dead cluster still in the ledger, or None when the host is free.

    Cheap: ``dscache dev cluster up`` checks this before building images.

    Raises:
        HostError: a live cluster with real nodes (not the one in
            ``state_dir``) holds the host.
    """
    previous = HostRecord.load(LEDGER)
    if previous is None or (state_dir is not None and previous.state_dir == str(state_dir)):
        return None
    alive = [pid for pid, exe in previous.owners if process_running(pid, exe)]
    if alive:
        raise HostError(
            f"a dev cluster with real nodes already runs from {previous.state_dir} "
            f"(pids {alive}); stop it with `dscache dev cluster down --state-dir "
            f"{previous.state_dir}`, or start this one with --real-nodes 0"
        )
    return previous


def reclaim_dead(state_dir: Path | None = None) -> str | None:
    """Undoes the host changes of a dead cluster still in the ledger (a run killed
    before it could undo them); returns its state dir, or None when the host is free.

    Raises:
        HostError: a live cluster with real nodes (not the one in ``state_dir``)
            holds the host.
    """
    previous = refuse_if_held(state_dir)
    if previous is None:
        return None
    logger.warning("undoing the host changes of a dead cluster (%s)", previous.state_dir)
    undo(previous)
    return previous.state_dir


def claim(state_dir: Path) -> HostRecord:
    """Takes the host for the cluster in ``state_dir``; cleans up after a dead owner.

    Raises:
        HostError: a live cluster with real nodes already holds the host.
    """
    reclaim_dead(state_dir)
    record = HostRecord(state_dir=str(state_dir))
    record.save()
    return record


def undo(record: HostRecord, log: Callable[[str], None] = logger.info) -> None:
    """Takes back every change in ``record``; tolerant of what is already gone."""
    hostfs.undo(record)
    hostnet.undo(record, log)
    Path(record.state_dir, RECORD_FILE).unlink(missing_ok=True)
    current = HostRecord.load(LEDGER)
    if current is not None and current.state_dir == record.state_dir:
        LEDGER.unlink(missing_ok=True)
