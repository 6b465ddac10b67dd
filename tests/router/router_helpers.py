"""What the router tests share: loopback upstream pods, one HTTP call, NGINX's life.

* :class:`Pod`: a loopback HTTP server standing in for a model pod; it answers
  every GET or POST with JSON naming itself and the session header it got.
* :func:`call`: one request to the router on loopback; the response, or None
  while nothing answers.
* :func:`wait_for`: polls (tenacity, via the dev cluster's ``wait_until``) and
  fails with the router's log when time runs out.
* :func:`stop`: ends a process, killing it when it does not stop in time.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import httpx
from dscache_tools.devcluster import wait_until

T = TypeVar("T")


class Pod(ThreadingHTTPServer):
    """A stand-in model pod on a loopback port; ``seen`` lists the session ids it got."""

    def __init__(self, name: str) -> None:
        seen: list[str] = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                sid = self.headers.get("X-Session-ID", "")
                seen.append(sid)
                body = json.dumps({"pod": name, "sid": sid}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = _answer  # noqa: N815 - the stdlib's handler names
            do_POST = _answer  # noqa: N815

            def log_message(self, format: str, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.name = name
        self.seen = seen
        self.address = f"127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()


def call(
    port: int,
    path: str,
    headers: dict[str, str] | None = None,
    *,
    method: str = "GET",
    body: bytes | None = None,
) -> httpx.Response | None:
    """``method path`` on ``127.0.0.1:port``; None while nothing answers."""
    try:
        return httpx.request(
            method, f"http://127.0.0.1:{port}{path}", headers=headers, content=body, timeout=10
        )
    except httpx.TransportError:
        return None


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, log: Path) -> T:
    """``probe``'s first truthy answer within ``timeout`` seconds; else fails with ``log``."""
    try:
        return wait_until(what, probe, timeout, 0.05)
    except TimeoutError as exc:
        text = log.read_text()[-3000:] if log.exists() else ""
        raise AssertionError(f"{exc}\n{text}") from exc


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGTERM) -> None:
    """Sends ``sig`` and waits; SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
