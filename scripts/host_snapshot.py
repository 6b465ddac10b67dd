"""Prints what a dev cluster with real nodes may change on the host, sorted, for a diff.

``scripts/test.sh`` runs it before and after the cluster tests: the two outputs
must be equal, because ``DevCluster.stop`` undoes every change (sysctls, links,
iptables rules and chains, ipsets, mounts, network namespaces, cgroups). Standard
library only (the sysctl list comes from the dev cluster's own
:mod:`dscache_tools.devcluster.hostnet`, which is too); counters and timestamps
are left out so only real changes show. It also lists the dev cluster's kinds
of process still running.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from dscache_tools.devcluster.hostnet import KUBELET_SYSCTLS, NETWORK_SYSCTLS

#: Processes a dev cluster starts; none may outlive it.
WATCHED = {
    "containerd",
    "containerd-shim-runc-v2",
    "kubelet",
    "kube-proxy",
    "kube-apiserver",
    "etcd",
    "kwok",
    "prometheus",
}
#: What the kubelet and kube-proxy may set, and what the dev cluster sets itself.
SYSCTLS = (*KUBELET_SYSCTLS, *NETWORK_SYSCTLS)


def _lines(*command: str) -> list[str]:
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return out.splitlines()


def _sysctls() -> list[str]:
    out: list[str] = []
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            out.append(f"sysctl {name} = {(Path('/proc/sys') / name).read_text().strip()}")
    return out


def _links() -> list[str]:
    return [
        "link " + line.split(":")[1].strip().split("@")[0]
        for line in _lines("ip", "-o", "link", "show")
    ]


def _iptables() -> list[str]:
    out: list[str] = []
    for tool in ("iptables-save", "ip6tables-save"):
        table = ""
        for line in _lines(tool):
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":"):
                # Chain declarations carry counters. A built-in chain that accepts is
                # what a table shows once merely loaded: leave those out. Custom
                # chains ("-") and built-in policies other than ACCEPT stay.
                chain, policy = re.sub(r" \[\d+:\d+\]$", "", line)[1:].split(" ", 1)
                if policy != "ACCEPT":
                    out.append(f"{tool} {table} chain {chain} {policy}")
            elif line.startswith("-"):
                out.append(f"{tool} {table} {line}")
    return out


def _ipsets() -> list[str]:
    """The host's ipsets by name (the dev cluster's NetworkPolicy controller makes some)."""
    return [f"ipset {name}" for name in _lines("ipset", "list", "-n") if name.strip()]


def _mounts_netns_cgroups() -> list[str]:
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    out = [f"mount {m.split()[4]}" for m in mounts]
    netns = Path("/var/run/netns")
    if netns.is_dir():
        out += [f"netns {p.name}" for p in netns.iterdir()]
    for hierarchy in ("memory", "cpu", "pids", "unified"):
        root = Path("/sys/fs/cgroup") / hierarchy
        if root.is_dir():
            out += [f"cgroup {hierarchy}/{p.name}" for p in root.iterdir() if p.is_dir()]
    return out


def _ledger() -> list[str]:
    """The dev cluster's host ledger (which cluster holds the host), if any: a test
    must not leave one behind, nor overwrite a live cluster's."""
    ledger = Path("/run/dscache-devcluster/ledger.json")
    if not ledger.exists():
        return []
    try:
        held_by = json.loads(ledger.read_text()).get("state_dir")
    except (OSError, ValueError, AttributeError):
        held_by = "unreadable"
    return [f"ledger {held_by}"]


def _processes() -> list[str]:
    out: list[str] = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            name = Path((proc / "cmdline").read_bytes().split(b"\0")[0].decode()).name
            if name in WATCHED:
                out.append(f"process {name}")
    return out


def snapshot() -> list[str]:
    """Every line of the snapshot, sorted."""
    return sorted(
        [
            *_sysctls(),
            *_links(),
            *_iptables(),
            *_ipsets(),
            *_mounts_netns_cgroups(),
            *_ledger(),
            *_processes(),
        ]
    )


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in snapshot()))
