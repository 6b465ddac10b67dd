"""``dscache sidecar``, ``dscache replay`` and ``dscache bench store``.

Light module: argument parsing only; each handler imports its implementation.
"""

from __future__ import annotations

import argparse


def register(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    bench: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Adds the sidecar's subcommands."""
    p = sub.add_parser("sidecar", help="run the node-local KV block store daemon")
    from dscache_sidecar.config import add_sidecar_arguments

    add_sidecar_arguments(p)
    p.set_defaults(handler=_run_sidecar)

    r = sub.add_parser(
        "replay",
        help="replay a request trace against eviction policies (hit ratios, Belady bound)",
    )
    r.add_argument("--trace", required=True, help="Mooncake JSONL trace or a dscache request log")
    r.add_argument(
        "--capacity-blocks",
        default="16384",
        help="comma-separated cache capacities in blocks (default 16384)",
    )
    r.add_argument(
        "--policy",
        default=None,
        help="comma-separated policies, or 'all' (default: the store's default policy and lru)",
    )
    r.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    r.add_argument("--png", dest="png_out", default=None, help="write a hit-ratio chart here")
    r.add_argument(
        "--no-belady",
        action="store_true",
        help="skip the offline-optimal bound (slow on big traces)",
    )
    r.set_defaults(handler=_run_replay)

    bs = bench.add_parser(
        "store", help="KV store write/read paths vs torch.save/load, memcpy, write()"
    )
    bs.add_argument("--tokens", type=int, default=4096, help="KV length in tokens (default 4096)")
    bs.add_argument(
        "--repeat", type=int, default=7, help="repetitions per figure (median; default 7)"
    )
    bs.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    bs.add_argument("--data-dir", default=None, help="where to put the store (default: a temp dir)")
    bs.set_defaults(handler=_run_bench_store)


def _run_sidecar(args: argparse.Namespace) -> int:
    from dscache_sidecar.daemon import run_from_args

    return run_from_args(args)


def _run_replay(args: argparse.Namespace) -> int:
    from dscache_sidecar.replay import run_cli

    return run_cli(args)


def _run_bench_store(args: argparse.Namespace) -> int:
    from dscache_sidecar.bench import run_cli

    return run_cli(args)
