"""``dscache picker``: the picker's HTTP server (see :mod:`dscache_server.picker`).

Routes: ``POST /pick`` (the decision), ``GET /health``, ``GET /metrics``. The
decision runs on a worker thread (tokenizing is CPU work); the filters are
fetched by a background thread, with the internal token of
``DSCACHE_PICKER_INTERNAL_TOKEN`` (an environment variable, never a flag: flags
show in the process list). A pick body is read up to ``MAX_BODY`` bytes, no
further (413).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from dscache_server.picker import (
    BLOCKS_HEADER,
    REASON_HEADER,
    Picker,
    PickError,
    PickerSettings,
    PickQuery,
    Refresher,
)
from dscache_server.tokenizer import DeepSeekTokenizer

log = logging.getLogger(__name__)

#: Largest body the picker reads (the router's own limit is the real one).
MAX_BODY = 16 << 20
#: The environment variable with the internal token sent with every fetch.
INTERNAL_TOKEN_ENV = "DSCACHE_PICKER_INTERNAL_TOKEN"  # noqa: S105 - a variable's name


def create_app(picker: Picker, refresher: Refresher | None = None) -> FastAPI:
    """The picker's ASGI app (``refresher`` runs while the app is up)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if refresher is not None:
            refresher.start()
        try:
            yield
        finally:
            if refresher is not None:
                refresher.stop()

    app = FastAPI(title="dscache picker", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(picker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/pick")
    async def pick(request: Request) -> Response:
        body = await _read_body(request, MAX_BODY)
        if body is None:
            return PlainTextResponse("body too large\n", status_code=413)
        credentials = "authorization" in request.headers
        try:
            query = PickQuery.parse(dict(request.query_params), body, credentials)
        except PickError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        choice = await run_in_threadpool(picker.pick, query)
        headers = {REASON_HEADER: choice.reason, BLOCKS_HEADER: str(choice.blocks)}
        return PlainTextResponse(choice.pod, headers=headers)

    return app


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


def settings_from_args(args: argparse.Namespace) -> PickerSettings:
    """The settings of ``dscache picker``'s arguments; ValueError for a bad one."""
    holdings: dict[str, str] = {}
    for item in args.holdings:
        pod, sep, url = item.partition("=")
        if not sep or not pod or not url.startswith(("http://", "https://")):
            raise ValueError(f"--holdings {item!r} is not POD=http://...")
        holdings[pod] = url
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
    if not 0.0 <= args.similarity_threshold <= 1.0:
        raise ValueError("--similarity-threshold must be in [0, 1]")
    if args.refresh <= 0:
        raise ValueError("--refresh must be positive")
    return PickerSettings(
        holdings=holdings,
        holdings_port=args.holdings_port,
        refresh_s=args.refresh,
        memory_s=args.memory,
        similarity_threshold=args.similarity_threshold,
        domain_terms=terms,
        internal_token=os.environ.get(INTERNAL_TOKEN_ENV, ""),
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Runs ``dscache picker`` until SIGTERM; 2 for bad arguments."""
    import uvicorn

    try:
        settings = settings_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"dscache picker: {exc}")
        return 2
    picker = Picker(settings, DeepSeekTokenizer())
    picker.know(settings.holdings)
    app = create_app(picker, Refresher(picker))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
