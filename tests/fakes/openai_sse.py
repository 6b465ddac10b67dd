"""A fake OpenAI-compatible chat server for load-generator tests.

It streams SSE like ``dscache server`` (an opening role-only chunk, content chunks,
a finish chunk, a usage chunk, ``[DONE]``) after fixed delays, records what each
request carried, always answers with a ``Set-Cookie`` (so a client that kept
cookies would be caught), and serves ``/metrics`` with the server's counter names.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dscache import metricnames as names

#: What the fake answers every request (in two chunks).
ANSWER = "Revenue grew."


@dataclass
class Seen:
    """One request as the fake received it (it answers every one ``ANSWER``)."""

    session: str | None  # X-Session-ID header
    cookie: str | None
    user_text: str
    n_messages: int
    start: float
    end: float = 0.0
    answers: list[str] = field(default_factory=list)  # the history's assistant messages
    sampling: tuple[Any, Any] = (None, None)  # the body's temperature and seed


@dataclass
class FakeChatServer:
    """Threaded HTTP server on a free loopback port.

    Attributes:
        first_token_delay_s: wait before the first content chunk.
        rest_delay_s: wait between the first content chunk and the end.
        fail_when: requests whose last user message contains this get HTTP 500.
        cached_share: share of prompt tokens reported as cached (usage + /metrics).
        store_s: seconds each request's background store took (the store phase histogram).
    """

    first_token_delay_s: float = 0.05
    rest_delay_s: float = 0.05
    fail_when: str | None = None
    cached_share: float = 0.5
    store_s: float = 0.004  # each request's background store, in /metrics
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    reused: float = 0.0
    recomputed: float = 0.0

    def __post_init__(self) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                with fake.lock:
                    series = f"{names.PROMPT_TOKENS_SERIES}{{{names.SOURCE_LABEL}="
                    phase = f"{names.REQUEST_PHASE_SECONDS}"
                    store = f'{{{names.PHASE_LABEL}="store"}}'
                    body = (
                        f"# TYPE {names.PROMPT_TOKENS} counter\n"
                        f'{series}"{names.SOURCE_REUSED}"}} {fake.reused}\n'
                        f'{series}"{names.SOURCE_RECOMPUTED}"}} {fake.recomputed}\n'
                        f"# TYPE {phase} histogram\n"
                        f"{phase}_sum{store} {fake.store_s * len(fake.seen)}\n"
                        f"{phase}_count{store} {len(fake.seen)}\n"
                    ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                body = json.loads(raw)
                msgs = body["messages"]
                user = [m["content"] for m in msgs if m["role"] == "user"][-1]
                rec = Seen(
                    session=self.headers.get("X-Session-ID"),
                    cookie=self.headers.get("Cookie"),
                    user_text=user,
                    n_messages=len(msgs),
                    start=time.monotonic(),
                    answers=[m["content"] for m in msgs if m["role"] == "assistant"],
                    sampling=(body.get("temperature"), body.get("seed")),
                )
                with fake.lock:
                    fake.seen.append(rec)
                if fake.fail_when is not None and fake.fail_when in user:
                    payload = b'{"error": {"message": "boom"}}'
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    rec.end = time.monotonic()
                    return
                prompt = sum(len(m["content"]) for m in msgs)
                cached = int(prompt * fake.cached_share)
                with fake.lock:
                    fake.reused += cached
                    fake.recomputed += prompt - cached
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Set-Cookie", "dscache_session=from-fake; Path=/")
                self.send_header("Connection", "close")
                self.end_headers()

                def sse(obj: Any) -> None:
                    self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                    self.wfile.flush()

                def choice(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
                    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

                sse(choice({"role": "assistant", "content": ""}))
                time.sleep(fake.first_token_delay_s)
                head, tail = ANSWER.split(" ", 1)
                sse(choice({"content": head}))
                time.sleep(fake.rest_delay_s)
                sse(choice({"content": " " + tail}))
                sse(choice({}, "length"))
                usage = {
                    "prompt_tokens": prompt,
                    "completion_tokens": 2,
                    "total_tokens": prompt + 2,
                    "prompt_tokens_details": {"cached_tokens": cached},
                }
                # The server's timings extension: what it spent on this request.
                timings = {
                    "tokenize": 0.001,
                    "queue": 0.0,
                    "prefill": fake.first_token_delay_s,
                    "first_decode": fake.rest_delay_s,
                    "ttft": fake.first_token_delay_s + 0.001,
                    "first_text": fake.first_token_delay_s + 0.001,
                }
                sse({"choices": [], "usage": usage, "timings": timings})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                rec.end = time.monotonic()
                self.close_connection = True

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def close(self) -> None:
        """Stops serving."""
        self._httpd.shutdown()
        self._httpd.server_close()
