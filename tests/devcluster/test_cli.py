"""``dscache dev cluster up/env/down`` as a user runs them, and process hygiene.

These start clusters of their own beside the session one, which also shows
that two clusters on one machine do not collide (ports are chosen per start).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from dscache_tools.devcluster import ClusterError, DevCluster, wait_until
from dscache_tools.devcluster.procs import process_running

pytestmark = pytest.mark.cluster

#: The issue's bound for start-up with cached binaries, with slack for a loaded CI machine.
STARTUP_LIMIT_S = 30.0


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dscache.cli", "dev", "cluster", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )


def test_up_env_down(dev_cluster: DevCluster, tmp_path: Path) -> None:
    state = tmp_path / "state"
    kubeconfig = tmp_path / "kc" / "config"
    started = time.monotonic()
    up = _cli(
        "up",
        "--nodes",
        "2",
        "--real-nodes",
        "0",
        "--state-dir",
        str(state),
        "--kubeconfig",
        str(kubeconfig),
    )
    elapsed = time.monotonic() - started
    assert up.returncode == 0, up.stderr
    try:
        assert elapsed < STARTUP_LIMIT_S, f"up took {elapsed:.1f} s"
        assert kubeconfig.exists() and (state / "kubeconfig").exists()
        assert f"export KUBECONFIG={kubeconfig}" in up.stdout

        env = _cli("env", "--state-dir", str(state))
        assert env.returncode == 0, env.stderr
        clean = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
        clean["PATH"] = "/usr/local/bin:/usr/bin:/bin"
        shell = subprocess.run(
            ["bash", "-c", env.stdout + "command -v kubectl helm; kubectl get nodes -o name"],
            capture_output=True,
            text=True,
            env=clean,
            timeout=60,
            check=False,
        )
        assert shell.returncode == 0, shell.stderr
        lines = shell.stdout.split()
        assert lines[0] == str(dev_cluster.binaries.kubectl)
        assert lines[1] == str(dev_cluster.binaries.helm)
        assert lines[2:] == ["node/dev-node-0", "node/dev-node-1"]

        again = _cli("up", "--state-dir", str(state))
        assert again.returncode == 1 and "already runs" in again.stderr
    finally:
        recorded = json.loads((state / "state.json").read_text())["processes"]
        down = _cli("down", "--state-dir", str(state))
    assert down.returncode == 0, down.stderr
    assert not state.exists() and not kubeconfig.exists()
    assert [p["name"] for p in recorded if process_running(p["pid"], p["exe"])] == []
    assert sorted(p["name"] for p in recorded) == sorted(
        ["etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"]
    )


def test_a_second_cluster_with_real_nodes_is_refused(
    dev_cluster: DevCluster, tmp_path: Path
) -> None:
    """Service chains and bridges are host-wide: one cluster with real nodes per host."""
    assert dev_cluster.real_nodes, "the session cluster runs real nodes"
    state = tmp_path / "second"
    up = _cli("up", "--nodes", "1", "--real-nodes", "1", "--state-dir", str(state))
    assert up.returncode == 1
    assert "already runs from" in up.stderr and str(dev_cluster.state_dir) in up.stderr
    assert "--real-nodes 0" in up.stderr
    # The refused start touched nothing: the session cluster's nodes still work.
    nodes = dev_cluster.kubectl_json("get", "nodes", "-l", "dscache.io/node-kind=real")["items"]
    assert [n["metadata"]["name"] for n in nodes] == list(dev_cluster.real_nodes)


def test_processes_die_with_a_killed_parent(dev_cluster: DevCluster, tmp_path: Path) -> None:
    """A test run that is killed outright leaves no control-plane process behind."""
    state = tmp_path / "orphan"
    script = textwrap.dedent(
        f"""
        import json, sys, time
        from pathlib import Path
        from dscache_tools.devcluster import DevCluster
        cluster = DevCluster.start(Path({str(state)!r}), node_count=1, tie_to_parent=True)
        print(json.dumps([[p.pid, p.exe] for p in cluster.processes]), flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, parent.stderr.read() if parent.stderr else ""
        children = json.loads(line)
        assert len(children) == 5
        assert all(process_running(pid, exe) for pid, exe in children)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    wait_until(
        "the orphaned control plane to exit",
        lambda: not any(process_running(pid, exe) for pid, exe in children),
        timeout=30,
    )


def test_failed_start_stops_everything_and_keeps_logs(
    dev_cluster: DevCluster, tmp_path: Path
) -> None:
    broken = tmp_path / "kube-apiserver"
    broken.write_text("#!/bin/sh\necho 'flag provided but not defined: --boom' >&2\nexit 3\n")
    broken.chmod(0o755)
    binaries = dataclasses.replace(dev_cluster.binaries, kube_apiserver=broken)
    state = tmp_path / "failed"
    with pytest.raises(ClusterError) as failed:
        DevCluster.start(state, node_count=1, binaries=binaries, tie_to_parent=True, timeout=30)
    message = str(failed.value)
    assert "kube-apiserver exited with code 3" in message
    assert "--boom" in message
    assert str(state / "logs") in message
    assert "--boom" in (state / "logs" / "kube-apiserver.log").read_text()
    assert (state / "logs" / "etcd.log").exists()
    assert not (state / "etcd").exists() and not (state / "pki").exists()
    stale = DevCluster.load(state)
    assert stale is not None and stale.running() == []
