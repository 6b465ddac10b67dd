"""The HTTP routes: probes, metrics, live templates, the model list and the completion APIs.

Contract:
    * ``GET /health``: 200 while the process serves HTTP (liveness).
    * ``GET /ready``: 200 ``{"status": "ready", "model", "cache"}`` once the model is
      loaded; 503 ``{"status": "loading" | "draining" | <load error>}`` with
      Retry-After otherwise (readiness).
    * ``GET /metrics``: the Prometheus text format (empty until the model is loaded).
    * ``GET /dscache/keyinfo``: what a router needs to compute this server's block
      keys: ``{"model", "block_tokens", "fingerprint"}`` (hex digest) and ``root``,
      the key chain's root of requests without any credential when tenancy is off
      (the anonymous tenant's, with the tenant secret applied), else ``null`` (a
      tenant's keys need its key). With the root, whoever guesses a prompt computes
      its keys and can test them against a holdings filter: with an internal token
      configured (``internal_token``) only a request carrying it (or the gateway
      token) gets an answer, else 401 ``invalid_internal_token``. 503 until the
      model is loaded.
    * ``GET /dscache/sessions/<id>``: whether this pod served the session (router
      replicas share placements through it, :mod:`dscache_router.locate`): 200
      ``{"age_s", "inflight"}`` or 404 ``{"inflight"}``; the internal token as for
      the key info; 503 until the model is loaded.
    * ``GET /dscache/conversations/<key>``: the same for a conversation's last turn
      served here (``dscache.routing.conversation_key`` of its messages; only the
      public tenant's are recorded).
    * ``GET /dscache/templates?top=N&tenant=T``: the live template miner's top ``N``
      (default 100, 1 to 1000) templates, of tenant id ``T`` or all, best first:
      ``{"model", "block_tokens", "fingerprint", "templates": [{"tenant", "key",
      "tokens", "prefix_tokens", "count", "conversations", "saved_tokens"}]}``
      (``templatelog``). They are other users' prompt prefixes: only the gateway
      may read them (``X-Dscache-Gateway-Token`` = the gateway secret, else 401
      ``invalid_gateway_token``; no secret configured: 403
      ``templates_need_gateway_secret``).
    * ``GET /dscache/templates/filter?top=N``: every block key of those templates
      (all tenants) as a holdings-format Bloom filter
      (:class:`dscache_sidecar.holdings.HoldingsFilter`), for the picker: with an
      internal token configured, 401 ``invalid_internal_token`` without it (or the
      gateway token). Both answer 404 ``templates_off`` when mining is off, 400
      ``invalid_value`` for a bad ``top``, 503 ``not_ready`` until the model is
      loaded; both run on a worker thread (ranking and encoding take a while).
    * ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``:
      OpenAI's API; 503 ``not_ready`` until the model is loaded (``state``); with
      tenancy on, 401 ``invalid_api_key`` without a known key (``auth``). The
      probes and ``/metrics`` never ask for a key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from dscache_sidecar.holdings import INTERNAL_TOKEN_HEADER, KEYS_HEADER, HoldingsFilter
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dscache.routing import CONVERSATIONS_PATH, KEYINFO_PATH, SESSIONS_PATH, SessionLedger
from dscache_server.auth import DEFAULT_TENANT, GATEWAY_TOKEN_HEADER
from dscache_server.completions import handle_completion
from dscache_server.errors import APIError
from dscache_server.runtime import Runtime
from dscache_server.state import AppState, StateDep, authenticate
from dscache_server.templatelog import FILTER_PATH, MAX_TOP, TEMPLATES_PATH, TemplateLog

#: Templates listed when ``top`` is not given.
DEFAULT_TOP = 100
#: The ``top`` query parameter of the template routes.
TopQuery = Annotated[int, Query(ge=1, le=MAX_TOP, description="templates listed, best first")]

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


@probes.get(KEYINFO_PATH)
async def keyinfo(request: Request, state: StateDep) -> JSONResponse:
    """The key chain's facts for the router's picker (see the module contract)."""
    rt = state.runtime
    if rt is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    _internal_only(rt, request.headers, "the key info")
    root = None if rt.auth.tenancy else rt.chain_for(DEFAULT_TENANT).root.hex()
    return JSONResponse(
        {
            "model": rt.settings.model_name,
            "block_tokens": rt.fingerprint.block_tokens,
            "fingerprint": rt.fingerprint.digest().hex(),
            "root": root,
        }
    )


@probes.get(SESSIONS_PATH + "{session_id:path}")
async def session(session_id: str, request: Request, state: StateDep) -> JSONResponse:
    """Whether this pod served ``session_id`` (see the module contract)."""
    return _ledger_answer(state, state.sessions, session_id, request, "the session ledger")


@probes.get(CONVERSATIONS_PATH + "{key}")
async def conversation(key: str, request: Request, state: StateDep) -> JSONResponse:
    """Whether this pod served a chat request with these messages (the module contract)."""
    return _ledger_answer(state, state.conversations, key, request, "the conversation ledger")


def _ledger_answer(
    state: AppState, ledger: SessionLedger, key: str, request: Request, what: str
) -> JSONResponse:
    rt = state.runtime
    if rt is None:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "1"})
    _internal_only(rt, request.headers, what)
    age = ledger.age(key)
    if age is None:
        return JSONResponse({"inflight": state.inflight()}, status_code=404)
    return JSONResponse({"age_s": round(age, 3), "inflight": state.inflight()})


@probes.get(TEMPLATES_PATH)
def templates(
    request: Request, state: StateDep, top: TopQuery = DEFAULT_TOP, tenant: str | None = None
) -> JSONResponse:
    """The live templates, for the gateway only (see the module contract)."""
    rt, miner = _template_log(state)
    _gateway_only(rt, request.headers)
    return JSONResponse(
        {
            "model": rt.settings.model_name,
            "block_tokens": rt.fingerprint.block_tokens,
            "fingerprint": rt.fingerprint.digest().hex(),
            "templates": [t.to_dict() for t in miner.top(top, tenant)],
        }
    )


@probes.get(FILTER_PATH)
def templates_filter(request: Request, state: StateDep, top: TopQuery = DEFAULT_TOP) -> Response:
    """The block keys of the live templates as a holdings filter (see the module contract)."""
    rt, miner = _template_log(state)
    _internal_only(rt, request.headers, "the template filter")
    keys = miner.keys(top)
    bloom = HoldingsFilter.of(keys, capacity=max(len(keys), 1))
    return Response(
        bloom.to_bytes(),
        media_type="application/octet-stream",
        headers={KEYS_HEADER: str(len(keys))},
    )


def _gateway_only(rt: Runtime, headers: Mapping[str, str]) -> None:
    auth = rt.auth
    if not auth.has_gateway_secret:
        raise APIError(
            403,
            "the templates are other users' prompt prefixes: only the gateway may read them, "
            "and this server has no gateway secret (DSCACHE_SERVER_GATEWAY_SECRET)",
            type_="permission_error",
            code="templates_need_gateway_secret",
        )
    if not auth.is_gateway(headers):
        raise APIError(
            401,
            f"send the gateway secret as {GATEWAY_TOKEN_HEADER} to read the templates",
            code="invalid_gateway_token",
        )


def _internal_only(rt: Runtime, headers: Mapping[str, str], what: str) -> None:
    if rt.auth.has_internal_token and not rt.auth.is_internal(headers):
        raise APIError(
            401,
            f"{what} is for the router's picker: send the internal token as "
            f"{INTERNAL_TOKEN_HEADER}",
            code="invalid_internal_token",
        )


def _template_log(state: AppState) -> tuple[Runtime, TemplateLog]:
    rt = state.runtime
    if rt is None:
        raise APIError(
            503,
            state.load_error or "the server is loading",
            type_="service_unavailable",
            code="not_ready",
            retry_after=1,
        )
    if rt.templates is None:
        raise APIError(
            404,
            "live template mining is off on this server (--no-template-log)",
            code="templates_off",
        )
    return rt, rt.templates


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
