"""``dscache picker``: the router pod's picker (and, with ``--epp``, the endpoint picker).

Light module: argument parsing only; the handler imports the implementation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dscache.cli import Commands


def register(sub: Commands, bench: Commands) -> None:
    """Adds the router's subcommand."""
    k = sub.add_parser(
        "picker", help="the router's picker: the pod holding a request's longest cached prefix"
    )
    add_picker_arguments(k)
    k.set_defaults(handler=_run_picker)


def add_picker_arguments(p: argparse.ArgumentParser) -> None:
    """``dscache picker``'s flags (see :mod:`dscache_router.serve`)."""
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
    p.add_argument(
        "--vllm-events-port",
        type=int,
        default=None,
        help="also follow each vLLM pod's own engine KV events (its GPU prefix cache, "
        "vLLM's --kv-events-config) on tcp://<pod IP>:PORT",
    )
    p.add_argument(
        "--vllm-events-replay-port",
        type=int,
        default=None,
        help="the engines' KV event replay port",
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
        "endpoint picker (Gateway API Inference Extension; dscache_router.epp)"
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
        "--epp-objective",
        action="append",
        default=[],
        metavar="NAME=PRIORITY",
        help="an InferenceObjective's priority (repeatable): a request naming NAME in "
        "x-gateway-inference-objective with a negative priority is shed (429) when every "
        "pod is at --epp-max-inflight; others never are (a pool file brings its own)",
    )
    epp.add_argument(
        "--session-header",
        default="x-session-id",
        help="the client's session id header (default x-session-id)",
    )


def _run_picker(args: argparse.Namespace) -> int:
    from dscache_router.serve import run_from_args

    return run_from_args(args)
