"""`dscache dev cluster reclaim`: the host changes of a cluster killed before `down` ran
(its ledger left behind) are undone; a live cluster's are refused and kept. Needs root,
as the real nodes do; the bridge it makes is its own and gone when it ends."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from dscache_tools.devcluster import host, hostnet, hostrecord
from dscache_tools.devcluster.hostrecord import HostRecord, run
from dscache_tools.polling import poll
from needs import missing, need_binary

from dscache.cli import main


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ledger of this test's own: a dev cluster may be running beside the tests."""
    if os.geteuid() != 0:
        missing("needs root, as the real nodes do")
    need_binary("ip", "iproute2")
    path = tmp_path / "ledger" / "ledger.json"
    monkeypatch.setattr(hostrecord, "LEDGER_DIR", path.parent)
    monkeypatch.setattr(hostrecord, "LEDGER", path)
    monkeypatch.setattr(host, "LEDGER", path)
    return path


@pytest.fixture
def bridge() -> Iterator[str]:
    name = f"dsrc{uuid.uuid4().hex[:8]}"
    run("ip", "link", "add", "name", name, "type", "bridge")
    try:
        yield name
    finally:
        run("ip", "link", "del", name, check=False)


def _exists(link: str) -> bool:
    return run("ip", "link", "show", link, check=False).returncode == 0


def _pod_netns(name: str) -> None:
    """A named network namespace as containerd's CRI makes a pod's: a file under
    /run/netns with the namespace bind-mounted on it. Not `ip netns add`: on a host
    where /run/netns is not a mount point, that makes it one (a bind mount onto
    itself) and leaves it there (a fresh machine's host check saw it)."""
    need_binary("unshare", "util-linux")
    hostnet.NETNS_DIR.mkdir(exist_ok=True)
    path = hostnet.NETNS_DIR / name
    path.touch()
    run("unshare", f"--net={path}", "true")


def _record(tmp_path: Path, bridge: str, owner: tuple[int, str]) -> None:
    state = tmp_path / "killed-cluster"
    state.mkdir()
    record = HostRecord(state_dir=str(state), bridges=[bridge], owners=[owner])
    hostnet.remember_netns(record)  # saves it, to the ledger too


@pytest.mark.slow  # changes the host (a bridge), and undoes it
def test_a_dead_clusters_changes_are_undone(
    ledger: Path, bridge: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # pid 2**22 + 1 is above the kernel's pid_max: no process has it.
    _record(tmp_path, bridge, (2**22 + 1, "/usr/bin/containerd"))
    # A pod the killed cluster's kubelet never tore down: its namespace and veth.
    netns = f"cni-dsrc-{uuid.uuid4().hex[:8]}"
    veth = f"vdsrc{uuid.uuid4().hex[:8]}"
    _pod_netns(netns)
    try:
        run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        assert main(["dev", "cluster", "reclaim"]) == 0
        assert "undid the host changes of the dead cluster" in capsys.readouterr().err
        assert not _exists(bridge)
        assert not ledger.exists()
        assert netns not in run("ip", "netns", "list").stdout
        assert poll(lambda: not _exists(veth), timeout=10), "the pod's veth stayed"
    finally:
        run("ip", "netns", "delete", netns, check=False)
        run("ip", "link", "del", veth, check=False)
    # A free host: nothing to do, and it says so.
    assert main(["dev", "cluster", "reclaim"]) == 0
    assert "no dead cluster" in capsys.readouterr().err


@pytest.mark.slow  # changes the host (a bridge), and undoes it
def test_a_live_clusters_changes_are_kept(
    ledger: Path, bridge: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _record(tmp_path, bridge, (os.getpid(), os.readlink(f"/proc/{os.getpid()}/exe")))
    assert main(["dev", "cluster", "reclaim"]) == 1
    assert "already runs from" in capsys.readouterr().err
    assert _exists(bridge)
    assert ledger.exists()
