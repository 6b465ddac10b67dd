"""``dscache server``, ``dscache prewarm`` and ``dscache picker``.

Light module: argument parsing only; each handler imports its implementation, so
``dscache --help`` never loads torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

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

    k = sub.add_parser(
        "picker", help="the router's picker: the pod holding a request's longest cached prefix"
    )
    add_picker_arguments(k)
    k.set_defaults(handler=_run_picker)


def _run_server(args: argparse.Namespace) -> int:
    from dscache_server.serve import run_from_args

    return run_from_args(args)


def add_picker_arguments(p: argparse.ArgumentParser) -> None:
    """``dscache picker``'s flags (see :mod:`dscache_server.pickerserve`)."""
    p.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8090, help="listen port (default 8090)")
    p.add_argument(
        "--holdings",
        action="append",
        default=[],
        metavar="POD=URL",
        help="a pod's sidecar holdings URL (repeatable), e.g. "
        "10.0.0.5:8000=http://10.0.0.5:9400/dscache/holdings",
    )
    p.add_argument(
        "--holdings-port",
        type=int,
        default=None,
        help="for pods without --holdings: http://<pod IP>:PORT/dscache/holdings",
    )
    p.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="also follow each pod's sidecar KV events on tcp://<pod IP>:PORT (exact, "
        "fresher holdings; the filter answers while a feed is not in sync)",
    )
    p.add_argument(
        "--kv-events-replay-port", type=int, default=None, help="the sidecars' KV event replay port"
    )
    p.add_argument("--refresh", type=float, default=1.0, help="seconds between filter fetches (1)")
    p.add_argument(
        "--memory",
        type=float,
        default=120.0,
        help="seconds the picker's own placements count (120)",
    )
    p.add_argument(
        "--locate-timeout",
        type=float,
        default=0.15,
        help="seconds a session lookup waits for the pods (0.15; under NGINX's picker timeout)",
    )
    p.add_argument(
        "--similarity-threshold",
        type=float,
        default=0.65,
        help="estimated Jaccard from which a request follows a similar one (0.65; 0: off)",
    )
    p.add_argument(
        "--domain-term",
        action="append",
        default=[],
        metavar="TERM=WEIGHT",
        help="a word that counts WEIGHT times in similarity (repeatable)",
    )
    p.add_argument(
        "--domain-terms",
        type=Path,
        default=None,
        help='JSON object {"term": weight} of words that count weight times in similarity',
    )
    epp = p.add_argument_group(
        "endpoint picker (Gateway API Inference Extension; dscache_server.epp)"
    )
    epp.add_argument(
        "--epp",
        action="store_true",
        help="also serve Envoy ext_proc as an InferencePool's endpoint picker (gRPC, --epp-port)",
    )
    epp.add_argument("--epp-port", type=int, default=9002, help="ext_proc port (default 9002)")
    epp.add_argument("--epp-host", default=None, help="ext_proc listen address (default: --host's)")
    epp.add_argument(
        "--epp-pool-file",
        type=Path,
        default=None,
        help='the pool as JSON {"endpoints": {"ip:port": "track"}, "trackWeights": '
        '{"track": percent}}, reloaded when it changes (the operator writes it)',
    )
    epp.add_argument(
        "--epp-endpoint",
        action="append",
        default=[],
        metavar="IP:PORT=TRACK",
        help="a pod of the pool and its track (repeatable), e.g. 10.0.0.5:8000=stable",
    )
    epp.add_argument(
        "--epp-track-weight",
        action="append",
        default=[],
        metavar="TRACK=PERCENT",
        help="percent of new sessions a track takes (repeatable; the rest share what is left)",
    )
    epp.add_argument(
        "--epp-max-inflight",
        type=int,
        default=0,
        help="requests in flight per pod past which it is not picked; all past it: 429 (0: off)",
    )
    epp.add_argument(
        "--session-header",
        default="x-session-id",
        help="the client's session id header (default x-session-id)",
    )


def _run_picker(args: argparse.Namespace) -> int:
    from dscache_server.pickerserve import run_from_args

    return run_from_args(args)


def _run_prewarm(args: argparse.Namespace) -> int:
    from dscache_server.prewarm import run_cli

    return run_cli(args)
