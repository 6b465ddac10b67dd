"""Kubeconfig files of a dev cluster: the admin's, each kubelet's and kube-proxy's.

Contract:
    * Every kubeconfig written here embeds the cluster CA and the client
      certificate and key (no file references), has one context named
      :data:`CONTEXT` with namespace ``default``, and is written with mode 0600.
    * :data:`CONTEXT` marks the files ``DevCluster.stop`` may remove and
      ``DevCluster.start`` may overwrite (:func:`is_ours`): a kubeconfig with
      any other current context is never touched.
    * The text is JSON, which is YAML: kubectl, helm and client libraries all
      read it.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING

from dscache_tools.devcluster.procs import write_private

if TYPE_CHECKING:
    from dscache_tools.devcluster.pki import Pki

#: Context (and cluster) name of every kubeconfig written here.
CONTEXT = "dscache-dev"


def text(
    server: str, material: Pki, client: tuple[Path, Path] | None = None, user: str = "admin"
) -> str:
    """A kubeconfig for ``server`` as ``client`` (default: the admin certificate)."""
    cert, key = client or (material.admin_cert, material.admin_key)

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    user_name = f"{CONTEXT}-{user}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {"server": server, "certificate-authority-data": b64(material.ca_cert)},
            }
        ],
        "users": [
            {
                "name": user_name,
                "user": {"client-certificate-data": b64(cert), "client-key-data": b64(key)},
            }
        ],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": user_name, "namespace": "default"},
            }
        ],
        "current-context": CONTEXT,
    }
    return json.dumps(config, indent=2) + "\n"


def write(
    path: Path,
    server: str,
    material: Pki,
    *,
    client: tuple[Path, Path] | None = None,
    user: str = "admin",
) -> Path:
    """Writes :func:`text` to ``path`` (mode 0600) and returns ``path``."""
    write_private(path, text(server, material, client, user))
    return path


def is_ours(path: Path) -> bool:
    """True when ``path`` is a kubeconfig this module wrote."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("current-context") == CONTEXT
