"""``dscache dev cluster {build,up,down,env}``: the dev Kubernetes control plane.

Light module: argument parsing only; each handler imports
:mod:`dscache.devcluster` when it runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Adds ``dscache dev ...``; ``bench`` is not used."""
    del bench
    dev = sub.add_parser("dev", help="developer tools: a local Kubernetes control plane")
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="DEV")
    dev.set_defaults(handler=lambda _args: _help(dev))

    cluster = dev_sub.add_parser(
        "cluster",
        help="a real Kubernetes control plane on loopback with fake (KWOK) nodes",
        description=(
            "etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK "
            "as local processes on 127.0.0.1, built from Go modules at pinned versions."
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
        help="fake nodes; all but the last of two or more have 8 nvidia.com/gpu (default 3)",
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

    env = cluster_sub.add_parser(
        "env", help="print shell exports: KUBECONFIG, and PATH with matching kubectl and helm"
    )
    env.add_argument("--state-dir", type=Path, default=None, help=state_help)
    env.set_defaults(handler=_env)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _state_dir(args: argparse.Namespace) -> Path:
    from dscache.devcluster import default_state_dir

    chosen: Path | None = args.state_dir
    return chosen.expanduser().resolve() if chosen else default_state_dir()


def _progress(line: str) -> None:
    print(f"[dev cluster build] {line}", file=sys.stderr, flush=True)


def _build(args: argparse.Namespace) -> int:
    from dscache.devcluster import BuildError, ensure_built

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
    from dscache.devcluster import BuildError, ClusterError, DevCluster, ensure_built

    try:
        binaries = ensure_built(progress=_progress)
        started = time.monotonic()
        cluster = DevCluster.start(
            _state_dir(args),
            node_count=args.nodes,
            kubeconfig=args.kubeconfig,
            binaries=binaries,
            timeout=args.timeout,
        )
    except (BuildError, ClusterError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"dev cluster ready in {time.monotonic() - started:.1f} s at {cluster.server} "
        f"with {cluster.node_count} nodes; state in {cluster.state_dir}",
        file=sys.stderr,
    )
    print('to use it: eval "$(dscache dev cluster env)"', file=sys.stderr)
    print(cluster.shell_exports(), end="")
    return 0


def _down(args: argparse.Namespace) -> int:
    from dscache.devcluster import DevCluster

    state_dir = _state_dir(args)
    cluster = DevCluster.load(state_dir)
    if cluster is None:
        print(f"no dev cluster in {state_dir}", file=sys.stderr)
        return 0
    cluster.stop()
    print(f"dev cluster stopped; removed {state_dir}", file=sys.stderr)
    return 0


def _env(args: argparse.Namespace) -> int:
    from dscache.devcluster import DevCluster

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
