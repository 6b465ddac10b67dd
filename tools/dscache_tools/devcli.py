"""``dscache dev cluster {build,up,down,env}``: the dev Kubernetes control plane;
``dscache dev eppcheck``: an endpoint picker against the extension's reference.

Light module: argument parsing only; each handler imports
:mod:`dscache_tools.devcluster` when it runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds ``dscache dev ...``; ``bench`` is not used."""
    del bench
    dev = sub.add_parser(
        "dev", help="developer tools: a local Kubernetes control plane, the EPP check"
    )
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="DEV")
    dev.set_defaults(handler=lambda _args: _help(dev))

    epp = dev_sub.add_parser(
        "eppcheck",
        help="check an endpoint picker against the Gateway API Inference Extension's "
        "reference picker (builds a Go driver on first use)",
    )
    epp.add_argument("--target", required=True, help="the picker's ext_proc address, HOST:PORT")
    epp.add_argument(
        "--endpoints",
        required=True,
        help="the pool's endpoints as the picker was given them: IP:PORT,IP:PORT,...",
    )
    epp.add_argument("--session-header", default="x-session-id")
    epp.add_argument(
        "--conversations",
        type=int,
        default=6,
        help="conversations of three turns, sent with a session id and again without",
    )
    epp.add_argument(
        "--forward",
        action="store_true",
        help="be the gateway's data path too: send each turn to the endpoint picked "
        "(http://ENDPOINT/v1/chat/completions); later turns must hit that pod's cache",
    )
    epp.add_argument(
        "--pad", type=int, default=40, help="words of each turn, in threes (150 for --forward)"
    )
    epp.set_defaults(handler=_eppcheck)

    cluster = dev_sub.add_parser(
        "cluster",
        help="a real Kubernetes control plane with real (kubelet) and simulated (KWOK) nodes",
        description=(
            "etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK "
            "as local processes, built from Go modules at pinned versions; with "
            "--real-nodes, containerd + kubelet nodes and kube-proxy whose pods run "
            "the dscache images, on a bridge network that never leaves this machine."
        ),
    )
    cluster_sub = cluster.add_subparsers(dest="cluster_command", metavar="ACTION")
    cluster.set_defaults(handler=lambda _args: _help(cluster))

    state_help = "state directory (default ${XDG_STATE_HOME:-~/.local/state}/dscache/devcluster)"

    b = cluster_sub.add_parser("build", help="build (or reuse) the binaries; prints progress")
    b.set_defaults(handler=_build)

    up = cluster_sub.add_parser("up", help="start a cluster and wait until it is ready")
    up.add_argument(
        "--nodes",
        type=int,
        default=3,
        help="simulated (KWOK) nodes; all but the last of two or more have 8 nvidia.com/gpu "
        "(default 3)",
    )
    up.add_argument(
        "--real-nodes",
        type=int,
        default=None,
        help="nodes whose pods really run (kubelet + containerd; needs root); default 1 "
        "where the host allows it, else 0 with the reason",
    )
    up.add_argument(
        "--prometheus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with real nodes, run Debian's Prometheus beside the cluster scraping the dscache "
        "pods (default: on when `prometheus` is installed); `env` prints its URL",
    )
    up.add_argument(
        "--kubeconfig", type=Path, default=None, help="also write the admin kubeconfig here"
    )
    up.add_argument("--state-dir", type=Path, default=None, help=state_help)
    up.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for readiness (default 60)"
    )
    up.set_defaults(handler=_up)

    down = cluster_sub.add_parser("down", help="stop the cluster and remove its state")
    down.add_argument("--state-dir", type=Path, default=None, help=state_help)
    down.set_defaults(handler=_down)

    reclaim = cluster_sub.add_parser(
        "reclaim",
        help="undo the host changes of a dead cluster with real nodes (one killed before "
        "`down` could run); nothing when the host is free, an error when a live one holds it",
    )
    reclaim.set_defaults(handler=_reclaim)

    env = cluster_sub.add_parser(
        "env", help="print shell exports: KUBECONFIG, and PATH with matching kubectl and helm"
    )
    env.add_argument("--state-dir", type=Path, default=None, help=state_help)
    env.set_defaults(handler=_env)


def _eppcheck(args: argparse.Namespace) -> int:
    from dscache_tools.eppcheck import run_cli

    endpoints = [e for e in args.endpoints.split(",") if e]
    return run_cli(
        args.target,
        endpoints,
        session_header=args.session_header,
        conversations=args.conversations,
        forward=args.forward,
        pad=args.pad,
    )


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _state_dir(args: argparse.Namespace) -> Path:
    from dscache_tools.devcluster import default_state_dir

    chosen: Path | None = args.state_dir
    return chosen.expanduser().resolve() if chosen else default_state_dir()


def _progress(line: str) -> None:
    print(f"[dev cluster build] {line}", file=sys.stderr, flush=True)


def _build(args: argparse.Namespace) -> int:
    from dscache_tools.devcluster import BuildError, ensure_built

    started = time.monotonic()
    try:
        binaries = ensure_built(progress=_progress)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    _progress(f"done in {time.monotonic() - started:.1f} s")
    for path in binaries.all_executables():
        print(path)
    return 0


def _up(args: argparse.Namespace) -> int:
    from dscache_tools.devcluster import BuildError, ClusterError, DevCluster, ensure_built
    from dscache_tools.devcluster.cluster import refuse_if_running
    from dscache_tools.devcluster.host import HostError, refuse_if_held
    from dscache_tools.devcluster.images import ImageError, image_loader
    from dscache_tools.devcluster.realnodes import real_nodes_default

    state_dir = _state_dir(args)
    try:
        # The cheap refusals first, before minutes of building.
        refuse_if_running(state_dir)
        real = args.real_nodes
        if real is None:
            real, reason = real_nodes_default()
            if reason:
                print(f"note: starting without real nodes: {reason}", file=sys.stderr)
        if real:
            refuse_if_held(state_dir)
        binaries = ensure_built(progress=_progress)
        loader = image_loader(progress=_progress) if real else None
        prometheus = _prometheus_binary(args.prometheus) if real else None
        started = time.monotonic()
        cluster = DevCluster.start(
            state_dir,
            node_count=args.nodes,
            real_nodes=real,
            load_images=loader,
            prometheus_binary=prometheus,
            kubeconfig=args.kubeconfig,
            binaries=binaries,
            timeout=args.timeout,
        )
    except (BuildError, ClusterError, HostError, ImageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"dev cluster ready in {time.monotonic() - started:.1f} s at {cluster.server} "
        f"with {cluster.node_count} simulated and {len(cluster.real_nodes)} real nodes; "
        f"state in {cluster.state_dir}",
        file=sys.stderr,
    )
    print('to use it: eval "$(dscache dev cluster env)"', file=sys.stderr)
    print(cluster.shell_exports(), end="")
    return 0


def _prometheus_binary(wanted: bool | None) -> str | None:
    import shutil

    found = shutil.which("prometheus") or shutil.which("prometheus", path="/usr/bin")
    if wanted and found is None:
        raise ValueError("--prometheus needs Debian's prometheus: apt-get install prometheus")
    if wanted is None and found is None:
        note = "note: no Prometheus beside the cluster (apt-get install prometheus)"
        print(note, file=sys.stderr)
    return found if wanted is not False else None


def _down(args: argparse.Namespace) -> int:
    from dscache_tools.devcluster import DevCluster

    state_dir = _state_dir(args)
    cluster = DevCluster.load(state_dir)
    if cluster is None:
        print(f"no dev cluster in {state_dir}", file=sys.stderr)
        return 0
    cluster.stop()
    print(f"dev cluster stopped; removed {state_dir}", file=sys.stderr)
    return 0


def _reclaim(_args: argparse.Namespace) -> int:
    from dscache_tools.devcluster.host import HostError, reclaim_dead

    try:
        reclaimed = reclaim_dead()
    except HostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if reclaimed is None:
        print("the host holds no dead cluster's changes", file=sys.stderr)
    else:
        print(f"undid the host changes of the dead cluster in {reclaimed}", file=sys.stderr)
    return 0


def _env(args: argparse.Namespace) -> int:
    from dscache_tools.devcluster import DevCluster

    state_dir = _state_dir(args)
    cluster = DevCluster.load(state_dir)
    if cluster is None:
        print(
            f"no dev cluster in {state_dir}; start one with `dscache dev cluster up`",
            file=sys.stderr,
        )
        return 1
    if not cluster.running():
        print(f"warning: the dev cluster in {state_dir} is not running", file=sys.stderr)
    print(cluster.shell_exports(), end="")
    return 0
