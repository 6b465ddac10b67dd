"""``dscache sidecar``.

Light module: argument parsing only; each handler imports its implementation.
"""

from __future__ import annotations

import argparse

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds the sidecar's subcommands."""
    p = sub.add_parser("sidecar", help="run the node-local KV block store daemon")
    from dscache_sidecar.config import add_sidecar_arguments

    add_sidecar_arguments(p)
    p.set_defaults(handler=_run_sidecar)


def _run_sidecar(args: argparse.Namespace) -> int:
    from dscache_sidecar.daemon import run_from_args

    return run_from_args(args)
