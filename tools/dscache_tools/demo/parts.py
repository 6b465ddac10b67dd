"""The parts of the local stack: what runs, and each part's configuration.

Records of running children (:class:`Sidecar`, :class:`Server`, :class:`Router`),
the stack's knobs, the environment Python children get, and the config files of
NGINX (rendered by :mod:`dscache_router.nginx`, as in a cluster) and
Prometheus. :mod:`dscache_tools.demo.stack` starts and stops the children.

Contract:
    * Everything here is pure or reads only the host (``find_nginx``,
      ``worker_pids``); ``render_router`` writes only the router's own config file.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.procs import Child, StartError

#: Debian packages the router needs (``scripts/setup.sh`` installs them).
NGINX_PACKAGES = ("nginx-light", "libnginx-mod-http-lua", "libnginx-mod-http-ndk")


@dataclass(frozen=True)
class Sidecar:
    """A running sidecar."""

    name: str
    data_dir: Path
    socket: Path
    metrics_port: int
    child: Child

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass(frozen=True)
class Server:
    """A running model server."""

    name: str
    port: int
    child: Child
    sidecar: Sidecar | None
    track: str = "stable"

    @property
    def address(self) -> str:
        """``host:port`` as the router's upstream list wants it."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://{self.address}"

    @property
    def metrics_url(self) -> str:
        """Its Prometheus endpoint."""
        return self.url + "/metrics"


@dataclass
class Router:
    """A running NGINX."""

    port: int
    workdir: Path
    conf: Path
    child: Child
    stable: tuple[str, ...] = ()
    canary: tuple[str, ...] = ()
    canary_weight: float = 0.0
    prompt_key: bool = True
    balance_factor: float = 1.25
    session_memory_s: int = 0  # how long it keeps a session on its track (0: the weight)
    picker: str | None = None  # HOST:PORT of a running ``dscache picker``
    picker_child: Child | None = None

    @property
    def url(self) -> str:
        """Base URL clients use."""
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class StackOptions:
    """How the local stack runs its children.

    Attributes:
        model: model preset or checkpoint dir for every server.
        threads: torch threads per server.
        max_queue: requests a server lets wait before answering 429.
        sidecar_capacity: segment space per sidecar (e.g. ``1GiB``).
        sidecar_segment_size: bytes per segment file.
        ready_timeout_s: how long a server may take to load and calibrate.
        server_args: extra ``dscache server`` flags.
        sidecar_args: extra ``dscache sidecar`` flags (e.g. ``--fault-injection``).
        sidecar_tmpfs: when set (a size, e.g. ``256MiB``), each sidecar's data dir
            is a tmpfs of that size mounted by the stack (root only), so a test can
            fill it as a full disk; the stack unmounts it on stop.
        balance_factor: the router's bounded-load factor (0: plain consistent hash).
    """

    model: str = "mini-gqa"
    threads: int = 1
    max_queue: int = 64
    sidecar_capacity: str = "1GiB"
    sidecar_segment_size: str = "64MiB"
    ready_timeout_s: float = 600.0
    server_args: tuple[str, ...] = ()
    sidecar_args: tuple[str, ...] = ()
    sidecar_tmpfs: str | None = None
    balance_factor: float = 1.25


def child_env() -> dict[str, str]:
    """Env for Python children: our import roots on PYTHONPATH, unbuffered output.

    In an installed checkout this changes nothing; in a source tree it makes the
    children import the same packages as this process.
    """
    roots: list[str] = []
    for pkg in ("dscache", "dscache_sidecar", "dscache_server"):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            root = str(Path(next(iter(spec.submodule_search_locations))).parent)
            if root not in roots:
                roots.append(root)
    existing = os.environ.get("PYTHONPATH")
    if existing:
        roots.append(existing)
    return {"PYTHONPATH": os.pathsep.join(roots), "PYTHONUNBUFFERED": "1"}


def find_nginx() -> str:
    """Path of the ``nginx`` binary; a clear error naming the packages if absent."""
    from dscache_router.nginx import DEBIAN_LUA_MODULES

    path = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    missing = [m for m in DEBIAN_LUA_MODULES if not Path(m).exists()]
    if path is None or missing:
        raise StartError(
            "the router needs NGINX with its Lua module: apt-get install "
            + " ".join(NGINX_PACKAGES)
        )
    return path


def render_router(router: Router) -> None:
    """Writes the router's NGINX config (:mod:`dscache_router.nginx`) to ``router.conf``."""
    from dscache_router.nginx import (
        DEBIAN_LUA_MODULES,
        PromptKey,
        RouterConfig,
        render_nginx_conf,
    )

    cfg = RouterConfig(
        listen=f"127.0.0.1:{router.port}",
        stable=router.stable,
        canary=router.canary,
        canary_weight=router.canary_weight,
        prompt_key=PromptKey(mode="lua" if router.prompt_key else "off"),
        balance_factor=router.balance_factor,
        session_memory_s=router.session_memory_s,
        picker=router.picker,
        picker_timeout_ms=1000,
        load_modules=DEBIAN_LUA_MODULES,
        pid_file=str(router.workdir / "nginx.pid"),
        temp_dir=str(router.workdir),
        error_log=str(router.workdir / "error.log"),
        debug_headers=True,
    )
    router.conf.write_text(render_nginx_conf(cfg))


def prometheus_config(
    servers: list[Server], sidecars: list[Sidecar], scrape_interval_s: int, run_label: str
) -> str:
    """Prometheus's config scraping ``servers`` and ``sidecars``, labelled ``run``."""
    server_targets = ", ".join(f"'{s.address}'" for s in servers)
    sidecar_targets = ", ".join(f"'127.0.0.1:{s.metrics_port}'" for s in sidecars)
    labels = f", labels: {{run: '{run_label}'}}" if run_label else ""
    return (
        "global:\n"
        f"  scrape_interval: {scrape_interval_s}s\n"
        "scrape_configs:\n"
        "  - job_name: dscache-server\n"
        f"    static_configs: [{{targets: [{server_targets}]{labels}}}]\n"
        "  - job_name: dscache-sidecar\n"
        f"    static_configs: [{{targets: [{sidecar_targets}]{labels}}}]\n"
    )


def worker_pids(master: int) -> list[int]:
    """PIDs of an NGINX master's worker processes (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 (after the parenthesised command) is the parent pid.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == master:
            out.append(int(entry.name))
    return out
