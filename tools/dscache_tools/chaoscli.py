"""``dscache chaos``: the failure matrix under load on the local stack.

Light module: argument parsing only; the handler imports :mod:`dscache_tools.chaos`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds ``dscache chaos``."""
    del bench  # a failure matrix, not a benchmark of one component
    c = sub.add_parser(
        "chaos",
        help="kill -9 a sidecar and a model server, reload NGINX, fill a cache disk, slow a "
        "sidecar, each under load through the local router; print failed requests and TTFT",
        description="Starts NGINX, two model servers and their sidecars on loopback and runs "
        "one load per fault (plus a baseline) through the router; each fault starts after a "
        "third of the case's requests and is undone after two thirds. Exits 1 when any request "
        "failed. Requests are not streamed, so TTFT is the time to the whole answer.",
    )
    c.add_argument("--quick", action="store_true", help="few requests per case (the test suite)")
    c.add_argument("--json", dest="json_out", type=Path, default=None, help="write the report")
    c.add_argument("--workdir", type=Path, default=None, help="keep files and logs here")
    c.add_argument("--model", default="tiny-gqa", help="model preset (default tiny-gqa)")
    c.add_argument(
        "--requests", type=int, default=None, help="requests per case (quick 6, default 48)"
    )
    c.add_argument("--concurrency", type=int, default=4, help="sessions in flight (default 4)")
    c.add_argument("--max-tokens", type=int, default=8, help="completion tokens (default 8)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per server (1)")
    c.set_defaults(handler=_run_chaos)


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise SystemExit(f"dscache chaos: {name} must be >= 1, not {value}")


def _run_chaos(args: argparse.Namespace) -> int:
    from dscache_tools.chaos import ChaosOptions, format_table, run_chaos, write_json

    for name in ("requests", "concurrency", "max_tokens", "threads"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    opts = ChaosOptions(
        quick=args.quick,
        model=args.model,
        requests=args.requests,
        concurrency=args.concurrency,
        workdir=args.workdir,
        max_tokens=args.max_tokens,
        threads=args.threads,
    )
    report = run_chaos(opts)
    print()
    print(format_table(report))
    if args.json_out is not None:
        write_json(report, args.json_out)
        print(f"JSON written to {args.json_out}")
    if report.failed:
        print(f"FAILED: {report.failed} client requests failed")
        return 1
    return 0
