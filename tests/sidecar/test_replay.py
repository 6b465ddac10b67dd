"""``dscache replay``: prefix semantics, cascades, the bounds and the CLI."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path
from typing import Any

import pytest
from dscache_sidecar.eviction import DEFAULT_POLICY, POLICIES, make_policy
from dscache_tools.replay import (
    Request,
    Trace,
    build_trace,
    load_trace,
    run_cli,
    simulate,
    simulate_belady,
    simulate_ideal,
)
from dscache_tools.replay.signals import continues, derive
from dscache_tools.replay.simulate import TraceClock

REPO = Path(__file__).resolve().parents[2]
MOONCAKE = REPO / "tests" / "data" / "traces" / "mooncake" / "mooncake_conversation_trace.jsonl"


def write_mooncake(path: Path, requests: list[tuple[int, list[int]]]) -> Path:
    with path.open("w") as f:
        for input_length, hash_ids in requests:
            record = {
                "timestamp": 0,
                "input_length": input_length,
                "output_length": 1,
                "hash_ids": hash_ids,
            }
            f.write(json.dumps(record) + "\n")
    return path


def cli_args(trace: Path, **overrides: Any) -> argparse.Namespace:
    values: dict[str, Any] = {
        "trace": str(trace),
        "capacity_blocks": "16384",
        "policy": None,
        "json_out": None,
        "png_out": None,
        "no_belady": False,
        "signals": "",
        "signal_coverage": 1.0,
        "queue_s": 2.0,
        "sessions": 0,
        "block_tokens": 16,
        "arrivals": "poisson",
        "seed": 0,
    }
    values.update(overrides)
    return argparse.Namespace(**values)


def test_ideal_counts_prefix_hits_and_the_partial_last_block(tmp_path: Path) -> None:
    trace = load_trace(
        write_mooncake(
            tmp_path / "t.jsonl",
            [
                (1100, [1, 2, 3]),  # 512 + 512 + 76 tokens
                (1536, [1, 2, 4]),  # hits 1, 2
                (600, [1, 5]),  # hits 1
                (1100, [1, 2, 3]),  # hits all three, the last one partial
                (1024, [9, 2]),  # block 2 is cached but its prefix is not: no hit
            ],
        )
    )
    ideal = simulate_ideal(trace)
    assert ideal.hit_blocks == 2 + 1 + 3
    assert ideal.hit_tokens == 1024 + 512 + 1100
    assert ideal.block_hit_ratio == pytest.approx(6 / 13)
    assert ideal.token_hit_ratio == pytest.approx(2636 / (1100 + 1536 + 600 + 1100 + 1024))
    # With room for everything, every policy and Belady reach the ideal.
    for name in POLICIES:
        assert simulate(trace, make_policy(name, 100), 100) == ideal
    belady = simulate_belady(trace, 100)
    assert (belady.hit_blocks, belady.hit_tokens) == (ideal.hit_blocks, ideal.hit_tokens)


def full(blocks: list[int]) -> tuple[int, list[int]]:
    return 512 * len(blocks), blocks


def test_lru_at_small_capacity_by_hand(tmp_path: Path) -> None:
    trace = load_trace(
        write_mooncake(
            tmp_path / "t.jsonl", [full([1, 2, 3]), full([1, 4]), full([1, 2, 3]), full([1, 4])]
        )
    )
    r = simulate(trace, make_policy("lru", 3), 3)
    # r2 evicts 3 (deepest, touched first); r3 hits 1, 2 and evicts 4; r4 hits 1.
    assert r.hit_blocks == 1 + 2 + 1
    assert r.token_hit_ratio == pytest.approx(2048 / 5120)
    assert r.cascaded == 0


def test_evicting_a_parent_cascades_to_its_cached_children(tmp_path: Path) -> None:
    trace = load_trace(
        write_mooncake(
            tmp_path / "t.jsonl", [full([1, 2, 3]), full([4, 5]), full([1, 6]), full([1, 6])]
        )
    )
    # FIFO ignores hits, so it evicts root 1 right after its new child 6 arrived.
    r = simulate(trace, make_policy("fifo", 3), 3)
    assert r.cascaded == 1  # block 6 went with its parent
    assert r.hit_blocks == 1  # r3 hit 1; r4 hits nothing: its root is gone
    assert r.block_hit_ratio == pytest.approx(1 / 9)


def test_belady_by_hand(tmp_path: Path) -> None:
    trace = load_trace(
        write_mooncake(tmp_path / "t.jsonl", [full([1, 2]), full([3]), full([1, 2]), full([3])])
    )
    # Block 3's next use is further away than 1's and 2's: it is not stored.
    assert simulate_belady(trace, 2).hit_blocks == 2
    assert simulate(trace, make_policy("lru", 2), 2).hit_blocks == 1


def test_dscache_request_log(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    record = {"block_keys": ["aa", "bb", "cc", "dd"], "prompt_tokens": 1100, "block_tokens": 256}
    other = {"block_keys": ["aa", "ee"], "prompt_tokens": 600, "block_tokens": 256}
    path.write_text("\n".join(json.dumps(r) for r in (record, record, other)) + "\n")
    ideal = simulate_ideal(load_trace(path))
    assert ideal.hit_tokens == 4 * 256 + 256  # tokens past the last full block never hit
    assert ideal.token_hit_ratio == pytest.approx(1280 / 2800)
    assert ideal.block_hit_ratio == pytest.approx(5 / 10)


def random_trace(seed: int, n_requests: int = 300) -> Trace:
    """Conversations: each request extends or re-asks a random earlier prompt."""
    rng = random.Random(seed)
    ids: dict[tuple[int, ...], int] = {}
    counter = itertools.count()
    prompts: list[tuple[int, ...]] = []
    requests: list[Request] = []
    for _ in range(n_requests):
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts[-40:])
            path = base[: rng.randint(0, len(base))] + tuple(
                next(counter) for _ in range(rng.randint(0, 4))
            )
        else:
            path = (0, *(next(counter) for _ in range(rng.randint(1, 6))))
        if not path:
            continue
        prompts.append(path)
        blocks = [ids.setdefault(path[: i + 1], len(ids)) for i in range(len(path))]
        requests.append(Request(blocks, 16, 16, 16 * len(blocks)))
    return build_trace(f"random-{seed}", requests)


@pytest.mark.parametrize("seed", range(12))
def test_belady_bounds_every_policy_and_the_ideal_bounds_belady(seed: int) -> None:
    trace = random_trace(seed)
    ideal = simulate_ideal(trace)
    for capacity in (4, 16, 48):
        belady = simulate_belady(trace, capacity)
        assert belady.hit_blocks <= ideal.hit_blocks
        for name in POLICIES:
            r = simulate(trace, make_policy(name, capacity), capacity)
            assert r.hit_blocks <= belady.hit_blocks, (name, capacity)
            assert r.token_hit_ratio <= belady.token_hit_ratio + 1e-12


def test_cli_errors_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(cli_args(tmp_path / "missing.jsonl")) == 2
    assert "cannot read trace" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_length": 10, "hash_ids": [1]}) + "\n{not json\n")
    assert run_cli(cli_args(bad)) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err

    wrong = write_mooncake(tmp_path / "wrong.jsonl", [(2000, [1, 2])])
    assert run_cli(cli_args(wrong)) == 2
    assert "expected ceil(2000/512) = 4" in capsys.readouterr().err

    good = write_mooncake(tmp_path / "good.jsonl", [full([1])])
    assert run_cli(cli_args(good, policy="lru,nope")) == 2
    assert "unknown nope" in capsys.readouterr().err
    assert run_cli(cli_args(good, capacity_blocks="0")) == 2
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_on_the_real_trace_writes_the_documented_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert MOONCAKE.exists(), f"the Mooncake trace is expected at {MOONCAKE}"
    head = tmp_path / "head.jsonl"
    with MOONCAKE.open() as src:
        head.write_text("".join(itertools.islice(src, 1500)))
    out, png = tmp_path / "replay.json", tmp_path / "replay.png"
    rc = run_cli(cli_args(head, capacity_blocks="512,2048", json_out=str(out), png_out=str(png)))
    assert rc == 0
    table = capsys.readouterr().out
    assert "of Belady" in table and "x LRU" in table

    data = json.loads(out.read_text())
    assert set(data) == {"trace", "requests", "results", "ideal", "belady"}
    assert data["requests"] == 1500
    assert {(r["policy"], r["capacity_blocks"]) for r in data["results"]} == {
        (p, c) for p in (DEFAULT_POLICY, "lru") for c in (512, 2048)
    }
    for r in data["results"]:
        assert set(r) == {
            "policy",
            "capacity_blocks",
            "token_hit_ratio",
            "block_hit_ratio",
            "signals",
        }
        assert r["signals"] == []
    assert set(data["ideal"]) == {"token_hit_ratio", "block_hit_ratio"}
    bound = {b["capacity_blocks"]: b for b in data["belady"]}
    assert set(bound) == {512, 2048}
    for r in data["results"]:
        assert 0 < r["token_hit_ratio"] <= bound[r["capacity_blocks"]]["token_hit_ratio"]
    for b in data["belady"]:
        assert b["token_hit_ratio"] <= data["ideal"]["token_hit_ratio"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_policy_all_runs_every_policy(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "t.jsonl", [full([1, 2]), full([1, 3]), full([1, 2])])
    out = tmp_path / "r.json"
    assert (
        run_cli(
            cli_args(trace, capacity_blocks="2", policy="all", json_out=str(out), no_belady=True)
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data["results"]] == list(POLICIES)
    assert data["belady"] == []


# -- the chain policy and signals in the replay


def timed_mooncake(path: Path, requests: list[tuple[int, int, list[int]]]) -> Path:
    """(timestamp ms, input_length, hash_ids) per request."""
    with path.open("w") as f:
        for stamp, input_length, hash_ids in requests:
            record = {
                "timestamp": stamp,
                "input_length": input_length,
                "output_length": 1,
                "hash_ids": hash_ids,
            }
            f.write(json.dumps(record) + "\n")
    return path


def test_request_times_and_conversations_are_read_from_the_trace(tmp_path: Path) -> None:
    trace = load_trace(
        timed_mooncake(
            tmp_path / "t.jsonl",
            [
                (0, 1100, [1, 2, 3]),  # conversation A: partial last block 3
                (500, 600, [9, 8]),  # B, never continued
                (1500, 1600, [1, 2, 4, 5]),  # A's next turn: resends up to block 2
                (9000, 2048, [1, 2, 4, 5]),  # A again, all full: the same prompt
            ],
        )
    )
    assert [r.time_s for r in trace.requests] == [0.0, 0.5, 1.5, 9.0]
    assert continues(trace) == [True, False, False, False]
    plan = derive(trace, ["ended", "expected", "queued"], queue_s=1.0)
    assert plan.after == ["expected", "ended", "ended", "ended"]
    # Within 1 s of request 0: request 1 is queued; of request 1: request 2.
    assert plan.before == [[1], [2], [], []]
    assert derive(trace, ["ended"], coverage=0.0).after == ["", "", "", ""]
    with pytest.raises(ValueError, match="unknown signal"):
        derive(trace, ["bye"])


def test_chain_policy_with_ended_signals_keeps_the_conversation_that_goes_on(
    tmp_path: Path,
) -> None:
    # Two conversations of 3 full blocks; the one that ended is written last, so
    # recency would keep it and lose the one that comes back.
    trace = load_trace(
        timed_mooncake(
            tmp_path / "t.jsonl",
            [
                (0, 1536, [1, 2, 3]),
                (1000, 1536, [7, 8, 9]),
                (60_000, 2048, [1, 2, 3, 4]),
            ],
        )
    )
    lru = simulate(trace, make_policy("lru", 4), 4)
    assert lru.hit_blocks == 1  # only its first block was left
    plan = derive(trace, ["ended"])
    clock = TraceClock()
    chain = simulate(trace, make_policy("chain", 4, clock), 4, clock=clock, signals=plan)
    assert chain.hit_blocks == 3
    clock = TraceClock()
    plain = simulate(trace, make_policy("chain", 4, clock), 4, clock=clock)
    assert plain.hit_blocks < 3  # without the signal it cannot know


@pytest.mark.slow
def test_cli_runs_the_chain_policy_beside_the_others_with_and_without_signals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert MOONCAKE.exists()
    head = tmp_path / "head.jsonl"
    with MOONCAKE.open() as src:
        head.write_text("".join(itertools.islice(src, 1500)))
    out = tmp_path / "r.json"
    args = cli_args(
        head, capacity_blocks="512,5%", policy="lru,chain", json_out=str(out), signals="ended"
    )
    assert run_cli(args) == 0
    table = capsys.readouterr().out
    assert "chain+signals" in table
    data = json.loads(out.read_text())
    distinct = len({b for r in load_trace(head).requests for b in r.blocks})
    caps = sorted({r["capacity_blocks"] for r in data["results"]})
    assert caps == sorted({512, distinct * 5 // 100})
    labels = {(r["policy"], tuple(r["signals"])) for r in data["results"]}
    assert labels == {("lru", ()), ("chain", ()), ("chain+signals", ("ended",))}
    by = {(r["policy"], r["capacity_blocks"]): r["token_hit_ratio"] for r in data["results"]}
    for cap in caps:
        assert by[("chain+signals", cap)] >= by[("lru", cap)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"capacity_blocks": "0%"}, "capacity-blocks"),
        ({"signals": "ended,bye"}, "unknown signal"),
        ({"signals": "ended", "signal_coverage": 1.5}, "coverage"),
    ],
)
def test_cli_refuses_bad_signal_and_capacity_arguments(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    overrides: dict[str, Any],
    message: str,
) -> None:
    trace = write_mooncake(tmp_path / "t.jsonl", [full([1, 2])])
    assert run_cli(cli_args(trace, **overrides)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_builtin_chat_trace_is_keyed_like_the_server_and_interleaved() -> None:
    from dscache_tools.replay.workloads import WorkloadTrace, build

    trace = build(WorkloadTrace("chat", sessions=40, block_tokens=16))
    again = build(WorkloadTrace("chat", sessions=40, block_tokens=16))
    assert [r.blocks for r in trace.requests] == [r.blocks for r in again.requests]
    times = [r.time_s for r in trace.requests]
    assert times == sorted(times)
    ideal = simulate_ideal(trace)
    assert 0.3 < ideal.token_hit_ratio < 1.0  # follow-ups reuse their history
    sequential = build(WorkloadTrace("chat", sessions=40, arrivals="sequential"))
    assert len(sequential.requests) == len(trace.requests)
