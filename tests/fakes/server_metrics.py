"""A fake model-server ``/metrics`` endpoint whose figures the test sets.

It speaks the real Prometheus text format with the real metric names of
``dscache_server`` (token hit/miss counters, the TTFT histogram), or, for a
revision set with ``engine="vllm"``, those of vLLM's own engine (prompt tokens,
the same by source, its TTFT histogram, with vLLM's ``model_name`` and
``engine`` labels; a vLLM-marked test checks the names on a real engine),
labelled as a ServiceMonitor with ``podTargetLabels`` would label them
(``namespace``, ``dscache_io_revision``). Counters are integrated over time from
the current rates, so they only ever grow, as real counters do, and a change of
figures shows in ``rate()`` from the next scrape on.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

from dscache import metricnames as names

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKENS_PER_S = 1000.0
REQUESTS_PER_S = 20.0


@dataclass
class Figures:
    """What one revision currently reports."""

    hit_rate: float
    ttft_s: float
    traffic: float = 1.0  # share of the nominal request rate; 0 = idle (counters stop)
    engine: Literal["reference", "vllm"] = "reference"


@dataclass
class _Series:
    figures: Figures
    last: float
    hits: float = 0.0
    misses: float = 0.0
    requests: float = 0.0
    ttft_sum: float = 0.0
    buckets: tuple[float, ...] = tuple(0.0 for _ in BUCKETS)


#: vLLM's family names (its text exposition adds ``_total`` and ``_bucket``).
VLLM_BY_SOURCE = names.VLLM_PROMPT_TOKENS_BY_SOURCE_SERIES.removesuffix("_total")
VLLM_TTFT = names.VLLM_TTFT_BUCKET_SERIES.removesuffix("_bucket")
#: Share of a vLLM revision's cached tokens from its own prefix cache (the rest: dscache).
VLLM_LOCAL_SHARE = 0.6


def _histogram(family: str, s: _Series, lbl: str) -> list[str]:
    lines = [
        f'{family}_bucket{{le="{le}",{lbl}}} {count}'
        for le, count in zip(BUCKETS, s.buckets, strict=True)
    ]
    lines.append(f'{family}_bucket{{le="+Inf",{lbl}}} {s.requests}')
    lines.append(f"{family}_sum{{{lbl}}} {s.ttft_sum}")
    lines.append(f"{family}_count{{{lbl}}} {s.requests}")
    return lines


def _server_lines(s: _Series, lbl: str) -> list[str]:
    tokens, src = names.PROMPT_TOKENS_SERIES, names.SOURCE_LABEL
    return [
        f'{tokens}{{{src}="{names.SOURCE_REUSED}",{lbl}}} {s.hits}',
        f'{tokens}{{{src}="{names.SOURCE_RECOMPUTED}",{lbl}}} {s.misses}',
        *_histogram(names.TTFT_SECONDS, s, lbl),
    ]


def _vllm_lines(s: _Series, lbl: str) -> list[str]:
    by_source = names.VLLM_PROMPT_TOKENS_BY_SOURCE_SERIES
    local, external = names.VLLM_CACHED_SOURCES
    counts = {
        local: s.hits * VLLM_LOCAL_SHARE,
        external: s.hits * (1.0 - VLLM_LOCAL_SHARE),
        names.VLLM_SOURCE_COMPUTED: s.misses,
    }
    return [
        f"{names.VLLM_PROMPT_TOKENS_SERIES}{{{lbl}}} {s.hits + s.misses}",
        *(f'{by_source}{{{lbl},source="{k}"}} {v}' for k, v in counts.items()),
        *_histogram(VLLM_TTFT, s, lbl),
    ]


class FakeServerMetrics:
    """``set(namespace, revision, Figures)``; ``remove(...)`` stops reporting it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str], _Series] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = owner.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def set(self, namespace: str, revision: str, figures: Figures) -> None:
        with self._lock:
            key = (namespace, revision)
            self._advance(time.monotonic())
            if key in self._series:
                self._series[key].figures = figures
            else:
                self._series[key] = _Series(figures=figures, last=time.monotonic())

    def remove(self, namespace: str, revision: str) -> None:
        with self._lock:
            self._series.pop((namespace, revision), None)

    def _advance(self, now: float) -> None:
        for s in self._series.values():
            dt = now - s.last
            s.last = now
            tokens = TOKENS_PER_S * dt * s.figures.traffic
            s.hits += tokens * s.figures.hit_rate
            s.misses += tokens * (1.0 - s.figures.hit_rate)
            n = REQUESTS_PER_S * dt * s.figures.traffic
            s.requests += n
            s.ttft_sum += n * s.figures.ttft_s
            s.buckets = tuple(
                b + (n if s.figures.ttft_s <= le else 0.0)
                for b, le in zip(s.buckets, BUCKETS, strict=True)
            )

    def render(self) -> str:
        with self._lock:
            self._advance(time.monotonic())
            lines = [
                f"# TYPE {names.PROMPT_TOKENS_SERIES.removesuffix('_total')} counter",
                f"# TYPE {names.TTFT_SECONDS} histogram",
                f"# TYPE {names.VLLM_PROMPT_TOKENS_SERIES.removesuffix('_total')} counter",
                f"# TYPE {VLLM_BY_SOURCE} counter",
                f"# TYPE {VLLM_TTFT} histogram",
            ]
            for (ns, rev), s in sorted(self._series.items()):
                lbl = f'namespace="{ns}",dscache_io_revision="{rev}"'
                if s.figures.engine == "vllm":
                    lines += _vllm_lines(s, f'{lbl},model_name="/models/tiny",engine="0"')
                else:
                    lines += _server_lines(s, lbl)
            return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
