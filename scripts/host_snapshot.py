"""Prints what a dev cluster with real nodes may change on the host, sorted, for a diff.

``scripts/test.sh`` runs it before and after the cluster tests: the two outputs
must be equal, because ``DevCluster.stop`` undoes every change (sysctls, links,
iptables rules and chains, mounts, network namespaces, cgroups). Standard
library only; counters and timestamps are left out so only real changes show.
It also lists the dev cluster's kinds of process still running.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
from pathlib import Path

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
SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "net/netfilter/nf_conntrack_max",
)


def _lines(*command: str) -> list[str]:
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=False).stdout
    except OSError:
        return []
    return out.splitlines()


def snapshot() -> list[str]:
    out: list[str] = []
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            out.append(f"sysctl {name} = {(Path('/proc/sys') / name).read_text().strip()}")
    for line in _lines("ip", "-o", "link", "show"):
        out.append("link " + line.split(":")[1].strip().split("@")[0])
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
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    out += [f"mount {m.split()[4]}" for m in mounts]
    netns = Path("/var/run/netns")
    if netns.is_dir():
        out += [f"netns {p.name}" for p in netns.iterdir()]
    for hierarchy in ("memory", "cpu", "pids", "unified"):
        root = Path("/sys/fs/cgroup") / hierarchy
        if root.is_dir():
            out += [f"cgroup {hierarchy}/{p.name}" for p in root.iterdir() if p.is_dir()]
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            name = Path((proc / "cmdline").read_bytes().split(b"\0")[0].decode()).name
            if name in WATCHED:
                out.append(f"process {name}")
    return sorted(out)


if __name__ == "__main__":
    sys.stdout.write("".join(line + "\n" for line in snapshot()))
