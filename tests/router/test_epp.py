"""The picker as an InferencePool endpoint picker: Envoy ext_proc over real gRPC.

Each test drives ``envoy.service.ext_proc.v3.ExternalProcessor/Process`` as a
gateway does (the generated Envoy API of xds-protos on both ends): request headers
and body in, the pick out as a header and ``envoy.lb`` metadata, the served pod
reported back on the response headers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from dscache_router.cli import add_picker_arguments
from dscache_router.epp import (
    BODY_CHUNK,
    DESTINATION,
    LB_NAMESPACE,
    OBJECTIVE_HEADER,
    SERVED,
    SUBSET,
    SUBSET_NAMESPACE,
    EndpointPicker,
    EppSettings,
    PoolFileWatcher,
    Refusal,
    read_pool_file,
    serve,
)
from dscache_router.picker import Picker, PickerSettings
from dscache_router.ring import Ring
from dscache_router.serve import run_from_args
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_sidecar.holdings import HoldingsFilter
from dscache_tools.net import free_port
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_picker import BT, DOC, ROOT, A, B, C, _serve_wsgi, chat, keys_of

from dscache.routing import CONVERSATIONS_PATH, SessionLedger, answered_key, conversation_key

CANARY = "10.0.1.1:8000"
DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED


@pytest.fixture(scope="module")
def tokenizer() -> DeepSeekTokenizer:
    return DeepSeekTokenizer()


class Served:
    """An endpoint picker on a real gRPC port, its loop on a thread of its own."""

    def __init__(self, picker: Picker, settings: EppSettings) -> None:
        self.epp = EndpointPicker(picker, settings)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.server, self.port = asyncio.run_coroutine_threadsafe(
            serve(self.epp, "127.0.0.1", 0), self.loop
        ).result(10)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)

    def process(self, requests: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
        return list(self.stub.Process(iter(requests), timeout=20))

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def make(tokenizer: DeepSeekTokenizer, locate_timeout_s: float = 0.15, **kw: Any) -> Served:
    picker = Picker(PickerSettings(memory_s=60.0, locate_timeout_s=locate_timeout_s), tokenizer)
    endpoints = kw.pop("endpoints", {A: "stable", B: "stable", C: "stable"})
    for pod in endpoints:
        picker.set_keyinfo(pod, ROOT, BT)
    return Served(picker, EppSettings(endpoints=endpoints, **kw))


@pytest.fixture
def epp(tokenizer: DeepSeekTokenizer) -> Iterator[Served]:
    s = make(tokenizer)
    yield s
    s.close()


def headers_msg(
    session: str = "",
    *,
    end: bool = False,
    subset: list[str] | None = None,
    mode: int | None = DUPLEX,
    objective: str = "",
) -> pb.ProcessingRequest:
    hs = [(":method", "POST"), (":path", "/v1/chat/completions")]
    if session:
        hs.append(("x-session-id", session))
    if objective:
        hs.append((OBJECTIVE_HEADER, objective))
    req = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]
            ),
            end_of_stream=end,
        )
    )
    if mode is not None:
        req.protocol_config.request_body_mode = mode
        req.protocol_config.response_body_mode = mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({SUBSET: subset})
        req.metadata_context.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return req


def body_msgs(body: bytes, chunk: int = 20_000) -> list[pb.ProcessingRequest]:
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    return [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
        for i, p in enumerate(parts)
    ]


def served_msg(pod: str) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(response_headers=pb.HttpHeaders())
    lb = struct_pb2.Struct()
    lb.update({SERVED: pod})
    req.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(lb)
    return req


def request(
    messages: list[dict[str, str]], session: str = "", **kw: Any
) -> list[pb.ProcessingRequest]:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return [headers_msg(session, **kw), *body_msgs(body)]


def header_of(common: pb.CommonResponse, name: str) -> str | None:
    for opt in common.header_mutation.set_headers:
        if opt.header.key == name.lower():
            return bytes(opt.header.raw_value).decode()
    return None


def picked(resps: list[pb.ProcessingResponse]) -> list[str]:
    """The pods the pick names, checking header and metadata agree."""
    first = resps[0]
    where = first.WhichOneof("response")
    assert where in ("request_headers", "request_body"), first
    common = getattr(first, where).response
    value = header_of(common, DESTINATION)
    meta = json_format.MessageToDict(first.dynamic_metadata)
    assert value is not None and meta == {LB_NAMESPACE: {DESTINATION: value}}
    assert common.clear_route_cache
    return value.split(",")


def reason(resps: list[pb.ProcessingResponse]) -> str | None:
    for r in resps:
        if r.WhichOneof("response") == "response_headers":
            return header_of(r.response_headers.response, "x-dscache-pick-reason")
    return None


def test_the_pick_names_the_pod_then_its_tracks_ring_order_in_header_and_metadata(
    epp: Served,
) -> None:
    resps = epp.process(request(chat("Hello there."), "s-1"))
    pods = picked(resps)
    assert pods == Ring([A, B, C]).walk("s-1"), "the ring's order: the gateway's retries"
    assert resps[0].WhichOneof("response") == "request_headers"


def test_the_body_goes_back_unchanged_in_chunks_after_the_headers(epp: Served) -> None:
    messages = chat(DOC * 30, "Long question?")
    body = json.dumps({"messages": messages}).encode()
    assert len(body) > BODY_CHUNK
    resps = epp.process([headers_msg("s-2"), *body_msgs(body)])
    back = [r.request_body.response.body_mutation.streamed_response for r in resps[1:]]
    assert all(len(b.body) <= BODY_CHUNK for b in back) and len(back) >= 2
    assert b"".join(b.body for b in back) == body
    assert [b.end_of_stream for b in back] == [False] * (len(back) - 1) + [True]


def test_the_response_body_goes_back_unchanged_as_the_response_bodys_answer(
    epp: Served,
) -> None:
    answer = b"data: " + b"x" * (BODY_CHUNK + 100) + b"\n\n"
    parts = [answer[:70_000], answer[70_000:]]
    msgs = [
        *request(chat("Hi."), "s-13"),
        served_msg(""),
        *(
            pb.ProcessingRequest(
                response_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1)
            )
            for i, p in enumerate(parts)
        ),
    ]
    resps = epp.process(msgs)
    back = [r for r in resps if r.WhichOneof("response") == "response_body"]
    streamed = [r.response_body.response.body_mutation.streamed_response for r in back]
    assert b"".join(s.body for s in streamed) == answer
    assert all(len(s.body) <= BODY_CHUNK for s in streamed)
    assert [s.end_of_stream for s in streamed][-1] and not any(
        s.end_of_stream for s in streamed[:-1]
    )
    # Every answer is for the phase it answers: no request-body answer after the pick's.
    kinds = [r.WhichOneof("response") for r in resps]
    assert kinds.index("response_headers") > max(
        i for i, k in enumerate(kinds) if k == "request_body"
    )


def test_the_pod_holding_the_longest_prefix_takes_the_next_turn(
    epp: Served, tokenizer: DeepSeekTokenizer
) -> None:
    turn1 = chat(DOC, "What grew most?")
    turn2 = chat(DOC, "What grew most?", "Segment 6.", "And least?")
    holder = next(p for p in (A, B, C) if p != Ring([A, B, C]).walk("p-none")[0])
    epp.epp.picker.set_holdings(holder, HoldingsFilter.of(keys_of(tokenizer, turn1), 1000))
    resps = epp.process([*request(turn2), served_msg(holder)])
    assert picked(resps)[0] == holder and reason(resps) == "prefix"


def test_a_turn_without_its_id_goes_where_its_conversation_is_whatever_the_weight(
    tokenizer: DeepSeekTokenizer,
) -> None:
    endpoints = {A: "stable", B: "stable", CANARY: "canary"}
    s = make(tokenizer, endpoints=endpoints, track_weights={"canary": 100})
    try:
        answer = "Segment 6 grew the most, six percent in fiscal 2006, ahead of all the others."
        turn2 = chat(DOC, "What grew most?", answer, "And least?")
        # B served the conversation's first turn (its answer included): every pod of
        # both tracks holds the opening, only B what came after it.
        opening = keys_of(tokenizer, chat(DOC, "What grew most?"))
        for pod in endpoints:
            s.epp.picker.set_holdings(pod, HoldingsFilter.of(opening, 1000))
        s.epp.picker.set_holdings(B, HoldingsFilter.of(keys_of(tokenizer, turn2)[:-1], 1000))
        resps = s.process(request(turn2))  # no session id: keyed by its opening
        assert picked(resps)[0] == B
        # A new conversation with the same opening follows the weight: the canary.
        assert picked(s.process(request(chat(DOC, "What shrank?"))))[0] == CANARY
    finally:
        s.close()


def ledger_pod(ledger: SessionLedger) -> tuple[str, Callable[[], None]]:
    """A stand-in for a pod's conversation ledger route (the model server's own is
    tested in ``tests/server/test_auth.py``): a real ledger behind a WSGI server."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = str(environ["PATH_INFO"])
        age = ledger.age(path.removeprefix(CONVERSATIONS_PATH))
        if not path.startswith(CONVERSATIONS_PATH) or age is None:
            start_response("404 Not Found", [("Content-Type", "application/json")])
            return [b'{"inflight": 0}']
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps({"age_s": age, "inflight": 0}).encode()]

    url, stop = _serve_wsgi(app)
    return url.removeprefix("http://"), stop


def test_where_the_blocks_cannot_tell_the_pods_ledgers_place_a_turn_without_its_id(
    tokenizer: DeepSeekTokenizer,
) -> None:
    # A short answer and question fit in the block after the opening, which no pod
    # stores whole: every pod holds the opening, none anything past it. The pod that
    # served the first turn knows it; the canary weight would send the turn away.
    ledgers = [SessionLedger() for _ in range(3)]
    pods = [ledger_pod(ledger) for ledger in ledgers]
    stable_a, stable_b, canary = (address for address, _ in pods)
    endpoints = {stable_a: "stable", stable_b: "stable", canary: "canary"}
    # The ledgers answer from threads of this process: on a loaded machine one missed the
    # router's 150 ms once and the turn followed the weight (what a timeout should do,
    # but not what this test is about).
    s = make(tokenizer, locate_timeout_s=10.0, endpoints=endpoints, track_weights={"canary": 100})
    try:
        cases = (("What grew most?", None), ("What shrank most?", 1), ("What held?", 1))
        for question, served in cases:
            first = chat(DOC, question)
            for pod in endpoints:
                s.epp.picker.set_holdings(pod, HoldingsFilter.of(keys_of(tokenizer, first), 1000))
            if served is not None:  # stable_b served this conversation's first turn
                ledgers[served].seen(conversation_key(first))
            if question == "What held?":
                # ... and answered it; stable_a answered another user's alike first
                # turn since, differently: the answer tells them apart.
                ledgers[served].seen(answered_key(first, "Segment 6."))
                ledgers[0].seen(conversation_key(first))
                ledgers[0].seen(answered_key(first, "Segment 2."))
            turn2 = [
                *first,
                {"role": "assistant", "content": "Segment 6."},
                {"role": "user", "content": "And least?"},
            ]
            # No session id: keyed by its opening, placed by the pods' ledgers, else
            # by the weight.
            want = canary if served is None else stable_b
            assert picked(s.process(request(turn2)))[0] == want, question
        assert s.epp.picker.metrics.conversations.labels("found")._value.get() == 2
    finally:
        s.close()
        for _, stop in pods:
            stop()


def test_the_subset_hint_limits_the_pick_and_an_empty_one_is_503(epp: Served) -> None:
    resps = epp.process(request(chat("Hi."), "s-3", subset=[C]))
    assert picked(resps) == [C]
    refused = epp.process(request(chat("Hi."), "s-4", subset=["10.9.9.9:8000"]))
    assert refused[0].immediate_response.status.code == 503


def test_a_fallback_that_served_moves_the_session_and_its_blocks_there(
    epp: Served, tokenizer: DeepSeekTokenizer
) -> None:
    turn1 = chat(DOC, "First?")
    chosen, fallback = Ring([A, B, C]).walk("s-5")[:2]  # nothing held: the ring decides
    # The gateway could not reach `chosen` and its retry reached `fallback`.
    first = epp.process([*request(turn1, "s-5"), served_msg(fallback)])
    assert picked(first)[:2] == [chosen, fallback]
    again = epp.process([*request(chat(DOC, "First?", "Yes.", "Second?"), "s-5")])
    assert picked(again)[0] == fallback
    # An id-less turn of the same conversation finds its blocks at the fallback too.
    idless = epp.process([*request(chat(DOC, "Other first?")), served_msg("")])
    assert picked(idless)[0] == fallback and reason(idless) == "prefix"
    registry = epp.epp.picker.metrics.registry
    assert registry.get_sample_value("dscache_epp_served_elsewhere_total") == 1


def hold(
    s: Served, messages: list[pb.ProcessingRequest]
) -> tuple[queue.Queue[pb.ProcessingRequest | None], Iterator[pb.ProcessingResponse]]:
    """A request whose stream stays open (in flight) until None is put on its queue."""
    pending: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
    for m in messages:
        pending.put(m)

    def feed() -> Iterator[pb.ProcessingRequest]:
        while (item := pending.get()) is not None:
            yield item

    stream = s.stub.Process(feed(), timeout=20)
    assert next(stream).WhichOneof("response") == "request_headers"
    return pending, stream


def test_at_the_bound_a_sheddable_request_is_429_and_a_critical_one_goes_to_the_least_loaded(
    tokenizer: DeepSeekTokenizer,
) -> None:
    objectives = {"batch-summaries": -1, "chat": 10}
    s = make(tokenizer, endpoints={A: "stable", B: "stable"}, max_inflight=1, objectives=objectives)
    try:
        streams = [hold(s, request(chat("Hi."), session)) for session in ("s-7", "s-9")]
        assert {s.epp.pool.inflight(A), s.epp.pool.inflight(B)} == {1}

        # Sheddable (a negative priority): dropped, not queued on a busy pod.
        shed = s.process(request(chat("Other."), "s-8", objective="batch-summaries"))
        assert shed[0].immediate_response.status.code == 429
        # No objective (priority 0, as the extension has it) and a positive one: served
        # past the bound, by the least loaded pod.
        for session, objective in (("s-10", ""), ("s-11", "chat")):
            assert picked(s.process(request(chat("Other."), session, objective=objective)))
        registry = s.epp.picker.metrics.registry
        count = registry.get_sample_value
        assert count("dscache_epp_saturated_requests_total", {"action": "shed"}) == 1
        assert count("dscache_epp_saturated_requests_total", {"action": "routed"}) == 2

        # A request ends: there is room again, even for the sheddable.
        pending, stream = streams[0]
        pending.put(None)
        list(stream)
        for _ in range(50):  # the server sees the end a moment after the client
            if 0 in (s.epp.pool.inflight(A), s.epp.pool.inflight(B)):
                break
            threading.Event().wait(0.05)
        assert picked(s.process(request(chat("Other."), "s-8", objective="batch-summaries")))
        pending, stream = streams[1]
        pending.put(None)
        list(stream)
    finally:
        s.close()


def test_the_least_loaded_pod_takes_a_critical_request_past_the_bound(
    tokenizer: DeepSeekTokenizer,
) -> None:
    s = make(tokenizer, endpoints={A: "stable", B: "stable"}, max_inflight=1)
    try:
        pool = s.epp.pool
        for _ in range(3):
            pool.started(A)
        pool.started(B)
        decision = s.epp.decide({}, json.dumps({"messages": chat("Hi.")}).encode(), None)
        assert not isinstance(decision, Refusal)
        assert decision.endpoints[0] == B and decision.reason == "overloaded"
    finally:
        s.close()


def test_sessions_keep_the_track_they_started_on(tokenizer: DeepSeekTokenizer) -> None:
    endpoints = {A: "stable", B: "stable", CANARY: "canary"}
    s = make(tokenizer, endpoints=endpoints, track_weights={"canary": 30})
    try:
        tracks = {}
        for i in range(60):
            pods = picked(s.process(request(chat(f"Hello {i}."), f"sess-{i}")))
            tracks[f"sess-{i}"] = endpoints[pods[0]]
            # Fallbacks stay on the track: a retry never splits a conversation.
            assert {endpoints[p] for p in pods} == {tracks[f"sess-{i}"]}
        share = sum(t == "canary" for t in tracks.values()) / len(tracks)
        assert 0.1 < share < 0.5, share
        for key, track in list(tracks.items())[:20]:
            pods = picked(s.process(request(chat("Next turn."), key)))
            assert endpoints[pods[0]] == track
    finally:
        s.close()


def test_buffered_mode_answers_the_headers_at_once_and_picks_on_the_body(epp: Served) -> None:
    resps = epp.process(request(chat("Hi."), "s-9", mode=BUFFERED))
    assert resps[0].WhichOneof("response") == "request_headers"
    assert not resps[0].request_headers.response.header_mutation.set_headers
    assert picked(resps[1:]) == Ring([A, B, C]).walk("s-9")


def test_a_request_without_a_body_is_picked_at_its_headers(epp: Served) -> None:
    resps = epp.process([headers_msg("s-10", end=True)])
    assert picked(resps)[0] in (A, B, C)
    # Body mode NONE: no body will come, so the headers' answer carries the pick.
    none = epp.process([headers_msg("s-10", mode=processing_mode_pb2.ProcessingMode.NONE)])
    assert picked(none) == picked(resps)


def test_without_protocol_config_the_pick_comes_with_the_headers_answer(epp: Served) -> None:
    """As the extension's reference picker answers: NGINX Gateway Fabric's shim sends no
    protocol_config, then the body, and reads the pick from the headers' answer."""
    resps = epp.process(request(chat("Hi."), "s-12", mode=None))
    assert resps[0].WhichOneof("response") == "request_headers"
    assert picked(resps) == Ring([A, B, C]).walk("s-12")


def test_a_body_over_the_limit_is_413(tokenizer: DeepSeekTokenizer) -> None:
    s = make(tokenizer, max_body=1000)
    try:
        body = json.dumps({"messages": chat("x" * 5000)}).encode()
        resps = s.process([headers_msg("s-11"), *body_msgs(body, 600)])
        assert resps[0].immediate_response.status.code == 413
    finally:
        s.close()


def test_grpc_health_reports_serving(epp: Served) -> None:
    stub = health_pb2_grpc.HealthStub(epp.channel)
    for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
        got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING


def test_settings_refuse_a_bad_pool() -> None:
    with pytest.raises(ValueError, match="host:port"):
        EppSettings(endpoints={"10.0.0.1": "stable"})
    with pytest.raises(ValueError, match="more than 100"):
        EppSettings(endpoints={A: "stable"}, track_weights={"a": 60, "b": 50})


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--epp-endpoint", "nonsense"], "IP:PORT=TRACK"),
        (["--epp-endpoint", "10.0.0.1:8000=stable", "--epp-track-weight", "canary"], "TRACK="),
        (["--epp-endpoint", "10.0.0.1:8000=", "--epp-max-inflight", "1"], "IP:PORT=TRACK"),
        (["--epp-endpoint", "10.0.0.1:8000", "--epp-max-inflight", "-1"], "0 or more"),
        (["--epp"], "--epp-endpoint or --epp-pool-file"),
        (["--epp-endpoint", "10.0.0.1:8000", "--epp-objective", "chat"], "NAME=PRIORITY"),
        (["--epp-endpoint", "10.0.0.1:8000", "--epp-objective", "chat=high"], "NAME=PRIORITY"),
    ],
)
def test_the_cli_refuses_bad_epp_flags(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_picker_arguments(parser)
    assert run_from_args(parser.parse_args(["--epp", *flags])) == 2
    assert says in capsys.readouterr().out


@pytest.mark.slow
def test_dscache_picker_epp_serves_ext_proc_and_health() -> None:
    port, epp_port = free_port(), free_port()
    # Pods on loopback ports nothing listens on: the refresher's fetches stay here.
    pod, canary = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dscache.cli",
            "picker",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--epp",
            "--epp-port",
            str(epp_port),
            "--epp-endpoint",
            f"{pod}=stable",
            "--epp-endpoint",
            f"{canary}=canary",
            "--epp-track-weight",
            "canary=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{epp_port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        stub = pb_grpc.ExternalProcessorStub(channel)
        resps = list(stub.Process(iter(request(chat("Hi."), "cli-1")), timeout=20))
        assert picked(resps) == [pod], "canary weight 0: every new session on stable"
        channel.close()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal


def test_the_pool_file_replaces_the_pool_and_sessions_carry_over(
    tokenizer: DeepSeekTokenizer, tmp_path: Path
) -> None:
    pool = tmp_path / "epp-pool.json"
    s = make(tokenizer, endpoints={})
    watcher = PoolFileWatcher(s.epp, pool)
    try:
        assert not watcher.check()  # no file yet: no pool, every request 503
        assert s.process(request(chat("Hi."), "f-1"))[0].immediate_response.status.code == 503
        pool.write_text(json.dumps({"endpoints": {A: "blue", B: "blue"}}))
        assert watcher.check() and not watcher.check()  # read once, then unchanged
        first = picked(s.process(request(chat("Hi."), "f-1")))[0]
        # A canary slot joins at 100% of new sessions: f-1 keeps its track and pod.
        doc = {"endpoints": {A: "blue", B: "blue", CANARY: "green"}, "trackWeights": {"green": 100}}
        pool.write_text(json.dumps(doc))
        assert watcher.check()
        assert picked(s.process(request(chat("Next."), "f-1")))[0] == first
        assert picked(s.process(request(chat("Hi."), "f-2"))) == [CANARY]
        # A broken file keeps the last good pool, and says so in a metric (as the
        # missing one did).
        registry = s.epp.picker.metrics.registry
        assert registry.get_sample_value("dscache_epp_pool_file_errors_total") == 1
        pool.write_text('{"endpoints": {"nonsense": "blue"}}')
        assert not watcher.check()
        assert registry.get_sample_value("dscache_epp_pool_file_errors_total") == 2
        assert registry.get_sample_value("dscache_epp_endpoints") == 3
        assert picked(s.process(request(chat("Hi."), "f-2"))) == [CANARY]
        # The operator copies the pool's InferenceObjectives into the file.
        doc["objectives"] = {"batch": -5, "chat": 3}
        pool.write_text(json.dumps(doc))
        assert watcher.check()
        assert s.epp.settings.objectives == {"batch": -5, "chat": 3}
    finally:
        s.close()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("[]", "not a JSON object"),
        ('{"endpoints": ["10.0.0.1:8000"]}', "ip:port to a track"),
        ('{"endpoints": {"10.0.0.1:8000": ""}}', "ip:port to a track"),
        ('{"endpoints": {}, "trackWeights": {"a": "10"}}', "to a percent"),
        ('{"endpoints": {}, "trackWeights": {"a": 101}}', "percent"),
        ('{"endpoints": {"10.0.0.1": "blue"}}', "host:port"),
        ('{"endpoints": {}, "objectives": ["chat"]}', "a name to a priority"),
        ('{"endpoints": {}, "objectives": {"chat": "high"}}', "whole number"),
        ('{"endpoints": {}, "objectives": {"chat": true}}', "whole number"),
    ],
)
def test_a_malformed_pool_file_is_refused(text: str, says: str, tmp_path: Path) -> None:
    path = tmp_path / "pool.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        read_pool_file(path)
