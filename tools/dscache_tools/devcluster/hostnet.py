"""Host network changes of real nodes: sysctls, node bridges, iptables; and their undoing.

Contract:
    * Each function records its change in the :class:`.hostrecord.HostRecord`
      (saved) *before* making it; :func:`undo` takes back what a record lists,
      tolerant of what is already gone.
    * Sysctls are restored to the values read before the first change (first
      value wins), once every process that changed them has stopped.
    * Pod traffic stays on the machine: the ``DSCACHE-DEV`` chain of the
      ``mangle`` table, jumped to first from its ``FORWARD`` (which the kernel
      walks before ``filter``'s), drops any packet from the pod network that
      would leave through an interface other than the node bridges.
    * KUBE-* chains a kubelet or kube-proxy created (absent before the cluster)
      are removed; ones that existed before are left alone.
    * The NetworkPolicy controller's (kube-router's) iptables chains are KUBE-*
      chains, removed as above (their rules' quoted comments included); the
      ipsets made after :func:`remember_ipsets` are destroyed once no rule uses
      them. (``kube-router --cleanup-config`` leaves its top chains and then
      crashes on a kernel without IPVS, so it is not relied on.)
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Iterable
from pathlib import Path

from dscache_tools.devcluster.hostrecord import HostRecord, find, run

#: Filter chain of the egress rule.
CHAIN = "DSCACHE-DEV"
#: Interface name prefix of node bridges (``iptables`` matches ``dscache+``).
BRIDGE_PREFIX = "dscache"
#: Sysctls a kubelet or kube-proxy may set; read before start, restored after.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
    "net/ipv4/conf/all/route_localnet",
    "net/netfilter/nf_conntrack_max",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
)
#: Sysctls the dev cluster itself sets for the pod network.
NETWORK_SYSCTLS = {
    "net/ipv4/ip_forward": "1",
    "net/bridge/bridge-nf-call-iptables": "1",
}


def read_sysctl(name: str) -> str | None:
    """Value of ``/proc/sys/<name>``, or None if the kernel has no such sysctl."""
    try:
        return (Path("/proc/sys") / name).read_text().strip()
    except OSError:
        return None


def remember_sysctls(record: HostRecord, names: Iterable[str]) -> None:
    """Records the current values of ``names`` (first value wins) for :func:`undo`."""
    for name in names:
        value = read_sysctl(name)
        if value is not None and name not in record.sysctls:
            record.sysctls[name] = value
    record.save()


def set_sysctls(record: HostRecord, values: dict[str, str]) -> None:
    """Sets sysctls after recording their old values."""
    remember_sysctls(record, values)
    for name, value in values.items():
        if read_sysctl(name) is not None:
            (Path("/proc/sys") / name).write_text(value)


_KUBE_TABLES = ("filter", "nat", "mangle")


def _chains(tool: str, table: str) -> list[str]:
    done = run(tool, "-w", "-t", table, "-S", check=False)
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("-N ")]


def remember_kube_chains(record: HostRecord) -> None:
    """Records the KUBE-* chains that exist now (a kubelet adds its own at start)."""
    for tool in ("iptables", "ip6tables"):
        if find(tool) is None:
            continue
        for table in _KUBE_TABLES:
            chains = [c for c in _chains(tool, table) if c.startswith("KUBE-")]
            record.kube_chains_before[f"{tool}/{table}"] = chains
    record.save()


def _remove_new_kube_chains(record: HostRecord) -> None:
    for key, before in record.kube_chains_before.items():
        tool, table = key.split("/")
        new = [c for c in _chains(tool, table) if c.startswith("KUBE-") and c not in before]
        if not new:
            continue
        rules = run(tool, "-w", "-t", table, "-S", check=False).stdout.splitlines()
        for line in rules:
            # shlex: a rule's comment is quoted and may hold spaces (kube-router's do).
            parts = shlex.split(line)
            if parts[:1] == ["-A"] and "-j" in parts and parts[parts.index("-j") + 1] in new:
                run(tool, "-w", "-t", table, "-D", *parts[1:], check=False)
        for chain in new:
            run(tool, "-w", "-t", table, "-F", chain, check=False)
        for chain in new:
            run(tool, "-w", "-t", table, "-X", chain, check=False)


def add_bridge(record: HostRecord, name: str, cidr: str) -> None:
    """Creates bridge ``name`` with address ``cidr`` (e.g. ``10.246.0.1/24``), up."""
    record.bridges.append(name)
    record.save()
    if run("ip", "link", "show", name, check=False).returncode != 0:
        run("ip", "link", "add", "name", name, "type", "bridge")
    addresses = run("ip", "-o", "addr", "show", "dev", name).stdout
    if f" {cidr} " not in addresses:
        run("ip", "addr", "add", cidr, "dev", name)
    run("ip", "link", "set", name, "up")


def keep_pods_local(record: HostRecord, pod_cidr: str) -> None:
    """Drops pod traffic that would leave through anything but the node bridges.

    The drop sits in the ``mangle`` table's FORWARD chain, which the kernel
    walks before ``filter``, so no rule kube-proxy inserts later can come
    first. Pod <-> pod across bridges, pod -> host addresses (INPUT) and
    host -> pod stay open; ACCEPT rules appended to filter's FORWARD keep them
    open under a FORWARD policy of DROP (Docker sets one).
    """
    drop = ["-s", pod_cidr, "!", "-o", f"{BRIDGE_PREFIX}+", "-j", "DROP"]
    jump = ["-t", "mangle", "-I", "FORWARD", "1", "-j", CHAIN]
    bridges = ["-o", f"{BRIDGE_PREFIX}+", "-j", "ACCEPT"]
    accepts = [
        ["-t", "filter", "-A", "FORWARD", "-s", pod_cidr, *bridges],
        ["-t", "filter", "-A", "FORWARD", "-d", pod_cidr, *bridges],
    ]
    if f"mangle/{CHAIN}" not in record.chains:
        record.chains.append(f"mangle/{CHAIN}")
    record.rules += [jump, *accepts]
    record.save()
    if run("iptables", "-w", "-t", "mangle", "-L", CHAIN, "-n", check=False).returncode != 0:
        run("iptables", "-w", "-t", "mangle", "-N", CHAIN)
    run("iptables", "-w", "-t", "mangle", "-F", CHAIN)
    run("iptables", "-w", "-t", "mangle", "-A", CHAIN, *drop)
    for rule in [jump, *accepts]:
        if run("iptables", "-w", *_as_check(rule), check=False).returncode != 0:
            run("iptables", "-w", *rule)


def _as_check(rule: list[str]) -> list[str]:
    """``-t T -I CHAIN 1 ...`` or ``-t T -A CHAIN ...`` -> ``-t T -C CHAIN ...``."""
    table, op, chain, rest = rule[:2], rule[2], rule[3], rule[4:]
    if op == "-I" and rest and rest[0].isdigit():
        rest = rest[1:]
    return [*table, "-C", chain, *rest]


def _ipsets() -> list[str]:
    done = run("ipset", "list", "-n", check=False) if find("ipset") else None
    return done.stdout.split() if done is not None and done.returncode == 0 else []


def remember_ipsets(record: HostRecord) -> None:
    """Records the ipsets that exist now (the NetworkPolicy controller adds its own)."""
    if record.ipsets_before is None:
        record.ipsets_before = _ipsets()
    record.save()


#: Where ``ip netns`` (and the CRI's CNI setup) keeps named network namespaces.
NETNS_DIR = Path("/run/netns")
#: The prefix containerd's CRI gives a pod sandbox's network namespace.
POD_NETNS_PREFIX = "cni-"


def _netns() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.iterdir()) if NETNS_DIR.is_dir() else []


def remember_netns(record: HostRecord) -> None:
    """Records the network namespaces that exist now (each pod sandbox adds one)."""
    if record.netns_before is None:
        record.netns_before = _netns()
    record.save()


def _undo_pod_netns(record: HostRecord) -> None:
    # A pod's kubelet tears its namespace down (CNI DEL) when the pod goes; a cluster
    # killed first leaves them, each holding the host end of a veth. Deleting the
    # namespace (its processes are gone) takes the pair with it.
    if record.netns_before is not None:
        for name in set(_netns()) - set(record.netns_before):
            if name.startswith(POD_NETNS_PREFIX):
                run("ip", "netns", "delete", name, check=False)


def _undo_netpol_sets(record: HostRecord) -> None:
    # After the rules that referenced them are gone (a set in use cannot go).
    if record.ipsets_before is not None:
        for name in set(_ipsets()) - set(record.ipsets_before):
            run("ipset", "destroy", name, check=False)


def undo(record: HostRecord, log: Callable[[str], None]) -> None:
    """Takes back the network changes in ``record`` (after the processes stopped)."""
    if record.kube_proxy and Path(record.kube_proxy).exists():
        done = run(record.kube_proxy, "--cleanup", check=False)
        if done.returncode != 0:
            log(f"kube-proxy --cleanup: {done.stderr.strip()[-500:]}")
    _remove_new_kube_chains(record)
    for rule in record.rules:
        check = _as_check(rule)
        delete = [*check[:2], "-D", *check[3:]]
        while run("iptables", "-w", *check, check=False).returncode == 0:
            run("iptables", "-w", *delete, check=False)
    for entry in record.chains:
        table, _, chain = entry.rpartition("/")
        for op in ("-F", "-X"):
            run("iptables", "-w", "-t", table or "filter", op, chain, check=False)
    _undo_netpol_sets(record)
    _undo_pod_netns(record)
    for bridge in record.bridges:
        run("ip", "link", "delete", bridge, check=False)
    for name, value in record.sysctls.items():
        try:
            (Path("/proc/sys") / name).write_text(value)
        except OSError as exc:
            log(f"could not restore {name}={value}: {exc}")
