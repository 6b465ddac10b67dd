"""The record of what a dev cluster with real nodes changed on the host, and its ledger.

Contract:
    * Every change is written to a :class:`HostRecord` *before* it is made
      (:mod:`.hostnet`, :mod:`.hostfs`), and :meth:`HostRecord.save` writes it
      to ``<state_dir>/host.json`` and to a host-wide ledger
      (``/run/dscache-devcluster/ledger.json``, on tmpfs, so a reboot clears
      it together with the changes). Undoing needs only the record
      (:func:`.host.undo`).
    * :func:`run` runs a host command (``ip``, ``iptables``, ...) and raises
      :class:`HostError` with its output when asked to check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dscache_tools.devcluster.procs import atomic_write

LEDGER_DIR = Path("/run/dscache-devcluster")
LEDGER = LEDGER_DIR / "ledger.json"
RECORD_FILE = "host.json"


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
    #: ipsets that existed before the controller started (None: never started);
    #: others are destroyed by :func:`undo`
    ipsets_before: list[str] | None = None
    #: network namespaces (``/run/netns``) that existed before the nodes started (None:
    #: not recorded); the CRI's pod namespaces (``cni-*``) made since are deleted by
    #: :func:`undo`, which a cluster killed before its kubelets tore its pods down needs
    netns_before: list[str] | None = None
    #: pid + executable of processes whose death frees the host (liveness)
    owners: list[tuple[int, str]] = field(default_factory=list)

    def save(self) -> None:
        """Writes the record to the state dir and the host ledger."""
        text = json.dumps(asdict(self), indent=2) + "\n"
        state = Path(self.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        atomic_write(state / RECORD_FILE, text)
        LEDGER_DIR.mkdir(parents=True, exist_ok=True)
        atomic_write(LEDGER, text)

    @classmethod
    def load(cls, path: Path) -> HostRecord | None:
        """The record in ``path``, or None."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        data["owners"] = [tuple(o) for o in data.get("owners", [])]
        return cls(**data)


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs ``args``; with ``check``, a non-zero exit raises :class:`HostError`."""
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise HostError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.stdout.strip()}")
    return done


def find(exe: str) -> str | None:
    """Absolute path of ``exe`` on PATH or in the sbin folders, or None."""
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
    found = find(exe)
    if found is None:
        raise HostError(f"{exe} is not installed")
    return found
