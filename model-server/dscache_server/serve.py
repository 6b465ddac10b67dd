"""``dscache server``: load the model, calibrate, serve HTTP until SIGTERM.

uvicorn starts first and the model loads in the background, so ``/health``
answers at once and ``/ready`` turns 200 when the model is loaded and calibrated.
SIGTERM makes uvicorn stop accepting, finish in-flight requests and exit;
pending background stores are flushed on the way out.
"""

from __future__ import annotations

import argparse
import logging

from dscache_server.config import ServerSettings, settings_from_args

log = logging.getLogger(__name__)


def serve(settings: ServerSettings) -> int:
    """Runs the server in the foreground; returns the exit code."""
    import uvicorn

    from dscache_server.app import create_app
    from dscache_server.metrics import ServerMetrics
    from dscache_server.runtime import build_runtime

    metrics = ServerMetrics()
    app = create_app(loader=lambda: build_runtime(settings, metrics))
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=30,
    )
    server = uvicorn.Server(config)
    if not settings.internal_token.get_secret_value():
        log.warning(
            "/dscache/keyinfo and /dscache/templates/filter are served without a token (no "
            "DSCACHE_SERVER_INTERNAL_TOKEN): whoever reaches port %d can compute and test "
            "block keys of the anonymous tenant",
            settings.port,
        )
    log.info("serving %s on %s:%d", settings.model, settings.host, settings.port)
    server.run()
    return 0


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``dscache server``."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        log.error("invalid settings: %s", exc)
        return 2
    return serve(settings)
