"""A minimal HTTPS JSON client for the dev cluster's own start-up checks.

Contract:
    * Only what ``up`` needs to create nodes and decide readiness: GET and
      POST of JSON with the admin client certificate, verified against the
      cluster CA. It is not a Kubernetes client library; tests and users use
      kubectl, helm or the ``kubernetes`` package.
    * Network errors and HTTP errors come back as a status code (0 for "no
      answer"), never as exceptions, so polling loops stay simple.
"""

from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Response:
    """Status (0 when the server did not answer) and the decoded JSON body, if any."""

    status: int
    body: Any


class ApiClient:
    """Talks to one HTTPS endpoint on a local address.

    Args:
        port: TCP port on ``host``.
        ca_cert: CA to verify the server with; ``None`` skips verification
            (used only for the self-signed health endpoints of the controller
            manager and scheduler).
        client_cert: Client certificate and key, or ``None``.
        timeout: Seconds per request.
        host: A local address: loopback, or the node bridge with real nodes.
    """

    def __init__(
        self,
        port: int,
        ca_cert: Path | None,
        client_cert: tuple[Path, Path] | None = None,
        timeout: float = 5.0,
        host: str = "127.0.0.1",
    ) -> None:
        self._host = host
        self._port = port
        self._timeout = timeout
        if ca_cert is None:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=str(ca_cert))
        if client_cert is not None:
            context.load_cert_chain(str(client_cert[0]), str(client_cert[1]))
        self._context = context

    def request(self, method: str, path: str, body: object | None = None) -> Response:
        """Sends one request; never raises for network or HTTP errors."""
        conn = http.client.HTTPSConnection(
            self._host, self._port, context=self._context, timeout=self._timeout
        )
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {"Accept": "application/json"}
            if payload is not None:
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=payload, headers=headers)
            reply = conn.getresponse()
            raw = reply.read()
        except (OSError, http.client.HTTPException):
            return Response(0, None)
        finally:
            conn.close()
        try:
            decoded: Any = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode(errors="replace")
        return Response(reply.status, decoded)

    def get(self, path: str) -> Response:
        """GET ``path``."""
        return self.request("GET", path)

    def delete(self, path: str) -> Response:
        """DELETE ``path``."""
        return self.request("DELETE", path)

    def post(self, path: str, body: object) -> Response:
        """POST ``body`` as JSON to ``path``."""
        return self.request("POST", path, body)
