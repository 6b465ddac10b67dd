"""What ``dscache chaos`` prints and writes.

Contract:
    * ``ChaosReport.to_dict()`` is the ``--json`` document: ``cases`` is a list of
      ``{name, requests, failed, ttft_p99_s, ttft_p99_ratio, ttft_p50_s, fault,
      method, fallbacks, retries, load_avg, notes, error_kinds}``; ``ttft_kind`` says what
      TTFT means here (the time to the whole, non-streamed answer).
    * ``ttft_p99_ratio`` is a case's p99 over the baseline's (None without one).
    * A counter that could not be read (no router metrics yet) is null, not 0.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class CaseResult:
    """One case as the clients and the counters saw it."""

    name: str
    fault: str
    requests: int
    failed: int
    ttft_p99_s: float | None
    ttft_p50_s: float | None
    duration_s: float
    method: str | None = None
    fallbacks: float | None = None
    retries: float | None = None
    ttft_p99_ratio: float | None = None
    load_avg: float | None = None  # the machine's 1-minute load average after the case
    notes: list[str] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)


@dataclass
class ChaosReport:
    """Every case of one run, and how it ran."""

    model: str
    concurrency: int
    requests_per_case: int
    ttft_kind: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def failed(self) -> int:
        """Failed requests over every case."""
        return sum(c.failed for c in self.cases)

    def add(self, case: CaseResult) -> None:
        """Appends ``case``, with its ratio to the baseline when there is one."""
        base = next((c for c in self.cases if c.name == "baseline"), None)
        if base is not None and base.ttft_p99_s and case.ttft_p99_s is not None:
            case.ttft_p99_ratio = case.ttft_p99_s / base.ttft_p99_s
        elif case.name == "baseline" and case.ttft_p99_s:
            case.ttft_p99_ratio = 1.0
        self.cases.append(case)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document."""
        return asdict(self) | {"failed": self.failed}


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _notes(c: CaseResult) -> str:
    parts = list(c.notes)
    if c.method:
        parts.append(f"method {c.method}")
    if c.fallbacks:
        parts.append(f"{c.fallbacks:.0f} cache fallbacks")
    if c.retries:
        parts.append(f"{c.retries:.0f} router retries")
    parts += [f"{kind} x{n}" for kind, n in sorted(c.error_kinds.items())]
    return "; ".join(p for p in parts if p)


def format_table(r: ChaosReport) -> str:
    """The Markdown table ``dscache chaos`` prints (and the README shows)."""
    lines = [
        f"model {r.model}, concurrency {r.concurrency}, {r.requests_per_case} requests per "
        f"case; TTFT = {r.ttft_kind}",
        "",
        "| case | requests | failed | p99 TTFT s | ratio to baseline | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for c in r.cases:
        lines.append(
            f"| {c.name} | {c.requests} | {c.failed} | {_num(c.ttft_p99_s, '.2f')} | "
            f"{_num(c.ttft_p99_ratio, '.2f')} | {_notes(c)} |"
        )
    return "\n".join(lines)


def write_json(report: ChaosReport, path: Path) -> None:
    """Writes the JSON document to ``path``."""
    path.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
