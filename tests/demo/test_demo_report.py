"""``dscache demo`` without a stack: its workload, its report's routing rows, its CLI checks.

The passes themselves run in ``test_demo_quick.py`` (slow); here the report is
assembled from pass results built by hand, as the demo assembles the real ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from dscache_tools import democli
from dscache_tools.demo import run
from dscache_tools.demo.run import (
    DemoOptions,
    PassResult,
    assemble_result,
    load_workload,
)
from dscache_tools.demo.run_report import format_table, write_png
from dscache_tools.loadgen.report import LoadReport, RequestResult
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    prewarm_requests,
    sessions_of,
    write_jsonl,
)

IDEAL = 0.9


def _pass(name: str, hit: float | None, *, ttft: float = 0.5) -> PassResult:
    results = [
        RequestResult(session="s", turn=t, session_id=None, ok=True, status=200,
                      started_s=float(t), ttft_s=ttft, e2e_s=2 * ttft)
        for t in range(3)
    ]  # fmt: skip
    report = LoadReport(
        target="http://127.0.0.1:1", concurrency=4, requests=3, ok=3, errors=0,
        duration_s=3.0, qps=1.0 / ttft, ttft_p50_s=ttft, ttft_p95_s=ttft, ttft_p99_s=ttft,
        e2e_p50_s=2 * ttft, e2e_p95_s=2 * ttft, e2e_p99_s=2 * ttft, prompt_tokens=3000,
        cached_tokens=0, client_token_hit_ratio=hit, token_hit_ratio=hit,
        block_hit_ratio=hit, session_hit_ratio=hit,
        recomputed_share=None if hit is None else 1 - hit, results=results,
    )  # fmt: skip
    return PassResult(name, report, startup_s=10.0, load_avg=1.0)


def _result(**hits: float) -> dict[str, Any]:
    passes = {"cache_off": _pass("cache off", None, ttft=0.5)}
    passes |= {key: _pass(key, hit, ttft=0.1) for key, hit in hits.items()}
    return assemble_result(
        passes, ideal_token_hit_ratio=IDEAL, workload={}, settings={}, wall_s=60.0
    )


def test_routing_lists_every_cache_on_pass_by_mode() -> None:
    result = _result(cache_on=0.8, cache_on_kv=0.88, cache_on_no_prompt_key=0.6)
    assert result["routing"] == [
        {"name": "hash", "token_hit_ratio": 0.8},
        {"name": "kv", "token_hit_ratio": 0.88},
        {"name": "hash-no-prompt-key", "token_hit_ratio": 0.6},
    ]
    assert result["ideal_token_hit_ratio"] == IDEAL
    assert result["cache_off"]["token_hit_ratio"] == 0.0
    assert json.loads(json.dumps(result)) == result  # what --json writes
    kv = result["targets"]["kv_routing_hit_vs_ideal"]
    assert kv["value"] == pytest.approx(0.88 / IDEAL)
    assert kv["met"] is True
    assert result["targets"]["hit_vs_ideal"]["met"] is False  # hash: 0.8 / 0.9


def test_a_run_without_kv_has_only_the_hash_row() -> None:
    result = _result(cache_on=0.85)
    assert result["routing"] == [{"name": "hash", "token_hit_ratio": 0.85}]
    assert "kv_routing_hit_vs_ideal" not in result["targets"]
    assert "kv routing" not in format_table(result)


def test_kv_below_95_percent_of_the_ideal_is_reported_missed() -> None:
    result = _result(cache_on=0.88, cache_on_kv=0.5)
    assert result["targets"]["kv_routing_hit_vs_ideal"]["met"] is False
    assert "target kv_routing_hit_vs_ideal: 0.556 (goal >= 0.95) MISSED" in format_table(result)


def test_table_shows_the_kv_pass_and_the_routing_rows() -> None:
    text = format_table(_result(cache_on=0.8, cache_on_kv=0.88))
    lines = text.splitlines()
    assert lines[0] == "| | cache off | cache on | cache on, kv routing | on / off |"
    assert "| token hit ratio | 0.000 | 0.800 | 0.880 |  |" in lines
    assert "| hash | 0.800 | 89% |" in lines
    assert "| kv | 0.880 | 98% |" in lines


@pytest.mark.slow
def test_png_draws_the_kv_pass(tmp_path: Path) -> None:
    png = tmp_path / "demo.png"
    write_png(_result(cache_on=0.8, cache_on_kv=0.88, cache_on_no_prompt_key=0.6), png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_standard_sample_is_the_generated_finance_workload() -> None:
    workload = load_workload(DemoOptions(quick=True))
    expected = generate(
        WorkloadConfig(sessions=8, companies=3, max_tokens=8, min_turns=3, max_turns=8)
    )
    assert workload.requests == expected
    assert workload.warm == prewarm_requests(expected)
    assert workload.file is None


def test_the_varied_sample_opens_every_session_differently() -> None:
    workload = load_workload(DemoOptions(quick=True, workload_variant="varied"))
    firsts = [t[0].messages[0]["content"] for t in sessions_of(workload.requests).values()]
    assert len(firsts) == 8
    assert len(set(firsts)) == 8


def test_a_workload_file_replays_as_written_with_its_prewarm(tmp_path: Path) -> None:
    requests = generate(WorkloadConfig(sessions=5, seed=2, companies=2, variant="varied"))
    path = tmp_path / "w.jsonl"
    write_jsonl(requests, path)
    workload = load_workload(DemoOptions(workload_file=path, seed=99, sessions=1))
    assert workload.requests == requests  # the sample's knobs do not apply
    assert workload.warm == prewarm_requests(requests)
    assert workload.file == path
    assert workload.prewarm_note.startswith("prewarm: the system messages of 2 companies")
    cold = load_workload(DemoOptions(workload_file=path, prewarm=False))
    assert (cold.warm, cold.prewarm_note) == ([], "no prewarm (--no-prewarm)")


def test_a_file_without_system_messages_gets_no_prewarm(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    write_jsonl(
        [
            ChatRequest(session="a", turn=0, company="X", lang="en", session_id="1",
                        reconnected=False, messages=[{"role": "user", "content": "hi"}])
        ],
        path,
    )  # fmt: skip
    workload = load_workload(DemoOptions(workload_file=path))
    assert workload.warm == []
    assert workload.prewarm_note.startswith("no prewarm: the requests carry no system messages")


def _demo_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    democli.register(sub, sub)
    return parser.parse_args(["demo", *argv])


def _never(*args: object, **kwargs: object) -> Any:
    raise AssertionError("started something for a workload it could not read")


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("{}\n", ":1: not a workload request: missing key 'session'"),
        (None, ":2: not a workload request"),
        ("\n", ": no requests"),
    ],
)
def test_demo_refuses_a_bad_workload_file_before_starting_anything(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    where: str,
) -> None:
    path = tmp_path / "w.jsonl"
    if content is None:  # a good line, then a truncated one
        line = generate(WorkloadConfig(sessions=1))[0].to_json()
        content = f"{line}\n{line[: len(line) // 2]}\n"
    path.write_text(content)
    monkeypatch.setattr(run, "LocalStack", _never)
    monkeypatch.setattr(run, "load_server_tokenizer", _never)
    args = _demo_args("--workload", str(path))
    assert args.handler(args) == 2
    assert f"dscache demo: error: {path}{where}" in capsys.readouterr().err


def test_demo_refuses_a_missing_workload_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run, "LocalStack", _never)
    args = _demo_args("--workload", str(tmp_path / "nope.jsonl"))
    assert args.handler(args) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_demo_options_from_the_command_line() -> None:
    args = _demo_args("--quick", "--workload-variant", "varied")
    assert (args.workload_variant, args.routing, args.workload_file) == (
        "varied",
        ("hash", "kv"),
        None,
    )
    assert _demo_args("--routing", "hash").routing == ("hash",)
    assert _demo_args("--routing", "kv,hash").routing == ("kv", "hash")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--routing", "kv"], "must include it"),
        (["--routing", "hash,lru"], "unknown routing mode 'lru'"),
        (["--routing", "hash,hash"], "named twice"),
        (["--workload", "f.jsonl", "--workload-variant", "varied"], "not allowed with"),
    ],
)
def test_demo_rejects_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _demo_args(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
