"""Benchmarks: each prints a table and writes JSON, every figure a ratio to a baseline
measured in the same run (``dscache bench store``, ``ttft``, ``balance``, ``vllm``).

:func:`report` is the ending the document-producing benches share: run, print the
table, write the JSON, and turn an expected failure into exit code 1; :func:`ratio`
is how each of them divides a figure by its baseline.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

Doc = dict[str, Any]


def ratio(new: float | None, base: float | None) -> float | None:
    """``new / base``, None where either is missing or the base is 0."""
    if new is None or base is None or base == 0:
        return None
    return new / base


def report(
    name: str,
    run: Callable[[], Doc],
    table: Callable[[Doc], str],
    json_out: str | None,
    failures: tuple[type[Exception], ...],
) -> int:
    """Runs a bench, prints its table and writes its JSON; 1 on one of ``failures``."""
    try:
        doc = run()
    except failures as exc:
        log.error("bench %s failed: %s", name, exc)
        return 1
    print(table(doc))
    if json_out:
        Path(json_out).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {json_out}")
    return 0
