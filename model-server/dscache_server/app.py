"""The OpenAI-compatible HTTP API: ``create_app`` puts the pieces together.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /metrics``, ``GET /health`` (liveness),
``GET /ready`` (readiness: model loaded and not draining).

Where a request goes: ``routes`` (the paths) -> ``completions`` (session, counting,
the generation slot) -> ``parse`` (body -> ``GenerationRequest``, with ``schemas``)
-> ``Runtime.generate`` on a worker thread -> ``schemas.completion_body`` or
``streaming`` (server-sent events). Per-app state is ``state.AppState``.

Contract:
    * Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``:
      400 for malformed JSON, bad parameters and prompts over the context; 404 for an
      unknown model; 413 for a body over ``max_request_bytes``; 429 with Retry-After
      when the queue is full; 503 with Retry-After while loading or draining. A bug
      is a 500 in the same shape; nothing takes the process down (``errors``).
    * ``usage.prompt_tokens_details.cached_tokens`` is the number of prompt tokens
      restored from the cache for this request.
    * The session header (``X-Session-ID``) is read, logged and echoed; the tenant
      comes from authentication (``auth``): the API-key file's tenant of the bearer
      key (401 for none or an unknown one), else the hashed key, else ``default``;
      a tenant header counts only with the gateway token (else 401).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI

from dscache_server.errors import install_error_handlers
from dscache_server.routes import openai_api, probes
from dscache_server.runtime import Runtime
from dscache_server.state import AppState


def create_app(
    runtime: Runtime | None = None,
    *,
    loader: Callable[[], Runtime] | None = None,
) -> FastAPI:
    """The FastAPI app; give a built ``runtime``, or a ``loader`` run at start-up.

    With a loader the app answers /health at once and /ready (and completions, with
    503) only once the loader has finished, so an orchestrator can probe it while the
    model loads. A runtime the app loaded itself is closed when the app stops.
    """
    state = AppState(runtime=runtime, loader=loader)
    app = FastAPI(title="dscache model server", lifespan=state.lifespan)
    app.state.dscache = state
    install_error_handlers(app)
    app.include_router(probes)
    app.include_router(openai_api)
    return app
