"""``dscache picker``: the picker's HTTP server (see :mod:`dscache_router.picker`).

Routes: ``POST /pick`` (the decision), ``GET /locate?key=K&pods=ADDR,...&budget_ms=N`` (which
of the pods served session ``K``, asked of the pods themselves, so that router
replicas agree: :mod:`dscache_router.locate`; 200 with the address, 404 when
none did, 400 for a bad query; each pod is given ``budget_ms``, else
``--locate-timeout``), ``POST /holder?pods=ADDR,...&lead=N&budget_ms=M`` (body: the client's
request; which pod holds the conversation past its first ``N`` messages, from what
the pods hold, and where the blocks cannot tell, from the pods' conversation
ledgers, each pod given ``budget_ms``, else ``--locate-timeout``:
:meth:`~dscache_router.picker.Picker.holder`; 200 with the address,
404 when none does, 400 for a bad query), ``GET /health``, ``GET /metrics``. The
decision runs on a worker thread (tokenizing is CPU work); the filters are
fetched by a background thread, with the internal token of
``DSCACHE_PICKER_INTERNAL_TOKEN`` (an environment variable, never a flag: flags
show in the process list). A pick body is read up to ``MAX_BODY`` bytes, no
further (413).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_sidecar.holdings import INTERNAL_TOKEN_HEADER
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from dscache.routing import MAX_SESSION_ID
from dscache_router.epp import EndpointPicker, EppSettings, PoolFileWatcher, serve
from dscache_router.eventfeed import EventFeed
from dscache_router.locate import locate, previous_pod
from dscache_router.picker import (
    BLOCKS_HEADER,
    REASON_HEADER,
    HolderQuery,
    Picker,
    PickError,
    PickerSettings,
    PickQuery,
    Refresher,
)

log = logging.getLogger(__name__)

Q = TypeVar("Q")

#: Largest body the picker reads (the router's own limit is the real one).
MAX_BODY = 16 << 20
#: The environment variable with the internal token sent with every fetch.
INTERNAL_TOKEN_ENV = "DSCACHE_PICKER_INTERNAL_TOKEN"  # noqa: S105 - a variable's name


def create_app(
    picker: Picker,
    refresher: Refresher | None = None,
    feeds: Sequence[EventFeed] = (),
    epp: tuple[EndpointPicker, str, int] | None = None,
    pool_file: PoolFileWatcher | None = None,
) -> FastAPI:
    """The picker's ASGI app (``refresher``, the event ``feeds`` and the endpoint
    picker ``epp``, with its host and port, run while the app is up)."""

    settings = picker.settings
    token = {INTERNAL_TOKEN_HEADER: settings.internal_token} if settings.internal_token else {}
    clients: list[httpx.AsyncClient] = []

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if refresher is not None:
            refresher.start()
        for feed in feeds:
            feed.start()
        clients.append(httpx.AsyncClient(timeout=settings.locate_timeout_s))
        grpc_server = await serve(*epp) if epp is not None else None
        if pool_file is not None:
            pool_file.start()
        try:
            yield
        finally:
            if pool_file is not None:
                pool_file.stop()
            if grpc_server is not None:
                await grpc_server[0].stop(grace=5)
            if epp is not None:
                await epp[0].aclose()
            await clients.pop().aclose()
            if refresher is not None:
                refresher.stop()
            for feed in feeds:
                feed.stop()

    app = FastAPI(title="dscache picker", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(picker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/pick")
    async def pick(request: Request) -> Response:
        query = await _query(request, PickQuery.parse)
        if isinstance(query, Response):
            return query
        choice = await run_in_threadpool(picker.pick, query)
        headers = {REASON_HEADER: choice.reason, BLOCKS_HEADER: str(choice.blocks)}
        return PlainTextResponse(choice.pod, headers=headers)

    _placement_routes(app, picker, clients, token)
    return app


def _placement_routes(
    app: FastAPI, picker: Picker, clients: list[httpx.AsyncClient], token: dict[str, str]
) -> None:
    """``GET /locate`` and ``POST /holder``: where a request the router cannot place by
    its own memory belongs (see the module docstring)."""

    @app.get("/locate")
    async def locate_session(key: str = "", pods: str = "", budget_ms: int = 0) -> Response:
        addresses = [a for a in pods.split(",") if a]
        bad = _not_addresses(addresses)
        if not key or len(key) > MAX_SESSION_ID or not addresses or bad:
            picker.metrics.locates.labels("failed").inc()
            why = bad or "key and pods are required"
            return JSONResponse({"error": why}, status_code=400)
        # The router's own wait for the picker bounds the lookup (budget_ms), else the flag.
        timeout = min(budget_ms, 10_000) / 1000 if budget_ms > 0 else None
        pod, _ = await locate(clients[0], addresses[:MAX_LOCATE_PODS], key, token, timeout)
        picker.metrics.locates.labels("found" if pod else "unknown").inc()
        if pod is None:
            return PlainTextResponse("", status_code=404)
        return PlainTextResponse(pod)

    @app.post("/holder")
    async def holder(request: Request) -> Response:
        query = await _query(request, _holder_query)
        if isinstance(query, Response):
            picker.metrics.holders.labels("failed").inc()
            return query
        budget = query.budget_ms / 1000 if query.budget_ms > 0 else picker.settings.locate_timeout_s
        pods = query.pods[:MAX_LOCATE_PODS]
        loop = asyncio.get_running_loop()
        # None while the app is not running (no lifespan): nobody to ask.
        last_served = (
            functools.partial(previous_pod, loop, clients[0], pods, headers=token, timeout_s=budget)
            if clients
            else None
        )
        pod = await run_in_threadpool(picker.holder, query, last_served)
        if pod is None:
            return PlainTextResponse("", status_code=404)
        return PlainTextResponse(pod)


#: A pod address the picker will ask (the router's own config names them).
_ADDRESS = re.compile(r"[A-Za-z0-9.\-]{1,253}:\d{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:\d{1,5}")
#: Pods one lookup asks at most (every live pod of a deployment's tracks).
MAX_LOCATE_PODS = 256


async def _query(
    request: Request, parse: Callable[[Mapping[str, str], bytes, bool], Q]
) -> Q | Response:
    """The query string parsed with the body (at most ``MAX_BODY``) and whether the
    client sent credentials; a 413 or a 400 answer instead when it cannot be."""
    body = await _read_body(request, MAX_BODY)
    if body is None:
        return PlainTextResponse("body too large\n", status_code=413)
    try:
        return parse(dict(request.query_params), body, "authorization" in request.headers)
    except PickError as exc:
        return JSONResponse({"error": str(exc)}, status_code=400)


def _holder_query(args: Mapping[str, str], body: bytes, credentials: bool) -> HolderQuery:
    query = HolderQuery.parse(args, body, credentials)
    bad = _not_addresses(query.pods)
    if bad:
        raise PickError(bad)
    return query


def _not_addresses(addresses: Sequence[str]) -> str:
    """Why ``addresses`` are not all pod addresses the picker will ask ("" if they are)."""
    bad = next((a for a in addresses if not _ADDRESS.fullmatch(a)), None)
    return "" if bad is None else f"not HOST:PORT: {bad!r}"


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None as soon as it is over ``limit`` bytes (the rest is not read)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            return None
    return bytes(buf)


def _domain_terms(args: argparse.Namespace) -> dict[str, int]:
    """``--domain-terms FILE`` and ``--domain-term TERM=WEIGHT``; ValueError for a bad one."""
    terms: dict[str, int] = {}
    if args.domain_terms is not None:
        raw = json.loads(args.domain_terms.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{args.domain_terms}: must be a JSON object of term -> weight")
        for term, weight in raw.items():
            if not isinstance(weight, int) or not 0 <= weight <= 64:
                raise ValueError(f"{args.domain_terms}: weight of {term!r} must be 0..64")
            terms[str(term).lower()] = weight
    for item in args.domain_term:
        term, sep, weight = item.partition("=")
        if not sep or not term or not weight.isdigit() or int(weight) > 64:
            raise ValueError(f"--domain-term {item!r} is not TERM=WEIGHT (weight 0..64)")
        terms[term.lower()] = int(weight)
    return terms


def settings_from_args(args: argparse.Namespace) -> PickerSettings:
    """The settings of ``dscache picker``'s arguments; ValueError for a bad one."""
    holdings: dict[str, str] = {}
    for item in args.holdings:
        pod, sep, url = item.partition("=")
        if not sep or not pod or not url.startswith(("http://", "https://")):
            raise ValueError(f"--holdings {item!r} is not POD=http://...")
        holdings[pod] = url
    terms = _domain_terms(args)
    if not 0.0 <= args.similarity_threshold <= 1.0:
        raise ValueError("--similarity-threshold must be in [0, 1]")
    if args.refresh <= 0:
        raise ValueError("--refresh must be positive")
    for flag in ("kv_events", "vllm_events"):
        if (getattr(args, f"{flag}_port") is None) != (
            getattr(args, f"{flag}_replay_port") is None
        ):
            name = flag.replace("_", "-")
            raise ValueError(f"--{name}-port and --{name}-replay-port go together")
    if not 0.001 <= args.locate_timeout <= 10.0:
        raise ValueError("--locate-timeout must be between 0.001 and 10 seconds")
    return PickerSettings(
        holdings=holdings,
        holdings_port=args.holdings_port,
        refresh_s=args.refresh,
        memory_s=args.memory,
        similarity_threshold=args.similarity_threshold,
        domain_terms=terms,
        internal_token=os.environ.get(INTERNAL_TOKEN_ENV, ""),
        locate_timeout_s=args.locate_timeout,
        events_port=args.kv_events_port,
        events_replay_port=args.kv_events_replay_port,
        gpu_events_port=args.vllm_events_port,
        gpu_events_replay_port=args.vllm_events_replay_port,
    )


def epp_settings_from_args(args: argparse.Namespace) -> EppSettings:
    """The endpoint picker's settings of ``--epp-*``; ValueError for a bad one."""
    endpoints: dict[str, str] = {}
    for item in args.epp_endpoint:
        address, sep, track = item.partition("=")
        if not _ADDRESS.fullmatch(address) or (sep and not track):
            raise ValueError(f"--epp-endpoint {item!r} is not IP:PORT=TRACK")
        endpoints[address] = track or "stable"
    weights: dict[str, float] = {}
    for item in args.epp_track_weight:
        track, sep, pct = item.partition("=")
        try:
            weights[track] = float(pct)
        except ValueError:
            sep = ""
        if not sep or not track:
            raise ValueError(f"--epp-track-weight {item!r} is not TRACK=PERCENT")
    objectives: dict[str, int] = {}
    for item in args.epp_objective:
        name, sep, priority = item.partition("=")
        if not sep or not name or not priority.lstrip("-").isdigit():
            raise ValueError(f"--epp-objective {item!r} is not NAME=PRIORITY (a whole number)")
        objectives[name] = int(priority)
    if args.epp_max_inflight < 0:
        raise ValueError("--epp-max-inflight must be 0 or more")
    if not endpoints and args.epp_pool_file is None:
        raise ValueError("--epp needs at least one endpoint: --epp-endpoint or --epp-pool-file")
    return EppSettings(
        endpoints=endpoints,
        track_weights=weights,
        max_inflight=args.epp_max_inflight,
        objectives=objectives,
        session_header=args.session_header,
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Runs ``dscache picker`` until SIGTERM; 2 for bad arguments."""
    import uvicorn

    try:
        settings = settings_from_args(args)
        epp_settings = epp_settings_from_args(args) if args.epp else None
    except (ValueError, OSError) as exc:
        print(f"dscache picker: {exc}")
        return 2
    picker = Picker(settings, DeepSeekTokenizer())
    picker.know(settings.holdings)
    feeds = []
    if settings.events_port is not None and settings.events_replay_port is not None:
        feeds.append(
            EventFeed(
                picker, settings.events_port, settings.events_replay_port, settings.internal_token
            )
        )
    if settings.gpu_events_port is not None and settings.gpu_events_replay_port is not None:
        # vLLM's engine publishes no baseline and asks for no login.
        gpu = settings.gpu_events_port, settings.gpu_events_replay_port
        feeds.append(EventFeed(picker.gpu, *gpu, baselines=False))
    epp, watcher = None, None
    if epp_settings is not None:
        servicer = EndpointPicker(picker, epp_settings)
        epp = (servicer, args.epp_host or args.host, args.epp_port)
        if args.epp_pool_file is not None:
            watcher = PoolFileWatcher(servicer, args.epp_pool_file)
            watcher.check()  # the pool it starts with (an unreadable file: none yet)
    app = create_app(picker, Refresher(picker), feeds, epp, watcher)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
