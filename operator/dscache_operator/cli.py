"""``dscache operator [--namespace NS ... | --all-namespaces] [--peering NAME]``.

Light module: argument parsing only; the handler imports kopf and the
Kubernetes client. The operator uses the current kubeconfig (``$KUBECONFIG``
or ~/.kube/config), or the in-cluster service account in a pod.
"""

from __future__ import annotations

import argparse

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds ``dscache operator``."""
    p = sub.add_parser(
        "operator",
        help="run the DeepSeekCacheDeployment operator against the current kubeconfig",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        default=None,
        help="watch this namespace (repeatable; env DSCACHE_OPERATOR_NAMESPACES)",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", default=None, help="watch every namespace"
    )
    p.add_argument(
        "--tick-seconds", type=float, default=None, help="rollout timer period (default 10)"
    )
    p.add_argument("--prometheus-url", default=None, help="default Prometheus for analysis")
    p.add_argument("--health-port", type=int, default=None, help="/healthz port (0 = off)")
    p.add_argument("--metrics-port", type=int, default=None, help="/metrics port (0 = off)")
    p.add_argument(
        "--peering",
        default=None,
        metavar="NAME",
        help="kopf peering object shared by replicas, so exactly one acts "
        "(env DSCACHE_OPERATOR_PEERING; default empty: standalone)",
    )
    p.add_argument(
        "--print-crd", action="store_true", help="print the CRD YAML and exit (no cluster needed)"
    )
    p.set_defaults(handler=_run_operator)


def _run_operator(args: argparse.Namespace) -> int:
    if args.print_crd:
        from dscache_operator.crd import render_crd_yaml

        print(render_crd_yaml(), end="")
        return 0
    from dscache_operator.main import run
    from dscache_operator.settings import OperatorSettings

    overrides = {
        "namespaces": args.namespaces,
        "all_namespaces": args.all_namespaces,
        "tick_seconds": args.tick_seconds,
        "prometheus_url": args.prometheus_url,
        "health_port": args.health_port,
        "metrics_port": args.metrics_port,
        "peering": args.peering,
    }
    settings = OperatorSettings(**{k: v for k, v in overrides.items() if v is not None})
    return run(settings)
