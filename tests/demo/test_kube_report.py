"""``dscache demo kubernetes``: the figures it reports from what the client saw.

The run itself needs a cluster whose pods run (tests/e2e); these check the
arithmetic of its report on requests made up here.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from dscache_router.picker import PickerMetrics
from dscache_tools.demo.kube.report import (
    format_table,
    lookups_line,
    moves,
    phase_report,
    ratios,
    restore_started,
    sessions_moved,
    sessions_moved_by_key,
)
from dscache_tools.demo.kube.watch import Phase, router_lookups
from dscache_tools.loadgen import RequestResult
from dscache_tools.net import free_port
from prometheus_client import generate_latest

from dscache import metricnames as names


def _req(t: float, prompt: int, cached: int, ttft: float = 0.2, ok: bool = True) -> tuple:
    res = RequestResult(
        session="s",
        turn=0,
        session_id=None,
        ok=ok,
        status=200 if ok else 503,
        started_s=t,
        ttft_s=ttft if ok else None,
        e2e_s=1.0,
        prompt_tokens=prompt if ok else 0,
        cached_tokens=cached if ok else 0,
    )
    return (t, res)


def _phase(
    name: str, before_cached: int, during_cached: int, errors: int = 0, label: str = "weight"
) -> Phase:
    phase = Phase(name, started=100.0, completed=160.0)
    # The steady state: 10% of each 1,000-token prompt recomputed.
    phase.before = [_req(50.0 + i, 1000, before_cached) for i in range(10)]
    phase.results = [_req(100.0 + i, 1000, during_cached) for i in range(20)]
    phase.results += [_req(130.0, 0, 0, ok=False) for _ in range(errors)]
    phase.events = [(100.0, label, 0.0 if label == "weight" else (0, 2, 2))]
    return phase


def _report() -> dict:
    canary = phase_report(_phase("warm_canary", 900, 890), "weight")
    blind = phase_report(
        _phase("blind_rolling", 900, 700, errors=2, label="blue_updated"), "blue_updated"
    )
    return {
        "warm_canary": canary,
        "blind_rolling": blind,
        "ratios": ratios(canary, blind),
        "promoted": True,
        "bad_revision_rolled_back": True,
        "router_weight_latency_s": 1.0,
        "router_weight_latency_samples_s": [1.0],
    }


def test_recomputed_tokens_are_prompt_minus_cached_and_errors_are_counted() -> None:
    report = _report()
    blind = report["blind_rolling"]
    assert blind["prompt_tokens"] == 20_000 and blind["recomputed_tokens"] == 6_000
    assert blind["errors"] == 2 and blind["requests"] == 22
    assert blind["rollout_s"] == 60.0


def test_the_rollouts_cost_is_measured_beyond_the_steady_state() -> None:
    report = _report()
    canary, blind = report["warm_canary"], report["blind_rolling"]
    assert canary["steady_recomputed_share"] == blind["steady_recomputed_share"] == 0.1
    # Blind: 30% recomputed where the same traffic recomputed 10%: 20% extra.
    assert blind["excess_recomputed_tokens"] == 4_000
    assert canary["excess_recomputed_tokens"] == 200
    assert report["ratios"]["excess_recomputed_share"] == 0.05
    assert report["ratios"]["recomputed_share"] == round(0.11 / 0.3, 3)


def test_a_canary_below_its_steady_state_costs_nothing_not_less() -> None:
    canary = phase_report(_phase("warm_canary", 900, 950), "weight")
    blind = phase_report(_phase("blind_rolling", 900, 700), "weight")
    assert canary["excess_recomputed_tokens"] < 0
    assert ratios(canary, blind)["excess_recomputed_share"] == 0.0


def test_the_table_names_each_figure_and_the_targets() -> None:
    text = format_table(_report())
    assert "| recomputed share | 0.110 | 0.300 | 0.37x |" in text
    assert "| recomputed beyond that share | 0.010 | 0.200 | 0.05x |" in text
    assert "target recomputed_share canary/blind <= 0.3: 0.367 MISSED" in text


def test_the_blind_window_ends_where_the_operator_puts_its_template_back() -> None:
    phase = Phase("blind_rolling", started=100.0, completed=130.0)
    phase.events = [
        (100.5, "green_updated", (1, 2, 3)),  # the blind update itself
        (130.0, "green_updated", (2, 2, 2)),
        (135.0, "green_updated", (1, 2, 3)),  # a second rollout: the template restored
    ]
    assert restore_started(phase, "green_updated") == 135.0
    phase.events = phase.events[:2]
    assert restore_started(phase, "green_updated") is None


def _turn(session: str, turn: int, t: float, pod: str | None) -> RequestResult:
    return RequestResult(
        session=session,
        turn=turn,
        session_id=session,
        ok=pod is not None,
        status=200 if pod else 502,
        started_s=t,
        ttft_s=0.1,
        e2e_s=0.5,
        upstream=pod,
    )


def test_a_session_moved_while_its_pod_served_is_counted_once_and_a_replaced_pod_is_not() -> None:
    a, b, c = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
    results = [
        # moved from a to b at t=10 while a still served (t=12): the router's doing
        _turn("s1", 0, 0.0, a), _turn("s1", 1, 10.0, b), _turn("s1", 2, 20.0, a),
        _turn("other", 0, 12.0, a),
        # moved from c to b after c's last answer (t=5): c went away, not counted
        _turn("s2", 0, 5.0, c), _turn("s2", 1, 15.0, b),
        # a retry's header names both tries: the last one served
        _turn("s3", 0, 1.0, f"{c}, {a}"), _turn("s3", 1, 11.0, a),
        # a failed turn is no placement
        _turn("s4", 0, 2.0, a), _turn("s4", 1, 13.0, None), _turn("s4", 2, 14.0, a),
    ]  # fmt: skip
    assert sessions_moved(results) == 1
    assert sessions_moved([r for r in results if r.session != "s1"]) == 0
    assert sessions_moved_by_key(results) == {"session": 1, "new_id": 0, "no_id": 0}
    # The same move by a turn whose id the gateway dropped, and by a reconnect's new id.
    dropped = [replace(r, session_id=None) if r.turn == 1 else r for r in results]
    assert sessions_moved_by_key(dropped)["no_id"] == 1
    renamed = [replace(r, session_id="s1b") if r.turn >= 1 else r for r in results]
    assert sessions_moved_by_key(renamed)["new_id"] == 1


def test_a_move_of_a_turn_no_router_could_tell_apart_is_named_so() -> None:
    a, b = "10.0.0.1:8000", "10.0.0.2:8000"
    h0, h1, other = "opening+q1", "opening+q1+a1", "opening+q7+a7"

    def turn(session: str, n: int, at: float, pod: str, sid: str | None, history: str, left: str):
        return replace(
            _turn(session, n, at, pod), session_id=sid, history_digest=history, left_digest=left
        )

    results = [
        # two conversations alike to their first answer, on two pods
        turn("s1", 0, 0.0, a, "s1", h0, h1), turn("s2", 0, 1.0, b, "s2", h0, h1),
        # s1's second turn lost its id and went to b, which held the same history
        turn("s1", 1, 10.0, b, None, h1, "x"),
        # s3's went to b too, but b held nothing like its history
        turn("s3", 0, 2.0, a, "s3", "opening+q7", other), turn("s3", 1, 11.0, b, None, other, "y"),
        turn("s2", 1, 12.0, a, "s2", h1, "z"),  # keyed by its own id: a move the router owns
        turn("keep", 0, 13.0, b, "k", "k0", "k1"), turn("keep2", 0, 14.0, a, "k2", "k0", "k1"),
    ]  # fmt: skip
    found = {m.session: m for m in moves(results)}
    assert set(found) == {"s1", "s2", "s3"}
    assert found["s1"].indistinguishable and found["s1"].key == "no_id"
    assert not found["s3"].indistinguishable
    assert found["s2"].key == "session" and not found["s2"].indistinguishable
    assert (found["s1"].before, found["s1"].after) == (a, b)
    # Without the digests (a load generator that records none) nothing is called so.
    bare = [replace(r, history_digest="", left_digest="") for r in results]
    assert not any(m.indistinguishable for m in moves(bare))


def test_the_router_pods_lookups_are_summed_and_a_silent_pod_counts_nothing() -> None:
    # Two router pods' metrics as they serve them: the Lua's counters (the router's
    # text) and the picker's registry (prometheus_client's own exposition).
    pickers = [PickerMetrics(), PickerMetrics()]
    for seconds in (0.01, 0.2, 0.4):  # one answer too slow for the router's 250 ms
        pickers[0].holder_seconds.observe(seconds)
    pickers[1].holder_seconds.observe(0.02)
    pickers[0].conversations.labels("found").inc(2)
    pickers[1].conversations.labels("unknown").inc()
    holders = names.ROUTER_HOLDERS + "_total"
    routers = [
        f'# TYPE {holders} counter\n{holders}{{result="found"}} 3\n{holders}{{result="failed"}} 1\n',
        f'# TYPE {holders} counter\n{holders}{{result="failed"}} 2\n',
    ]
    served = [
        {
            names.ROUTER_METRICS_PATH: r.encode(),
            names.PICKER_METRICS_PATH: generate_latest(p.registry),
        }
        for r, p in zip(routers, pickers, strict=True)
    ]
    port = free_port()
    # Two pod IPs on the router's port (loopback holds all of 127/8).
    servers = [_metrics_server(f"127.0.0.{i + 1}", port, p) for i, p in enumerate(served)]
    try:
        seen = router_lookups(["127.0.0.1", "127.0.0.2", "127.0.0.3"], port=port)
    finally:
        for server in servers:
            server.shutdown()
    assert seen["holders/found"] == 3 and seen["holders/failed"] == 3
    assert seen["holder_answers"] == 4 and seen["holder_answers_in_time"] == 3
    assert seen["conversations/found"] == 2 and seen["conversations/unknown"] == 1
    line = lookups_line(seen)
    assert "sessions none; holders 3 found, 3 failed" in line
    assert "picker answers: 4, 1 over 250 ms" in line
    assert "conversation ledgers 2 found, 1 unknown" in line


def _metrics_server(host: str, port: int, pages: dict[str, bytes]) -> ThreadingHTTPServer:
    class Pages(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
