"""The HTTP routes: probes, metrics, the model list and the two completion APIs.

Contract:
    * ``GET /health``: 200 while the process serves HTTP (liveness).
    * ``GET /ready``: 200 ``{"status": "ready", "model", "cache"}`` once the model is
      loaded; 503 ``{"status": "loading" | "draining" | <load error>}`` with
      Retry-After otherwise (readiness).
    * ``GET /metrics``: the Prometheus text format (empty until the model is loaded).
    * ``GET /dscache/keyinfo``: what a router needs to compute this server's block
      keys: ``{"model", "block_tokens", "fingerprint"}`` (hex digest) and ``root``,
      the key chain's root of requests without any credential when tenancy is off
      (the anonymous tenant's, with the tenant secret applied: every anonymous
      client shares it anyway, and it reveals no other tenant's), else ``null``
      (a tenant's keys need its key). 503 until the model is loaded.
    * ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``:
      OpenAI's API; 503 ``not_ready`` until the model is loaded (``state``); with
      tenancy on, 401 ``invalid_api_key`` without a known key (``auth``). The
      probes and ``/metrics`` never ask for a key.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dscache_server.auth import DEFAULT_TENANT
from dscache_server.completions import handle_completion
from dscache_server.state import StateDep, authenticate

probes = APIRouter(tags=["probes"])
openai_api = APIRouter(prefix="/v1", tags=["openai"])


@probes.get("/health")
async def health() -> dict[str, str]:
    """Liveness."""
    return {"status": "ok"}


@probes.get("/ready")
async def ready(state: StateDep) -> JSONResponse:
    """Readiness: the model is loaded and the server is not draining."""
    reason = state.not_ready_reason()
    if reason is not None or state.runtime is None:
        return JSONResponse({"status": reason}, status_code=503, headers={"Retry-After": "1"})
    rt = state.runtime
    cache = "disabled" if rt.cache.store is None else "enabled"
    return JSONResponse({"status": "ready", "model": rt.settings.model_name, "cache": cache})


@probes.get("/metrics")
async def metrics(state: StateDep) -> Response:
    """The server's metrics in the Prometheus text format."""
    rt = state.runtime
    data = b"" if rt is None else generate_latest(rt.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)


@probes.get("/dscache/keyinfo")
async def keyinfo(state: StateDep) -> JSONResponse:
    """The key chain's public facts (see the module contract)."""
    rt = state.runtime
    if rt is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    root = None if rt.auth.tenancy else rt.chain_for(DEFAULT_TENANT).root.hex()
    return JSONResponse(
        {
            "model": rt.settings.model_name,
            "block_tokens": rt.fingerprint.block_tokens,
            "fingerprint": rt.fingerprint.digest().hex(),
            "root": root,
        }
    )


@openai_api.get("/models")
async def models(request: Request, state: StateDep) -> JSONResponse:
    """The one served model."""
    rt = state.serving().runtime
    authenticate(rt, request.headers)
    model = {
        "id": rt.settings.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "dscache",
        "max_model_len": rt.max_context,
    }
    return JSONResponse({"object": "list", "data": [model]})


@openai_api.post("/chat/completions")
async def chat(request: Request, state: StateDep) -> Response:
    """A chat completion, streamed or not."""
    return await handle_completion(request, "chat", state)


@openai_api.post("/completions")
async def completions(request: Request, state: StateDep) -> Response:
    """A text completion, streamed or not."""
    return await handle_completion(request, "completions", state)
