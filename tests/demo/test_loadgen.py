"""The load generator against a fake streaming server: ordering, ids, cookies, timing."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
from dscache_tools.loadgen import (
    LoadConfig,
    format_report,
    parse_counters,
    percentile,
    run_load,
    think_times,
)
from dscache_tools.loadgen.breakdown import format_breakdown
from dscache_tools.workload import ChatRequest, WorkloadConfig, generate
from fakes.openai_sse import ANSWER, FakeChatServer


@pytest.fixture
def fake() -> Iterator[FakeChatServer]:
    srv = FakeChatServer()
    yield srv
    srv.close()


def _workload(sessions: int = 6) -> list[ChatRequest]:
    return generate(
        WorkloadConfig(sessions=sessions, seed=3, min_turns=3, max_turns=4, companies=2)
    )


def _run(cfg: LoadConfig, workload: list[ChatRequest]):  # type: ignore[no-untyped-def]
    return asyncio.run(run_load(cfg, workload))


def test_turns_in_order_sessions_in_parallel(fake: FakeChatServer) -> None:
    workload = _workload()
    report = _run(LoadConfig(target=fake.url, concurrency=3, progress=False), workload)
    assert report.requests == len(workload) and report.errors == 0
    by_session: dict[str, int] = {}
    for r in workload:
        by_session[r.session] = by_session.get(r.session, 0) + 1
    results = {(r.session, r.turn): r for r in report.results}
    for session, n in by_session.items():
        for t in range(1, n):
            prev, cur = results[(session, t - 1)], results[(session, t)]
            assert cur.started_s >= prev.started_s + prev.e2e_s - 1e-6, (
                f"{session} turn {t} started before turn {t - 1} ended"
            )
    # The history grows turn by turn: the fake saw every length a session sends.
    assert sorted(s.n_messages for s in fake.seen) == sorted(len(r.messages) for r in workload)
    # With 3 workers, some requests overlap in time.
    spans = sorted((s.start, s.end) for s in fake.seen)
    overlaps = sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1])
    assert overlaps > 0


@pytest.mark.parametrize("answers", ["workload", "served"])
def test_a_chat_client_sends_back_the_answers_it_was_served(
    fake: FakeChatServer, answers: str
) -> None:
    workload = _workload(3)
    cfg = LoadConfig(target=fake.url, concurrency=3, progress=False, answers=answers)  # type: ignore[arg-type]
    assert _run(cfg, workload).errors == 0
    canned = {
        (len(r.messages), tuple(m["content"] for m in r.messages if m["role"] == "assistant"))
        for r in workload
    }
    later = [s for s in fake.seen if s.answers]
    assert later
    for s in later:
        if answers == "workload":
            assert (s.n_messages, tuple(s.answers)) in canned
        else:  # each turn's answer is the one the fake gave it, not the canned one
            assert s.answers[-1] == ANSWER


def test_each_turn_records_the_history_it_sent_and_the_one_it_left(fake: FakeChatServer) -> None:
    # What the Kubernetes demo tells a router's move from a move no router could avoid by.
    workload = _workload(4)
    cfg = LoadConfig(target=fake.url, concurrency=2, progress=False, answers="served")
    report = _run(cfg, workload)
    results = {(r.session, r.turn): r for r in report.results}
    for (session, turn), r in results.items():
        assert r.history_digest and r.left_digest
        if turn:  # the next turn's history is what the one before left on its pod
            assert r.history_digest == results[(session, turn - 1)].left_digest
        assert r.history_digest != r.left_digest
    firsts = {r.history_digest for (_, turn), r in results.items() if turn == 0}
    seconds = {r.history_digest for (_, turn), r in results.items() if turn == 1}
    assert not firsts & seconds


def test_spread_sends_each_turn_to_one_replica_seeded_by_session_and_turn() -> None:
    replicas = [FakeChatServer(), FakeChatServer()]
    try:
        workload = _workload(4)
        cfg = LoadConfig(
            target=replicas[0].url, spread=(replicas[1].url,), concurrency=2, progress=False
        )
        assert _run(cfg, workload).errors == 0
        seen = [len(r.seen) for r in replicas]
        assert sum(seen) == len(workload) and min(seen) > 0  # both replicas served
        expected = sum(cfg.url_for(r.session, r.turn).startswith(replicas[1].url) for r in workload)
        assert seen[1] == expected  # where each turn goes is a function of the turn
    finally:
        for r in replicas:
            r.close()


def test_answers_must_be_workload_or_served() -> None:
    with pytest.raises(ValueError, match="answers"):
        LoadConfig(target="http://127.0.0.1:1", answers="mine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="temperature"):
        LoadConfig(target="http://127.0.0.1:1", temperature=2.5)


def test_a_sampling_client_seeds_each_turn_so_sessions_differ_and_replays_repeat(
    fake: FakeChatServer,
) -> None:
    workload = _workload(3)
    _run(LoadConfig(target=fake.url, concurrency=3, progress=False), workload)
    assert {s.sampling for s in fake.seen} == {(0.0, None)}  # greedy: no seed
    runs = []
    for _ in range(2):
        fake.seen.clear()
        cfg = LoadConfig(target=fake.url, concurrency=3, progress=False, temperature=0.8)
        _run(cfg, workload)
        runs.append(sorted((s.user_text, s.n_messages, s.sampling) for s in fake.seen))
    assert runs[0] == runs[1]  # the same seeds again
    seeds = [seed for _, _, (temperature, seed) in runs[0] if temperature == 0.8]
    assert len(seeds) == len(workload) == len(set(seeds))  # one per session and turn


@pytest.mark.slow
def test_session_id_only_when_given_and_never_a_cookie(fake: FakeChatServer) -> None:
    workload = _workload(8)
    assert any(r.session_id is None for r in workload)
    assert any(r.session_id is not None for r in workload)
    _run(LoadConfig(target=fake.url, concurrency=2, progress=False), workload)
    sent = sorted(fake.seen, key=lambda s: s.start)
    assert len(sent) == len(workload)
    expected = {r.session_id for r in workload}
    assert {s.session for s in sent} == expected
    assert sum(s.session is None for s in sent) == sum(r.session_id is None for r in workload)
    # The fake answers every request with Set-Cookie; the client must not send it back.
    assert all(s.cookie is None for s in sent)


@pytest.mark.slow
def test_ttft_is_the_first_content_chunk(fake: FakeChatServer) -> None:
    fake.first_token_delay_s = 0.2
    fake.rest_delay_s = 0.3
    report = _run(
        LoadConfig(target=fake.url, concurrency=1, requests=2, progress=False), _workload(1)
    )
    assert report.ok == 2
    for r in report.results:
        assert r.ttft_s is not None
        # Not the opening role-only chunk (at once), not the end of the stream (0.3 s later).
        assert r.ttft_s >= 0.2
        assert r.e2e_s >= r.ttft_s + 0.29
        assert r.prompt_tokens > 0 and r.cached_tokens == r.prompt_tokens // 2


def test_errors_are_counted_not_raised(fake: FakeChatServer) -> None:
    workload = _workload(4)
    target = workload[1].messages[-1]["content"]
    fake.fail_when = target
    report = _run(LoadConfig(target=fake.url, concurrency=2, progress=False), workload)
    failing = sum(r.messages[-1]["content"] == target for r in workload)
    assert report.errors == failing > 0
    assert report.error_kinds == {"http 500": failing}
    assert report.ok == len(workload) - failing


def test_request_cap_and_cache_figures_from_metrics(fake: FakeChatServer) -> None:
    fake.cached_share = 0.75
    report = _run(
        LoadConfig(
            target=fake.url,
            concurrency=2,
            requests=5,
            metrics_urls=(fake.url + "/metrics",),
            progress=False,
        ),
        _workload(),
    )
    assert report.requests == 5 == len(fake.seen)
    assert report.token_hit_ratio == pytest.approx(0.75, abs=0.01)
    assert report.recomputed_share == pytest.approx(0.25, abs=0.01)
    assert report.client_token_hit_ratio == pytest.approx(0.75, abs=0.01)


def test_the_report_splits_each_ttft_into_the_servers_phases(fake: FakeChatServer) -> None:
    fake.first_token_delay_s = 0.08
    report = _run(
        LoadConfig(
            target=fake.url,
            concurrency=2,
            requests=6,
            metrics_urls=(fake.url + "/metrics",),
            progress=False,
        ),
        _workload(),
    )
    b = report.breakdown
    assert b["requests"] == 6
    phases = b["phases"]
    rows = ("tokenize", "queue", "lookup", "lease", "map_verify", "prefill", "until_text")
    total = sum(phases[r]["mean_s"] for r in (*rows, "server_other", "transport"))
    assert total == pytest.approx(phases["ttft"]["mean_s"], rel=1e-6)  # the rows add up
    assert phases["prefill"]["mean_s"] == pytest.approx(0.08)
    assert phases["transport"]["mean_s"] >= 0  # the client saw the token after the server
    assert 0.5 < phases["prefill"]["share"] <= 1.0
    assert b["ttft_over_floor_p50"] is not None and b["ttft_over_floor_p50"] > 0
    assert b["store"] == {"count": 6, "mean_s": pytest.approx(0.004)}
    table = format_breakdown({"run": b})
    assert "prefill of the uncached tail" in table and "TTFT P50 / floor P50" in table
    assert "where the time to first token went" in format_report(report)


def test_duration_stops_new_requests(fake: FakeChatServer) -> None:
    fake.first_token_delay_s = 0.1
    report = _run(
        LoadConfig(target=fake.url, concurrency=1, duration_s=0.25, progress=False), _workload()
    )
    assert 1 <= report.requests <= 3


def test_percentile_and_counter_parsing() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    text = (
        "# TYPE dscache_server_cache_hits counter\n"
        'dscache_server_cache_hits_total{level="block"} 7.0\n'
        'dscache_server_cache_hits_created{level="block"} 1.7e9\n'
        'dscache_server_cache_hits_total{level="token"} 1792.0\n'
        "# TYPE other counter\n"
        'other_total{level="block"} 99.0\n'
    )
    assert parse_counters(text) == {
        'dscache_server_cache_hits{level="block"}': 7.0,
        'dscache_server_cache_hits{level="token"}': 1792.0,
    }


def test_think_times_are_seeded_bounded_and_start_with_none() -> None:
    pauses = think_times("s00001-ACME", 40, 2.0)
    assert pauses == think_times("s00001-ACME", 40, 2.0)  # a replay waits the same
    assert pauses[0] == 0.0 and all(0 < p <= 8.0 for p in pauses[1:])
    assert think_times("s00002-ACME", 40, 2.0) != pauses
    assert think_times("s", 5, 0.0) == [0.0] * 5 and think_times("s", 1, 2.0) == [0.0]


@pytest.mark.slow
def test_a_session_thinks_between_turns_and_others_go_on(fake: FakeChatServer) -> None:
    workload = _workload(4)
    cfg = LoadConfig(target=fake.url, concurrency=4, progress=False, think_s=0.3)
    report = _run(cfg, workload)
    assert report.errors == 0 and report.requests == len(workload)
    results = {(r.session, r.turn): r for r in report.results}
    for (session, turn), cur in results.items():
        if turn == 0:
            continue
        prev = results[(session, turn - 1)]
        wanted = think_times(session, turn + 1, 0.3)[turn]
        # The next question comes only after the answer and the user's pause.
        assert cur.started_s >= prev.started_s + prev.e2e_s + wanted - 0.01
    # Four live sessions: while one thinks, others send.
    spans = sorted((s.start, s.end) for s in fake.seen)
    assert sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1]) > 0


def test_should_stop_ends_the_run_between_requests(fake: FakeChatServer) -> None:
    stop = {"now": False}

    def on_result(_res: object) -> None:
        stop["now"] = True  # after the first answer nothing new starts

    cfg = LoadConfig(target=fake.url, concurrency=1, progress=False)
    report = asyncio.run(
        run_load(cfg, _workload(3), on_result=on_result, should_stop=lambda: stop["now"])
    )
    assert report.requests == 1
