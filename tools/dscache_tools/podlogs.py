"""Keeping a namespace's pod logs before it is deleted.

A failed cluster test or demo deletes its namespace on the way out, and with it
the only record of why: the model servers', sidecars' and routers' logs. Called
first, :func:`save_pod_logs` writes every container's log (and the previous
container's, after a restart) and the namespace's events under a folder, one
file each (``<pod>.<container>[-previous].log``, ``events.txt``). It never
raises: the cluster itself may be what failed, and the caller's own error is
the one to report.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)


def _kubectl(kubectl: str, kubeconfig: Path, *args: str, timeout_s: float) -> str:
    """kubectl's stdout, its stderr after it (a refused ``--previous`` says why)."""
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    done = subprocess.run(
        [kubectl, *args], capture_output=True, text=True, env=env, timeout=timeout_s, check=False
    )
    return done.stdout + done.stderr


def save_pod_logs(
    kubectl: str, kubeconfig: Path, namespace: str, out: Path, *, timeout_s: float = 60.0
) -> int:
    """Writes ``namespace``'s container logs and events under ``out``.

    Args:
        kubectl: the kubectl binary.
        kubeconfig: the cluster's kubeconfig.
        namespace: whose pods.
        out: the folder (created).
        timeout_s: seconds per kubectl call.

    Returns:
        The number of container logs written (0 when the cluster did not answer).
    """
    out.mkdir(parents=True, exist_ok=True)
    try:
        pods = json.loads(
            _kubectl(
                kubectl,
                kubeconfig,
                "get",
                "pods",
                "-n",
                namespace,
                "-o",
                "json",
                timeout_s=timeout_s,
            )
        )["items"]
        events = _kubectl(
            kubectl,
            kubeconfig,
            "get",
            "events",
            "-n",
            namespace,
            "--sort-by=.lastTimestamp",
            timeout_s=timeout_s,
        )
    except (OSError, subprocess.SubprocessError, ValueError, KeyError) as err:
        log.warning("no pod logs for %s: %s", namespace, err)
        return 0
    (out / "events.txt").write_text(events)
    written = 0
    for pod in pods:
        name = pod["metadata"]["name"]
        for status in pod.get("status", {}).get("containerStatuses", []):
            runs = [("", ())] + (
                [("-previous", ("--previous",))] if status.get("restartCount") else []
            )
            for suffix, extra in runs:
                try:
                    text = _kubectl(
                        kubectl,
                        kubeconfig,
                        "logs",
                        "-n",
                        namespace,
                        name,
                        "-c",
                        status["name"],
                        "--timestamps",
                        *extra,
                        timeout_s=timeout_s,
                    )
                except (OSError, subprocess.SubprocessError) as err:  # keep the other logs
                    text = f"(no log: {err})"
                (out / f"{name}.{status['name']}{suffix}.log").write_text(text)
                written += 1
    log.warning("%d container logs of namespace %s kept in %s", written, namespace, out)
    return written
