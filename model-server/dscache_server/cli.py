"""``dscache server`` and ``dscache prewarm``.

Light module: argument parsing only; each handler imports its implementation, so
``dscache --help`` never loads torch.
"""

from __future__ import annotations

import argparse

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds the model server's subcommands."""
    from dscache_server.config import add_server_arguments

    s = sub.add_parser("server", help="run the OpenAI-compatible model server with prefix KV reuse")
    add_server_arguments(s)
    s.set_defaults(handler=_run_server)

    p = sub.add_parser("prewarm", help="send prompts to servers so their prefixes get cached")
    p.add_argument(
        "--target",
        action="append",
        required=True,
        help="server base URL, e.g. http://127.0.0.1:8000; repeatable and/or comma-separated "
        "(the pods of one track)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        help='JSONL file: one chat per line ({"messages": [...]} or a list of messages)',
    )
    p.add_argument(
        "--mined-from",
        action="append",
        default=[],
        help="server base URLs whose live-mined templates to send too (repeatable and/or "
        "comma-separated; needs $DSCACHE_PREWARM_GATEWAY_TOKEN)",
    )
    p.add_argument("--mined-top", type=int, default=100, help="mined templates sent (default 100)")
    p.add_argument(
        "--placement",
        choices=["all", "ring"],
        default="all",
        help="all: every prompt to every target (default); ring: each prompt to the pods "
        "the router's consistent hash picks for it",
    )
    p.add_argument(
        "--copies", type=int, default=1, help="ring: pods of each prompt's walk warmed (1)"
    )
    p.add_argument(
        "--skip-copies",
        type=int,
        default=0,
        help="ring: the first pods of each walk, warmed by an earlier step (0)",
    )
    p.add_argument(
        "--prompt-key-max-bytes",
        type=int,
        default=4096,
        help="the router's promptKey.maxBytes (4096)",
    )
    p.add_argument(
        "--prompt-key-max-messages",
        type=int,
        default=2,
        help="the router's promptKey.maxMessages (2)",
    )
    p.add_argument(
        "--tenant",
        default=None,
        help="tenant header value (default: none); needs the server's gateway secret "
        "in $DSCACHE_PREWARM_GATEWAY_TOKEN",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer API key (tenant by key; default: $DSCACHE_PREWARM_API_KEY)",
    )
    p.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight per target (default 1)"
    )
    p.add_argument(
        "--top-n", type=int, default=None, help="send only the first N prompts (default: all)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request (300)")
    p.add_argument(
        "--connect-wait",
        type=float,
        default=30.0,
        help="seconds a request that could not connect is tried again (30): a new pod's "
        "network policy can refuse it for its first seconds",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.set_defaults(handler=_run_prewarm)


def _run_server(args: argparse.Namespace) -> int:
    from dscache_server.serve import run_from_args

    return run_from_args(args)


def _run_prewarm(args: argparse.Namespace) -> int:
    from dscache_server.prewarm import run_cli

    return run_cli(args)
