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
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

LEDGER_DIR = Path("/run/dscache-devcluster")
LEDGER = LEDGER_DIR / "ledger.json"
RECORD_FILE = "host.json"
#: Filter chain of the egress rule.
CHAIN = "DSCACHE-DEV"
#: Interface name prefix of node bridges (``iptables`` matches ``dscache+``).
BRIDGE_PREFIX = "dscache"
CGROUP_ROOT = Path("/sys/fs/cgroup")
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


class HostError(RuntimeError):
    """The host cannot run real nodes, or another cluster holds it."""


@dataclass
class HostRecord:
    """What one cluster changed on the host (JSON-serialisable)."""

    state_dir: str
    #: sysctl path under /proc/sys -> value before the cluster started
    sysctls: dict[str, str] = field(default_factory=dict)
    bridges: list[str] = field(default_factory=list)
    #: iptables argument lists (``-t TABLE -I|-A CHAIN ...``) that were added
    rules: list[list[str]] = field(default_factory=list)
    #: ``TABLE/CHAIN`` of chains created
    chains: list[str] = field(default_factory=list)
    #: absolute cgroup directories created (all hierarchies)
    cgroups: list[str] = field(default_factory=list)
    #: directories whose mounts (kubelet volumes, sandbox shm) are ours
    mount_roots: list[str] = field(default_factory=list)
    #: ``kube-proxy --cleanup`` removes the KUBE-* chains it programmed
    kube_proxy: str | None = None
    #: "<iptables|ip6tables>/<table>" -> KUBE-* chains that existed before the
    #: cluster; the kubelet's own chains (KUBE-FIREWALL, ...) that were not
    #: there are removed by :func:`undo`
    kube_chains_before: dict[str, list[str]] = field(default_factory=dict)
    #: pid + executable of processes whose death frees the host (liveness)
    owners: list[tuple[int, str]] = field(default_factory=list)

    def save(self) -> None:
        """Writes the record to the state dir and the host ledger."""
        text = json.dumps(asdict(self), indent=2) + "\n"
        state = Path(self.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        _atomic_write(state / RECORD_FILE, text)
        LEDGER_DIR.mkdir(parents=True, exist_ok=True)
        _atomic_write(LEDGER, text)

    @classmethod
    def load(cls, path: Path) -> HostRecord | None:
        """The record in ``path``, or None."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        data["owners"] = [tuple(o) for o in data.get("owners", [])]
        return cls(**data)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _alive(pid: int, exe: str) -> bool:
    try:
        target = os.readlink(f"/proc/{pid}/exe")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X") and target.removesuffix(" (deleted)") == exe


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise HostError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


# ----------------------------------------------------------------------------- checks


def preflight(required: Iterable[tuple[str, str]]) -> None:
    """Checks that this host can run real nodes; raises naming every missing piece.

    Args:
        required: ``(executable, Debian package)`` pairs that must be on PATH
            (or in /usr/sbin, /usr/bin).
    """
    problems: list[str] = []
    if os.geteuid() != 0:
        problems.append("real nodes need root (containerd, bridges, iptables, cgroups)")
    missing = sorted({pkg for exe, pkg in required if _which(exe) is None})
    if missing:
        problems.append("missing Debian packages: apt-get install " + " ".join(missing))
    if "overlay" not in Path("/proc/filesystems").read_text():
        problems.append("the kernel has no overlay filesystem (containerd's snapshotter)")
    if not Path("/proc/sys/net/bridge").is_dir():
        problems.append("bridged traffic cannot pass iptables: load br_netfilter")
    if not _cgroup_hierarchies():
        problems.append(f"no cgroup hierarchy is mounted under {CGROUP_ROOT}")
    if problems:
        raise HostError("this host cannot run real nodes: " + "; ".join(problems))


def _which(exe: str) -> str | None:
    found = shutil.which(exe)
    if found:
        return found
    for folder in ("/usr/sbin", "/sbin", "/usr/bin", "/usr/lib/cni"):
        candidate = Path(folder) / exe
        if candidate.exists():
            return str(candidate)
    return None


def which(exe: str) -> str:
    """Absolute path of ``exe`` (also looking in sbin folders)."""
    found = _which(exe)
    if found is None:
        raise HostError(f"{exe} is not installed")
    return found


# ----------------------------------------------------------------------------- claim


def claim(state_dir: Path) -> HostRecord:
    """Takes the host for the cluster in ``state_dir``; cleans up after a dead owner.

    Raises:
        HostError: a live cluster with real nodes already holds the host.
    """
    previous = HostRecord.load(LEDGER)
    if previous is not None and previous.state_dir != str(state_dir):
        alive = [pid for pid, exe in previous.owners if _alive(pid, exe)]
        if alive:
            raise HostError(
                f"a dev cluster with real nodes already runs from {previous.state_dir} "
                f"(pids {alive}); stop it with `dscache dev cluster down --state-dir "
                f"{previous.state_dir}`, or start this one with --real-nodes 0"
            )
        logger.warning("undoing the host changes of a dead cluster (%s)", previous.state_dir)
        undo(previous)
    record = HostRecord(state_dir=str(state_dir))
    record.save()
    return record


# ----------------------------------------------------------------------------- changes


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
    done = _run(tool, "-w", "-t", table, "-S", check=False)
    return [line.split()[1] for line in done.stdout.splitlines() if line.startswith("-N ")]


def remember_kube_chains(record: HostRecord) -> None:
    """Records the KUBE-* chains that exist now (a kubelet adds its own at start)."""
    for tool in ("iptables", "ip6tables"):
        if _which(tool) is None:
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
        rules = _run(tool, "-w", "-t", table, "-S", check=False).stdout.splitlines()
        for line in rules:
            parts = line.split()
            if parts[:1] == ["-A"] and "-j" in parts and parts[parts.index("-j") + 1] in new:
                _run(tool, "-w", "-t", table, "-D", *parts[1:], check=False)
        for chain in new:
            _run(tool, "-w", "-t", table, "-F", chain, check=False)
        for chain in new:
            _run(tool, "-w", "-t", table, "-X", chain, check=False)


def add_bridge(record: HostRecord, name: str, cidr: str) -> None:
    """Creates bridge ``name`` with address ``cidr`` (e.g. ``10.246.0.1/24``), up."""
    record.bridges.append(name)
    record.save()
    if _run("ip", "link", "show", name, check=False).returncode != 0:
        _run("ip", "link", "add", "name", name, "type", "bridge")
    addresses = _run("ip", "-o", "addr", "show", "dev", name).stdout
    if f" {cidr} " not in addresses:
        _run("ip", "addr", "add", cidr, "dev", name)
    _run("ip", "link", "set", name, "up")


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
    if _run("iptables", "-w", "-t", "mangle", "-L", CHAIN, "-n", check=False).returncode != 0:
        _run("iptables", "-w", "-t", "mangle", "-N", CHAIN)
    _run("iptables", "-w", "-t", "mangle", "-F", CHAIN)
    _run("iptables", "-w", "-t", "mangle", "-A", CHAIN, *drop)
    for rule in [jump, *accepts]:
        if _run("iptables", "-w", *_as_check(rule), check=False).returncode != 0:
            _run("iptables", "-w", *rule)


def _as_check(rule: list[str]) -> list[str]:
    """``-t T -I CHAIN 1 ...`` or ``-t T -A CHAIN ...`` -> ``-t T -C CHAIN ...``."""
    table, op, chain, rest = rule[:2], rule[2], rule[3], rule[4:]
    if op == "-I" and rest and rest[0].isdigit():
        rest = rest[1:]
    return [*table, "-C", chain, *rest]


def _cgroup_hierarchies() -> list[Path]:
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
    for hierarchy in _cgroup_hierarchies():
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


# ----------------------------------------------------------------------------- undo


def undo(record: HostRecord, log: Callable[[str], None] = logger.info) -> None:
    """Takes back every change in ``record``; tolerant of what is already gone."""
    for cgroup in record.cgroups:
        _kill_cgroup_tasks(Path(cgroup))
    _kill_shims(record.mount_roots)
    for root in record.mount_roots:
        unmount_below(Path(root))
    for cgroup in sorted(record.cgroups, key=len, reverse=True):
        _remove_cgroup_tree(Path(cgroup))
    if record.kube_proxy and Path(record.kube_proxy).exists():
        done = _run(record.kube_proxy, "--cleanup", check=False)
        if done.returncode != 0:
            log(f"kube-proxy --cleanup: {done.stderr.strip()[-500:]}")
    _remove_new_kube_chains(record)
    for rule in record.rules:
        check = _as_check(rule)
        delete = [*check[:2], "-D", *check[3:]]
        while _run("iptables", "-w", *check, check=False).returncode == 0:
            _run("iptables", "-w", *delete, check=False)
    for entry in record.chains:
        table, _, chain = entry.rpartition("/")
        _run("iptables", "-w", "-t", table or "filter", "-F", chain, check=False)
        _run("iptables", "-w", "-t", table or "filter", "-X", chain, check=False)
    for bridge in record.bridges:
        _run("ip", "link", "delete", bridge, check=False)
    for name, value in record.sysctls.items():
        try:
            (Path("/proc/sys") / name).write_text(value)
        except OSError as exc:
            log(f"could not restore {name}={value}: {exc}")
    with contextlib.suppress(OSError):
        (Path(record.state_dir) / RECORD_FILE).unlink()
    current = HostRecord.load(LEDGER)
    if current is not None and current.state_dir == record.state_dir:
        LEDGER.unlink(missing_ok=True)


def _kill_cgroup_tasks(path: Path) -> None:
    if not path.exists():
        return
    for attempt in range(20):
        pids: set[int] = set()
        for procs in path.rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(p) for p in procs.read_text().split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05 * (attempt + 1))


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


def _remove_cgroup_tree(path: Path) -> None:
    if not path.exists():
        return
    dirs = sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))
    for directory in [*reversed(dirs), path]:
        with contextlib.suppress(OSError):
            directory.rmdir()


def mounts_below(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first."""
    prefix = str(root.resolve()) if root.exists() else str(root)
    points: list[str] = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
            points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def unmount_below(root: Path) -> None:
    """Lazily unmounts everything mounted at or below ``root``."""
    for _ in range(3):
        points = mounts_below(root)
        if not points:
            return
        for point in points:
            _run("umount", "-l", point, check=False)
