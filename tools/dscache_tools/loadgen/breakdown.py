"""Where a request's time to first token goes: the per-phase breakdown of a run.

Contract:
    * The model server reports each request's phases in the ``timings`` object of its
      answer (``dscache.metricnames.PHASES`` on the request's path, plus ``ttft``,
      its own time to the first token, and ``first_text``, to the first text it sent).
    * The client's TTFT of a request splits exactly into: the server's path phases
      (``tokenize`` .. ``prefill``), ``until_text`` (decode steps before the first
      token that makes text: a partial UTF-8 character or a held-back stop string),
      ``server_other`` (what the server did between phases: reading the body,
      handing the request to the engine thread, sampling) and ``transport`` (HTTP,
      the router, SSE framing and the client's own reading). Each row's figures are
      over the requests that reported timings; ``share`` is its mean over the mean
      client TTFT.
    * ``floor`` is a request's least possible TTFT on this machine: the prefill of its
      uncached tail plus one decode step, as measured in the same request;
      ``ttft_over_floor_p50`` is the run's TTFT P50 over the floor's P50.
    * ``store`` runs in the background, off the request's path: its mean and count
      come from the servers' ``dscache_server_request_phase_seconds`` histograms
      (deltas over the run), since no answer can wait for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dscache import metricnames as names

#: The phases of the request's path, in order, as the server reports them.
PATH_PHASES = ("tokenize", "queue", "lookup", "lease", "map_verify", "prefill")
#: Rows of the breakdown that sum to the client's TTFT, in order.
TTFT_ROWS = (*PATH_PHASES, "until_text", "server_other", "transport")


def phase_series(phase: str, suffix: str) -> str:
    """The exposition key of one phase histogram's ``_sum`` or ``_count`` series."""
    return f'{names.REQUEST_PHASE_SECONDS}_{suffix}{{{names.PHASE_LABEL}="{phase}"}}'


def _stats(values: Sequence[float], ttft_mean: float) -> dict[str, float | None]:
    if not values:
        return {"mean_s": None, "p50_s": None, "p99_s": None, "share": None}
    mean = float(np.mean(values))
    return {
        "mean_s": mean,
        "p50_s": float(np.percentile(values, 50)),
        "p99_s": float(np.percentile(values, 99)),
        "share": mean / ttft_mean if ttft_mean > 0 else None,
    }


def _split(client_ttft: float, t: Mapping[str, float]) -> dict[str, float]:
    """One request's TTFT as the rows of :data:`TTFT_ROWS` (they sum to it)."""
    row = {phase: t.get(phase, 0.0) for phase in PATH_PHASES}
    server_ttft = t.get("ttft", 0.0)
    first_text = t.get("first_text", server_ttft)
    row["until_text"] = max(first_text - server_ttft, 0.0)
    row["server_other"] = max(server_ttft - sum(row[p] for p in PATH_PHASES), 0.0)
    row["transport"] = client_ttft - sum(row.values())
    return row


def breakdown(
    results: Sequence[tuple[float, Mapping[str, float]]], delta: Mapping[str, float]
) -> dict[str, Any]:
    """The breakdown of a run.

    Args:
        results: (client TTFT seconds, the server's ``timings``) of each successful
            request that reported timings.
        delta: counter deltas of the servers over the run (the ``store`` histogram's
            ``_sum`` and ``_count`` series among them).
    """
    rows = [_split(ttft, t) for ttft, t in results]
    ttfts = [ttft for ttft, _ in results]
    ttft_mean = float(np.mean(ttfts)) if ttfts else 0.0
    out: dict[str, Any] = {"requests": len(rows)}
    out["phases"] = {name: _stats([r[name] for r in rows], ttft_mean) for name in TTFT_ROWS}
    out["phases"]["ttft"] = _stats(ttfts, ttft_mean)
    decode = [t["first_decode"] for _, t in results if "first_decode" in t]
    out["phases"]["first_decode"] = _stats(decode, ttft_mean)
    floors = [t.get("prefill", 0.0) + t.get("first_decode", 0.0) for _, t in results]
    out["phases"]["floor"] = _stats(floors, ttft_mean)
    floor_p50 = out["phases"]["floor"]["p50_s"]
    ttft_p50 = out["phases"]["ttft"]["p50_s"]
    out["ttft_over_floor_p50"] = ttft_p50 / floor_p50 if ttft_p50 and floor_p50 else None
    count = delta.get(phase_series("store", "count"), 0.0)
    total = delta.get(phase_series("store", "sum"), 0.0)
    out["store"] = {"count": int(count), "mean_s": total / count if count else None}
    return out


_LABELS = {
    "tokenize": "tokenize (JSON, chat template)",
    "queue": "queue (waiting for the engine)",
    "lookup": "lookup (block keys + index)",
    "lease": "lease (sidecar RPC)",
    "map_verify": "map + verify",
    "prefill": "prefill of the uncached tail",
    "until_text": "decode until the first text",
    "server_other": "server, other",
    "transport": "HTTP, router, SSE",
    "ttft": "= TTFT (client)",
    "first_decode": "first decode step",
    "floor": "floor: prefill + one decode step",
}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_breakdown(runs: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table: mean ms (and share of TTFT) of each phase, one column per run."""
    cols = [name for name, b in runs.items() if b.get("requests")]
    if not cols:
        return "no request reported its timings"
    lines = [
        "| phase (mean ms, share of TTFT) | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for key in (*TTFT_ROWS, "ttft", "first_decode", "floor"):
        cells = []
        for c in cols:
            st = runs[c]["phases"][key]
            share = st["share"]
            tail = f" ({share:.0%})" if share is not None and key in TTFT_ROWS else ""
            cells.append(_ms(st["mean_s"]) + tail)
        lines.append(f"| {_LABELS[key]} | " + " | ".join(cells) + " |")
    lines.append(
        "| TTFT P50 / floor P50 | "
        + " | ".join(
            "-" if (v := runs[c]["ttft_over_floor_p50"]) is None else f"{v:.2f}x" for c in cols
        )
        + " |"
    )
    lines.append(
        "| store, in the background (mean ms, jobs) | "
        + " | ".join(
            f"{_ms(runs[c]['store']['mean_s'])} ({runs[c]['store']['count']})" for c in cols
        )
        + " |"
    )
    return "\n".join(lines)
